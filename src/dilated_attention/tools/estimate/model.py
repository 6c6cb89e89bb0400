"""``estimate --model``: one rank's memory for a training step of a whole ``LongNetLM``.

Notation: b batch, n this rank's rows (the largest piece of N over P), R = b n,
L blocks, e embed dim, f feed-forward dim, h heads, hk kv heads, d = e / h, v
vocabulary, s bytes per element of the model's dtype, a of its accumulators (4;
8 for float64), Np parameters.

Note [model memory]
~~~~~~~~~~~~~~~~~~~
A step is AdamW's steady state: forward, backward, ``optimizer.step()``, with
the gradients set to None before the forward. Parameters, gradients and
AdamW's two moments are in the model's dtype (as ``LongNetLM(config,
dtype=...)`` with ``torch.optim.AdamW`` makes them) and replicated on every
rank (sequence parallelism shards the rows, not the parameters).

Rotary positions add their tables (cos and sin, (n, 1, d/2) each in the dtype),
made once per forward and shared by every block; the rotation itself keeps
nothing else (rotary.py).

What autograd keeps, per row and block without checkpointing (``block_saved``,
from layers.py and the op): the block input, the attention norm's output (the
projections' input), q, k, v, the op's out and log-sum-exp, the sub-LN's
output, the residual, the feed-forward norm's output and its three (f)
intermediates (fc1, activation, sub-LN), and two fp32 statistics per LayerNorm:
7 e + 2 hk d + 3 f numbers in the dtype, h + 8 accumulators; with dropout also
the three ``nn.Dropout`` masks (2 e + f: the two residuals', the feed-forward's),
bool on CUDA (ATen's fused dropout), the scaled noise in the dtype elsewhere. With
``ffn_chunk_bytes`` the feed-forward keeps only its input (recomputed per
chunk). ``checkpoint="layers"`` keeps each block's input (e) and recomputes
one block at a time in backward; ``"offload"`` keeps those inputs in host
memory: on the device two of them (the one in use and the next one fetched).

The peak is the largest of a few moments (``stages``): the end of the forward
with one chunk of the loss (whose forward forms its gradients too: its d hidden
and fp32 d weight), the loss's backward (those gradients scaled), a block's
backward at the top of the stack (the most saved) and at the bottom (the most
gradients) in its feed-forward part or its attention part (where the op's own
working memory, from the op's estimate, adds), under checkpointing with
feed-forward chunks the top block's recomputed forward (the chunks' outputs
beside their join), and AdamW's step. ``model_dryrun`` runs the real model on
meta tensors to check this arithmetic (tests: within 5%). With
``attention_dropout`` the op runs its blockwise kernel (torch ops), which the op's
estimate then runs too (``EstimateConfig.dropout``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Dict, Optional, Tuple

import torch

from ...models.checkpointing import CHECKPOINT_MODES, chunk_rows
from ...models.config import LongNetConfig
from ...models.loss import accumulator_dtype, loss_chunk_rows
from .config import EstimateConfig, make_config
from .formula import KERNEL_BUFFERS
from .scaled import estimate as op_estimate

PRESETS = ("base", "tiny")


@dataclasses.dataclass(frozen=True)
class ModelSetup:
    """A whole-model estimate's question: which model, how long, over how many ranks."""

    name: str
    config: LongNetConfig
    seq_len: int
    world_size: int = 1
    batch: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    threads: Optional[int] = None
    strategy: Optional[str] = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def rows(self) -> int:
        """n: the rows of the largest piece (contiguous pieces differ by one row at most)."""
        return -(-self.seq_len // self.world_size)

    def with_length(self, seq_len: int, world_size: Optional[int] = None) -> "ModelSetup":
        return dataclasses.replace(self, seq_len=seq_len,
                                   world_size=world_size or self.world_size)


def load_model(spec: str) -> Tuple[str, LongNetConfig]:
    """A preset name or a JSON file of LongNetConfig fields ({"preset": "base", ...} starts
    from a preset); ValueError names the option on a mistake."""
    if spec in PRESETS:
        return spec, LongNetConfig.from_name(spec)
    if not os.path.isfile(spec):
        raise ValueError(f"--model must be one of {', '.join(PRESETS)} or a JSON file of "
                         f"LongNetConfig fields, got {spec!r}")
    try:
        with open(spec) as f:
            fields = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--model {spec}: {exc}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"--model {spec}: a JSON object of LongNetConfig fields expected")
    preset = fields.pop("preset", None)
    known = {f.name for f in dataclasses.fields(LongNetConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"--model {spec}: unknown LongNetConfig fields {unknown}")
    try:
        config = (LongNetConfig.from_name(preset, **fields) if preset is not None
                  else LongNetConfig(**fields))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--model {spec}: {exc}") from None
    return os.path.basename(spec), config


def make_setup(*, model: str, seq_len: int, world_size: int = 1, batch: int = 1,
               dtype: str = "float32", device: str = "cpu", threads: Optional[int] = None,
               strategy: Optional[str] = None) -> ModelSetup:
    """Check the options (the attention's through ``make_config``)."""
    name, config = load_model(model)
    if config.positions == "learned" and seq_len > config.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} is beyond the learned positions of --model "
                         f"{model} (max_seq_len {config.max_seq_len})")
    setup = ModelSetup(name, config, seq_len, world_size, batch, dtype, device, threads,
                       strategy)
    op_config(setup)  # the attention options, checked
    return setup


def op_config(setup: ModelSetup) -> EstimateConfig:
    """The attention op of every block, as the model calls it: causal, training."""
    c = setup.config
    return make_config(
        seq_len=setup.seq_len, world_size=setup.world_size, segment_lengths=c.segment_lengths,
        dilation_rates=c.dilation_rates, heads=c.num_heads, head_dim=c.embed_dim // c.num_heads,
        kv_heads=c.num_kv_heads, batch=setup.batch, dtype=setup.dtype, causal=True,
        training=True, threads=setup.threads, device=setup.device, strategy=setup.strategy,
        dropout=c.attention_dropout)


def op_working_bytes(setup: ModelSetup) -> Tuple[int, int]:
    """(the attention op's working memory beyond its inputs and outputs, of which the
    kernels' own buffers): the op's estimate at this length (its dry run, Note [estimate])."""
    est = op_estimate(op_config(setup))
    scratch = sum(est.breakdown.get(label, 0) for label in KERNEL_BUFFERS)
    working = sum(v for k, v in est.breakdown.items() if k.startswith("working memory"))
    return working + scratch, scratch


# --------------------------------------------------------------------------
# Counts


def parameter_counts(config: LongNetConfig) -> Tuple[int, int, int]:
    """(all parameters, those of one block, the largest tensor), as LongNetLM makes them."""
    e, f, v, h = config.embed_dim, config.ffn_dim, config.vocab_size, config.num_heads
    kv = (config.num_kv_heads or h) * (e // h)
    bias = 1 if config.bias else 0

    def linear(i: int, o: int) -> int:
        return i * o + bias * o

    norm = 2 * e
    block = (norm + linear(e, e) + 2 * linear(e, kv) + norm + linear(e, e)  # attention, sub-LN
             + norm + linear(e, f) + 2 * f + linear(f, e))  # feed-forward, its sub-LN
    other = v * e + (0 if config.tie_embeddings else v * e) + norm
    table = config.max_seq_len * e if config.positions == "learned" else 0
    return other + table + config.num_layers * block, block, max(v * e, e * f, table)


def _sizes(setup: ModelSetup) -> Tuple[int, int]:
    dtype = setup.torch_dtype
    return dtype.itemsize, accumulator_dtype(dtype).itemsize


def block_saved(setup: ModelSetup) -> Tuple[int, int]:
    """Bytes per row that one block keeps for backward without checkpointing (Note [model
    memory]): (its attention part, its feed-forward part)."""
    c = setup.config
    s, a = _sizes(setup)
    e, f, h = c.embed_dim, c.ffn_dim, c.num_heads
    kv = (c.num_kv_heads or h) * (e // h)
    m = dropout_mask_bytes(setup)
    attention = (5 * e + 2 * kv) * s + (h + 4) * a + e * m
    feed_forward = e * m + (e * s if ffn_chunk_rows(setup) is not None else
                            (2 * e + 3 * f) * s + 4 * a + f * m)
    return attention, feed_forward


def dropout_mask_bytes(setup: ModelSetup) -> int:
    """Bytes per element of the mask each ``nn.Dropout`` keeps for backward (0 without
    dropout): ATen's fused dropout (CUDA) keeps a bool mask, its composite one (CPU, meta)
    the scaled noise, in the dtype."""
    if setup.config.dropout == 0:
        return 0
    return 1 if setup.device == "cuda" else setup.torch_dtype.itemsize


def ffn_chunk_rows(setup: ModelSetup) -> Optional[int]:
    """Rows per feed-forward chunk, as the blocks cut them, or None where the feed-forward
    runs whole (keeping all its activations): no ffn_chunk_bytes, or one chunk holds the
    piece."""
    c = setup.config
    if c.ffn_chunk_bytes is None:
        return None
    return chunk_rows(setup.rows, c.ffn_chunk_bytes,
                      setup.batch * c.ffn_dim * setup.torch_dtype.itemsize)


@dataclasses.dataclass
class ModelEstimate:
    """One checkpoint mode's peak per rank (device), the host memory it keeps, the breakdown
    at the peak and the moment it is reached."""

    mode: str
    peak_bytes: int
    host_bytes: int
    stage: str
    breakdown: Dict[str, int]
    method: str = "formula"


def formula(setup: ModelSetup, mode: str, op_working: int) -> ModelEstimate:
    """The peak of `mode` by Note [model memory]; `op_working`: ``op_working_bytes``."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint mode must be one of {CHECKPOINT_MODES}, got {mode!r}")
    c = setup.config
    if mode == "offload" and setup.device == "cpu":
        mode = "layers"  # the inputs already live in host memory (Note [checkpoint modes])
    s, a = _sizes(setup)
    R = setup.batch * setup.rows
    e, f, v, L = c.embed_dim, c.ffn_dim, c.vocab_size, c.num_layers
    kv = (c.num_kv_heads or c.num_heads) * (e // c.num_heads)
    E = R * e * s
    params, per_block, largest = parameter_counts(c)
    static = {"parameters": params * s, "AdamW moments": 2 * params * s}

    attention, feed_forward = (R * x for x in block_saved(setup))
    block = attention + feed_forward
    kept = {"none": L * block, "layers": L * E, "offload": 0}[mode]
    inputs = 2 * R * 8  # tokens and targets (int64)
    if c.positions == "rotary":
        inputs += setup.rows * (e // c.num_heads) * s  # the (n, 1, d/2) cos and sin, shared
    # the last block's output (the final norm's input and statistics), the normed hidden
    # states (the loss's input), the loss's per-row log-sum-exp
    loss_dtype = accumulator_dtype(setup.torch_dtype)
    tail = 2 * E + R * (2 * a + loss_dtype.itemsize)
    rows = min(R, loss_chunk_rows(v, setup.torch_dtype, c.loss_chunk_bytes))
    acc_logits = loss_dtype.itemsize
    half = s < acc_logits
    # one chunk's logits at a time (loss.py's _ChunkBuffers, reused by every chunk), turned
    # into the softmax in place; in a half dtype the model-dtype logits beside the
    # accumulators' (the matmul's, and again as d logits), d weight's model-dtype product
    # made in slices inside the accumulators' buffer
    chunk_forward = rows * v * acc_logits + (rows * v * s if half else 0)
    # the loss's gradients, formed in its forward: d hidden and the accumulators' d weight
    loss_grads = E + v * e * acc_logits
    head_grad = v * e * s

    # One block in backward, beyond what the stack keeps: recomputed (checkpointing) and
    # its gradients in flight: the feed-forward part (the incoming gradient, fc2's input
    # gradient) or the attention part (its feed-forward and sub-LN output freed; the
    # gradients of the residual and of the op's output, dq, dk, dv, the op's working memory:
    # 3 E + the kv gradients + working).
    recompute = 0 if mode == "none" else block - (E if mode == "layers" else 0)
    ffn_rows = ffn_chunk_rows(setup)
    if ffn_rows is not None:
        # the chunks' input gradients wait in autograd's buffer until the last chunk's
        # backward is done, then are joined into one more E
        chunk = ffn_rows * setup.batch
        ffn_flight = E + max(2 * E, (R - chunk) * e * s + chunk * (2 * e + 4 * f) * s)
    else:
        ffn_flight = E + R * f * s
    attention_flight = (3 * E + R * 2 * kv * s + op_working) - feed_forward - E
    flight = max(ffn_flight, attention_flight)
    prefetch = E if mode == "offload" else 0  # the next block input, fetched ahead

    grads_blocks = L * per_block * s
    stages = {
        "forward end, a loss chunk": (inputs + kept + tail + loss_grads + chunk_forward, 0),
        # its backward scales them in place (and casts d weight to a half dtype)
        "loss backward": (inputs + kept + tail + loss_grads + (v * e * s if half else 0), 0),
        "backward, top block": (inputs + kept + recompute + prefetch + flight,
                                head_grad + per_block * s),
        # checkpointed feed-forward chunks: while the top block's forward is recomputed, the
        # chunks' outputs (E) and their join (E) meet the whole block's recomputed activations
        # and the gradient of its output (E)
        "backward, top block's chunks recomputed": (
            inputs + kept + block + prefetch + 3 * E
            if mode != "none" and ffn_rows is not None else 0,
            head_grad),
        "backward, bottom block": (inputs + block + flight if mode == "none" else
                                   inputs + (E if mode == "layers" else 0) + recompute + flight,
                                   head_grad + grads_blocks),
        # the embedding's (v, e) gradient joins the loss's (tied) before AdamW sees it
        "backward, embedding": (inputs + E, params * s + head_grad),
    }
    optimizer = params * s if setup.device == "cuda" else 2 * largest * s  # AdamW temporaries
    stages["optimizer step"] = (optimizer, params * s)
    stage = max(stages, key=lambda k: sum(stages[k]))
    activations, grads = stages[stage]
    breakdown = {**static, "gradients": grads, "activations and transients": activations}
    host = L * E if mode == "offload" else 0
    return ModelEstimate(mode, sum(static.values()) + activations + grads, host, stage,
                         breakdown)


def estimate_modes(setup: ModelSetup) -> Dict[str, ModelEstimate]:
    """Every checkpoint mode's formula at the setup's length (one op estimate)."""
    working, _ = op_working_bytes(setup)
    return {mode: formula(setup, mode, working) for mode in CHECKPOINT_MODES}


# --------------------------------------------------------------------------
# The longest sequence in a budget


def parse_bytes(text: str) -> int:
    """'80GB' (10^9), '24GiB' (2^30), '512MB', '1.5TB', or a plain number of bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper()
    number = t.rstrip("KMGTIB")
    unit = t[len(number):]
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise ValueError(f"--fit-memory must be a size such as 80GB, 24GiB or 512MB, got "
                         f"{text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"--fit-memory must be a positive finite size, got {text!r}")
    return int(value)


@dataclasses.dataclass
class Fit:
    """The longest N (a multiple of `step`) whose peak per rank fits, for one mode and P;
    0 when none does. `estimate`: that N's estimate."""

    mode: str
    world_size: int
    seq_len: int
    step: int
    estimate: Optional[ModelEstimate]


def longest(setup: ModelSetup, budget: int, world_size: int) -> Dict[str, Fit]:
    """Per checkpoint mode, the longest sequence over `world_size` ranks that fits `budget`.

    Everything but the op's working memory is exact arithmetic in N; the op's
    working memory (its dry run, seconds at a million rows) is measured at a
    reference length, taken per row, and measured again at the longest
    answer, whose search then runs once more (an N that fits by the first
    measure may not by the second: the second decides).
    """
    step = 1024 * world_size
    reference = setup.with_length(step * 64, world_size)
    per_row = op_working_bytes(reference)[0] / reference.rows
    fits = _search(setup, budget, world_size, step, per_row)
    top = max(fit.seq_len for fit in fits.values())
    if top:
        at = setup.with_length(top, world_size)
        per_row = op_working_bytes(at)[0] / at.rows
        fits = _search(setup, budget, world_size, step, per_row)
    return fits


def _search(setup: ModelSetup, budget: int, world_size: int, step: int,
            per_row: float) -> Dict[str, Fit]:
    # learned positions: no sequence past the table (in whole rows per rank)
    cap = (setup.config.max_seq_len // world_size * world_size
           if setup.config.positions == "learned" else None)
    out = {}
    for mode in CHECKPOINT_MODES:
        def peak(n: int) -> ModelEstimate:
            s = setup.with_length(n, world_size)
            return formula(s, mode, int(per_row * s.rows))

        def fits(k: int) -> bool:
            return peak(k * step).peak_bytes <= budget

        lo = 0
        if fits(1):
            lo, hi = 1, 2
            while fits(hi) and hi < 2**40 // step:
                lo, hi = hi, 2 * hi
            while hi - lo > 1:  # lo fits, hi does not
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        n = lo * step
        # past the table, or no multiple of step fits but the table is shorter than one:
        # the table's length if it fits (a peak grows with N)
        if cap is not None and (n > cap or (n == 0 and cap < step)):
            n = cap if cap and peak(cap).peak_bytes <= budget else 0
        out[mode] = Fit(mode, world_size, n, step, peak(n) if n else None)
    return out


def world_sizes(largest: int) -> Tuple[int, ...]:
    """1, 2, 4, ... up to `largest`, and `largest`."""
    sizes = [1 << k for k in range(int(math.log2(largest)) + 1)]
    return tuple(sorted(set(sizes + [largest])))
