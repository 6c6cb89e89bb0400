"""The op's rounding error against torch's own attention in the same dtype (CPU).

For each setting, input case, dtype and backend: the relative error (Frobenius norm) of
out, dq, dk and dv against a float64 brute-force reference (tests/reference.py) run on the
same rounded inputs, divided by the error of torch's ``F.scaled_dot_product_attention`` in
that dtype on those inputs: one call where the op is dense, else one call per pattern (its
bool mask), the patterns merged in fp32 by their fp32 log-sum-exps (the yardstick a
per-pattern implementation can reach). A ratio near 1 is torch's precision; docs/spec.md
("Dtypes and tolerance") quotes this table.

    python benchmarks/bench_precision.py
    python benchmarks/bench_precision.py --seq-len 512 --seeds 0 1 2 --dtypes float16

Notation: b batch, n rows, h heads, hk key/value heads, d head dim.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from dilated_attention import dilated_attention  # noqa: E402
from reference import attention_with_counts, dilated_counts  # noqa: E402

GRADS = ("out", "dq", "dk", "dv")
NOISE = 0.5  # torch's relative error from which a result is rounding noise, not compared
# (segment lengths, rates, causal): one dense pattern, and LongNet's shape at a small scale
SETTINGS = {
    "dense": ((1 << 30,), (1,), False),
    "2 patterns": ((256, 512), (1, 2), False),
    "2 patterns causal": ((256, 512), (1, 2), True),
    "4 patterns": ((64, 128, 256, 512), (1, 2, 4, 8), False),
}


def inputs(case: str, shape: Tuple[int, int, int, int, int], dtype: torch.dtype, seed: int):
    """q, k, v, dout rounded once to `dtype` (the reference reads these rounded values).
    normal: N(0, 1); large: scores of about 100-200 (a softmax of one or two keys per row);
    dominant: one key every query leans towards."""
    b, n, h, hk, d = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, heads, d, generator=g, dtype=torch.float64)
               for heads in (h, hk, hk))
    dout = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    if case == "large":
        q, k = q * 6.0, k * 6.0  # q.k / sqrt(d) ~ N(0, 36^2)
    elif case == "dominant":
        q, k = q + 2.0, k.index_fill(1, torch.tensor([n // 3]), 2.0)
    return tuple(x.to(dtype) for x in (q, k, v, dout))


def counts(shape, setting) -> torch.Tensor:
    """(b, h, n, n): how many patterns select each (query, key) (tests/reference.py)."""
    b, n, h = shape[0], shape[1], shape[2]
    segments, rates, causal = setting
    return dilated_counts(n, h, [min(w, n) for w in segments], rates, causal).expand(b, h, n, n)


def _grads(out, leaves, dout):
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def reference(q, k, v, dout, shape, setting):
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out, _ = attention_with_counts(*leaves, counts(shape, setting))
    return _grads(out, leaves, dout.double())


def ours(q, k, v, dout, setting, backend):
    segments, rates, causal = setting
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    n = q.shape[1]
    out = dilated_attention(*leaves, [min(w, n) for w in segments], rates, is_causal=causal,
                            backend=backend)
    return _grads(out, leaves, dout)


def torch_sdpa(q, k, v, dout, shape, setting):
    """torch's attention in the dtype: dense, or per pattern merged in fp32."""
    b, n, h, hk, d = shape
    segments, rates, causal = setting
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    # (b, n, heads, d) -> (b, heads, n, d)
    qt, kt, vt = (x.transpose(1, 2) for x in leaves)
    if len(segments) == 1 and segments[0] >= n and rates == (1,):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=hk != h)
        return _grads(out.transpose(1, 2), leaves, dout)
    # (b, h, n, n) scores in fp32 (fp64 for fp64) from the rounded inputs, for each
    # pattern's lse
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.einsum("bhnd,bhmd->bhnm", qt.to(acc),
                          kt.to(acc).repeat_interleave(h // hk, 1)) / math.sqrt(d)
    parts = []
    for w, r in zip(segments, rates):
        selected = counts(shape, ((w,), (r,), causal)) > 0
        part = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=selected,
                                              enable_gqa=hk != h)
        lse = torch.logsumexp(scores.masked_fill(~selected, -math.inf), -1)
        parts.append((part.nan_to_num(0.0), lse))  # a row the pattern skips: NaN -> 0
    total = torch.logsumexp(torch.stack([lse for _, lse in parts]), 0)
    out = sum(part.to(acc) * torch.exp(lse - total).nan_to_num(0.0)[..., None]
              for part, lse in parts)
    return _grads(out.to(q.dtype).transpose(1, 2), leaves, dout)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def run(args) -> List[Dict[str, object]]:
    shape = (1, args.seq_len, args.heads, args.kv_heads, args.head_dim)
    rows = []
    for name in args.settings:
        setting = SETTINGS[name]
        for case in args.cases:
            for dtype_name in args.dtypes:
                dtype = getattr(torch, dtype_name)
                ratios = {(backend, grad): [] for backend in args.backends for grad in GRADS}
                for seed in args.seeds:
                    q, k, v, dout = inputs(case, shape, dtype, seed)
                    want = reference(q, k, v, dout, shape, setting)
                    theirs = torch_sdpa(q, k, v, dout, shape, setting)
                    floor = [relative_error(x, w) for x, w in zip(theirs, want)]
                    for backend in args.backends:
                        got = ours(q, k, v, dout, setting, backend)
                        for grad, x, w, t in zip(GRADS, got, want, floor):
                            # where torch's own error is 50% or more the gradient is
                            # rounding noise (a cancellation: one dominant key's dq, dk)
                            ratios[backend, grad].append(
                                relative_error(x, w) / t if t < NOISE else math.nan)
                for backend in args.backends:
                    rows.append({"setting": name, "case": case, "dtype": dtype_name,
                                 "backend": backend,
                                 **{grad: ratios[backend, grad] for grad in GRADS}})
    return rows


def main(argv: Sequence[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--cases", nargs="+", default=["normal", "large", "dominant"],
                   choices=["normal", "large", "dominant"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "float16", "bfloat16"],
                   choices=["float32", "float16", "bfloat16"])
    p.add_argument("--backends", nargs="+", default=["auto", "blockwise"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"error / torch SDPA's error in the same dtype (relative Frobenius norm against "
          f"fp64), median [max] over seeds {args.seeds}; b 1, n {args.seq_len}, "
          f"{args.heads} heads, {args.kv_heads} kv heads, d {args.head_dim}, torch "
          f"{torch.__version__}, CPU")
    print(f"| setting | case | dtype | backend | {' | '.join(GRADS)} |")
    print("|---|---|---|---|" + "---|" * len(GRADS))
    worst: Dict[Tuple[str, str], Tuple[float, str]] = {}
    for row in run(args):
        cells = []
        for grad in GRADS:
            ratios = row[grad]
            if any(math.isnan(r) for r in ratios):
                cells.append("noise")
                continue
            cells.append(f"{statistics.median(ratios):.2f} [{max(ratios):.2f}]")
            key = (row["backend"], row["dtype"])
            where = f"{row['setting']}, {row['case']}, {grad}"
            worst[key] = max(worst.get(key, (0.0, "")), (max(ratios), where))
        print(f"| {row['setting']} | {row['case']} | {row['dtype']} | {row['backend']} | "
              f"{' | '.join(cells)} |")
    print(f"\nlargest ratio per backend and dtype (noise: torch's own error >= {NOISE:.0%})")
    print("| backend | dtype | largest | where |\n|---|---|---|---|")
    for (backend, dtype), (ratio, where) in worst.items():
        print(f"| {backend} | {dtype} | {ratio:.2f} | {where} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
