"""The whole model's dry run: a training step of the real ``LongNetLM`` on meta tensors.

The model, AdamW and the step all run under ``dryrun.LiveBytes`` (parameters,
moments and gradients are counted as they are made); with P > 1 the model's
group is torch's fake process group (``launch.fake_world``), whose all-gathers
give every rank this rank's piece, so the step is that of P pieces of n rows
(N = P n). A first step on a few rows makes AdamW's moments; the second, at
the real length, is measured (Note [model memory] in model.py).

What it does not see: the kernels' own buffers (``KernelBuffers`` adds them
while a kernel runs, as the op's estimate models them for the device), and
the device's plan: the attention on meta tensors
plans with the CPU's block sizes, so a ``--device cuda`` dry run differs
from the formula by the op's working memory.
"""

from __future__ import annotations

import time

from .. import launch
from ...models.lm import LongNetLM
from ..launch import fake_world
from .dryrun import LiveBytes
from .model import ModelEstimate, ModelSetup, op_working_bytes


def dry_run(setup: ModelSetup, mode: str) -> ModelEstimate:
    """The device peak of one training step in checkpoint `mode`, traced."""
    if launch.is_initialized():
        raise ValueError("the dry run needs a process without a default process group")
    import torch._dynamo  # noqa: F401  (see dryrun.trace: imported before any tracing)

    start = time.perf_counter()
    config = _with_mode(setup, mode)
    scratch = op_working_bytes(setup)[1]
    p = setup.world_size
    world = fake_world(0, p) if p > 1 else None
    try:
        tracker = KernelBuffers(scratch)
        with tracker:
            model = LongNetLM(config, device="meta", dtype=setup.torch_dtype,
                              process_group=world, strategy=setup.strategy or "auto")
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            peaks = {}
            for rows in (min(setup.rows, 16), setup.rows):
                # (b, n) token ids and targets on meta
                tokens = torch.zeros(setup.batch, rows, dtype=torch.long, device="meta")
                targets = torch.zeros(setup.batch, rows, dtype=torch.long, device="meta")
                optimizer.zero_grad(set_to_none=True)
                tracker.peak = tracker.live
                _, loss = model(tokens, targets)
                peaks["forward"] = tracker.peak
                tracker.peak = tracker.live
                loss.backward()
                peaks["backward"] = tracker.peak
                tracker.peak = tracker.live
                optimizer.step()
                peaks["optimizer step"] = tracker.peak
                del loss, tokens, targets
    finally:
        if world is not None:
            launch.destroy_process_group()
    stage = max(peaks, key=peaks.get)
    return ModelEstimate(mode, peaks[stage], 0, stage, {
        "peak live bytes (kernel buffers included)": peaks[stage],
        "seconds": round(time.perf_counter() - start, 2)}, method="dry run")


class KernelBuffers(LiveBytes):
    """``LiveBytes`` with what kernels allocate inside and no tracing of tensors sees:
    while an attention kernel runs, `scratch` more bytes (as the op's estimate models them
    for the device)."""

    def __init__(self, scratch: int) -> None:
        super().__init__()
        self.scratch = scratch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if "attention" in func._schema.name.split("::")[-1]:
            self.peak = max(self.peak, self.live + self.scratch)
        return out


def _with_mode(setup: ModelSetup, mode: str):
    import dataclasses

    if mode == "offload" and setup.device == "cpu":
        mode = "layers"  # what the model runs on a CPU device (Note [checkpoint modes])
    return dataclasses.replace(setup.config, checkpoint=mode)
