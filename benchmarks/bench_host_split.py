"""Where the host's time goes in a short training step of the fused kernel on CUDA.

    python benchmarks/bench_host_split.py                  # 8K tokens
    python benchmarks/bench_host_split.py --seq-len 16384

LongNet's setting (12 heads of 64, segments [2048, 4096], rates [1, 2]), bf16,
batch 1, ``backend="triton"``. At 8K tokens a training step's kernels take about
as long as the host takes to issue them (an H200: ~0.86 ms of kernels, ~0.9 ms of
host per step), so the host bounds even a loop that never synchronises. Printed:

- host per call: N calls queued without a synchronise, the host's time divided by
  N (min / median / max over repeats), and the wall time once they are done: a
  training step, a forward without grad, and for scale what torch alone costs
  here: an autograd backward through a Function that does nothing (the engine's
  hand-off to its device thread), four ``empty_like`` of q, and a one-element
  ``zeros`` (the op's non-finite check);
- replayed against kept launches: the same steps with a repeated call's launches
  replayed whole (``triton_launch.Recipes``, as the op does) and with every launch
  bound again from its arguments through the kept compiled kernels (the op before
  recipes), taking turns. (Stop 54 compared the kept launches
  given addresses against tensors here: BENCHMARKS.md, "Stop 54".)
- the pieces of a step: inclusive host time per step of the public call, the
  op's forward and backward at each level, the replays and the launches that
  were not replayed (how many per step), from wrappers around those functions
  (each adds ~1 us).

Needs a CUDA device; without one it says so and exits 0.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time
from typing import Callable, Dict, List

import torch

from dilated_attention import dilated, functional, fused, triton_launch

SEGMENTS, RATES = [2048, 4096], [1, 2]


def per_call(call: Callable[[], object], calls: int, repeats: int) -> str:
    """Host and queued wall microseconds per call, min/median/max over `repeats`."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        host.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - start) / calls * 1e6)
    return f"host {_spread(host)} us, queued wall {_spread(wall)} us"


def _spread(values: List[float]) -> str:
    values = sorted(values)
    return f"{values[0]:.0f}/{statistics.median(values):.0f}/{values[-1]:.0f}"


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _NoRecipes:
    """fused.RECIPES as it was before recipes: nothing replayed, every launch through the
    kept compiled kernels (triton_launch.launcher)."""

    def replay(self, key, tensors) -> bool:
        return False

    def recorder(self, key, tensors, kept) -> "_NoRecipes":
        return self

    def __call__(self, kernel):
        return triton_launch.launcher(kernel)

    def keep(self) -> None:
        pass


def replayed_against_kept(step: Callable[[], None], calls: int, turns: int) -> List[str]:
    """Host microseconds per step with repeated calls' launches replayed (the op's way) and
    bound from their arguments each call, taking turns."""
    recipes = fused.RECIPES
    got: Dict[str, List[float]] = {"replayed": [], "kept launches": []}
    try:
        for turn in range(turns):
            mode = ("replayed", "kept launches")[turn % 2]
            fused.RECIPES = recipes if mode == "replayed" else _NoRecipes()
            for _ in range(10):
                step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                step()
            got[mode].append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    finally:
        fused.RECIPES = recipes
    return [f"{mode}: host {_spread(values)} us" for mode, values in got.items()]


def pieces(step: Callable[[], None], steps: int) -> List[str]:
    """Inclusive host microseconds per step of the step's pieces, from timing wrappers."""
    spent: Dict[str, float] = collections.defaultdict(float)
    counts: Dict[str, int] = collections.Counter()

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
                counts[name] += 1
        return wrapper

    # (owner, attribute): the owner's attribute is looked up at call time, so wrapping it
    # there times every call the step makes
    targets = [(functional, "dilated_attention"), (dilated, "forward_local"),
               (dilated, "_backward"), (fused, "_forward"), (fused, "_backward"),
               (fused, "new_check"), (triton_launch.Recipes, "replay"),
               (triton_launch.Launcher, "_launch"),
               (torch.Tensor, "backward")]
    originals = [(owner, name, getattr(owner, name)) for owner, name in targets]
    try:
        for owner, name, original in originals:
            setattr(owner, name, timed(f"{owner.__name__.rsplit('.', 1)[-1]}.{name}", original))
        timed_step = timed("step", step)
        for _ in range(5):
            timed_step()
        torch.cuda.synchronize()
        spent.clear()
        counts.clear()
        for _ in range(steps):
            timed_step()
        torch.cuda.synchronize()
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    return [f"{name}: {spent[name] / steps * 1e6:.1f} us per step "
            f"({counts[name] / steps:g} calls)" for name in sorted(spent, key=spent.get,
                                                                   reverse=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: bench_host_split.py measures a GPU call's host time")
        return
    # q, k, v, dout (b, n, h, d)
    q, k, v, dout = (torch.randn(1, args.seq_len, 12, 64, device="cuda",
                                 dtype=torch.bfloat16) for _ in range(4))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def step():
        # through the module attribute: pieces() wraps it
        functional.dilated_attention(*leaves, SEGMENTS, RATES, backend="triton").backward(dout)

    def forward():
        with torch.no_grad():
            functional.dilated_attention(q, k, v, SEGMENTS, RATES, backend="triton")

    x = torch.randn(8, device="cuda", requires_grad=True)
    grad = torch.ones(8, device="cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, n = {args.seq_len}, "
          f"bf16, LongNet's setting, backend triton; per call over {args.repeats} repeats "
          f"of {args.calls} calls queued (min/median/max)")
    for name, call in (("training step", step), ("forward without grad", forward),
                       ("autograd backward through an identity Function",
                        lambda: _Identity.apply(x).backward(grad)),
                       ("4 x empty_like(q)", lambda: [torch.empty_like(q) for _ in range(4)]),
                       ("zeros(1) (the non-finite check)",
                        lambda: torch.zeros(1, device="cuda"))):
        print(f"{name}: {per_call(call, args.calls, args.repeats)}")
    print("launches replayed / bound each call, training steps taking turns:")
    for line in replayed_against_kept(step, args.calls, 2 * args.repeats):
        print("  " + line)
    print("pieces of a training step (inclusive host time):")
    for line in pieces(step, 2 * args.calls):
        print("  " + line)


if __name__ == "__main__":
    main()
