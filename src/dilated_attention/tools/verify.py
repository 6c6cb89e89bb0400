"""``dilated-attention verify``: sequence-parallel results equal one device's.

Each case builds the full (small) q, k, v, the output gradient and an lse
gradient on every rank from one seed, computes the single-device result
(``dilated_attention`` with no group; dense is its ``[N], [1]`` special
case), runs the sequence-parallel op on this rank's rows, and compares this
rank's rows of out, lse, dq, dk and dv. The largest error over all ranks is
reported per case. Cases are sized from the world size P, so every P covers
segments inside one rank, segments spanning two ranks and spanning all.

Notation: b batch, N total rows, h heads, hk key/value heads, d head dim;
layout (b, n, h, d).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..distributed import comm
from . import launch
from ..distributed.sharding import piece_ranges
from ..functional import dilated_attention, ring_attention

# Pass when max |error| <= tolerance * max(1, max |reference|), per dtype.
TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 2e-4,
    torch.bfloat16: 5e-2,
    torch.float16: 2e-2,
}


def _even(p: int, rows: int) -> List[int]:
    return [rows] * p


def _uneven(p: int) -> List[int]:
    # 3, 8, 13, 7, 12, ... : no two neighbours equal, none divides the segments
    return [3 + (5 * r) % 11 for r in range(p)]


def _with_empty(p: int) -> List[int]:
    lengths = _uneven(p)
    lengths[p // 2] = 0
    return lengths


def _documents(n: int) -> List[int]:
    # documents of 1, 0, 7 rows, then ~n/3, then the rest: short and long ones, an empty one
    cuts = sorted({0, 1, 1, 8, max(8, n // 3), n} & set(range(n + 1)))
    return [0, 1, 1] + [c for c in cuts if c > 1]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    description: str
    impl: str  # "dilated" or "ring"
    lengths: Callable[[int], List[int]]  # P -> every rank's piece length
    patterns: Callable[[int], Tuple[List[int], List[int]]]  # N -> (segments, rates)
    causal: bool = False
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 16
    layout: str = "contiguous"
    documents: Optional[Callable[[int], List[int]]] = None  # N -> cu_seqlens
    masked: bool = False  # a key padding mask (about a third of the keys)
    strategy: str = "exchange"  # dilated_attention's strategy on a one-dimensional group
    mesh: bool = False  # a 2-D mesh (heads x sequence): (2, P / 2) for even P, else (P, 1)

    def head_counts(self, p: int) -> Tuple[int, int]:
        """(heads, kv heads) at P ranks: head-parallel cases take 2 P heads (they must split
        over the ranks) and 2 kv heads (so some kv heads are read by two ranks)."""
        if self.strategy == "ulysses" or self.mesh:
            return 2 * p, 2
        return self.heads, self.kv_heads


def mesh_shape(p: int) -> Tuple[int, int]:
    """The 2-D mesh of the mesh cases: 2 head-parallel ranks when P is even."""
    return (2, p // 2) if p % 2 == 0 else (p, 1)


CASES: Tuple[Case, ...] = (
    Case("local", "segments inside one rank, no traffic",
         "dilated", lambda p: _even(p, 16), lambda n: ([8, 16], [1, 2])),
    Case("local-causal", "segments inside one rank, causal",
         "dilated", lambda p: _even(p, 16), lambda n: ([8, 16], [1, 2]), causal=True),
    Case("span-two", "segments spanning two ranks",
         "dilated", lambda p: _even(p, 16), lambda n: ([8, 32], [1, 2])),
    Case("span-all-causal", "a segment spanning every rank, causal",
         "dilated", lambda p: _even(p, 16), lambda n: ([4, n], [1, 4]), causal=True),
    Case("uneven", "uneven pieces, segments across piece borders",
         "dilated", _uneven, lambda n: ([4, 12, 64], [1, 3, 2])),
    Case("uneven-causal", "uneven pieces, causal",
         "dilated", _uneven, lambda n: ([4, 12, 64], [1, 3, 2]), causal=True),
    Case("empty-piece", "one rank holds no rows",
         "dilated", _with_empty, lambda n: ([5, 16], [1, 2]), causal=True),
    Case("gqa", "grouped-query attention (4 heads, 2 kv heads), uneven, causal",
         "dilated", _uneven, lambda n: ([8, 24], [1, 2]), causal=True, kv_heads=2),
    # with a short dense pattern, so that every (row, head) pair is read (no warning)
    Case("long-segment", "segment longer than the sequence",
         "dilated", _uneven, lambda n: ([4 * n, 3], [3, 1])),
    Case("dense-dilated", "dilated with segments [N], rates [1] (dense attention)",
         "dilated", _uneven, lambda n: ([n], [1]), causal=True),
    Case("ring", "dense ring attention",
         "ring", lambda p: _even(p, 16), lambda n: ([n], [1])),
    Case("ring-uneven-causal", "dense ring, uneven pieces, causal",
         "ring", _uneven, lambda n: ([n], [1]), causal=True),
    Case("ring-zigzag-causal", "dense ring, zigzag layout, causal",
         "ring", lambda p: _even(p, 16), lambda n: ([n], [1]), causal=True, layout="zigzag"),
    Case("ring-gqa", "dense ring, multi-query (4 heads, 1 kv head)",
         "ring", _uneven, lambda n: ([n], [1]), kv_heads=1),
    Case("documents", "packed documents crossing rank borders, causal",
         "dilated", _uneven, lambda n: ([4, 16], [1, 2]), causal=True, kv_heads=2,
         documents=_documents),
    Case("padding", "a key padding mask, uneven pieces",
         "dilated", _uneven, lambda n: ([4, 12, 64], [1, 3, 2]), masked=True),
    Case("documents-padding-zigzag", "documents and padding, zigzag layout, causal",
         "dilated", lambda p: _even(p, 16), lambda n: ([8, 32], [1, 2]), causal=True,
         layout="zigzag", documents=_documents, masked=True),
    Case("ring-documents", "dense ring over packed documents with padding, causal",
         "ring", _uneven, lambda n: ([n], [1]), causal=True, documents=_documents, masked=True),
    Case("ulysses", "head-parallel (Ulysses), uneven pieces, causal, kv heads read by two ranks",
         "dilated", _uneven, lambda n: ([4, 12, 64], [1, 3, 2]), causal=True,
         strategy="ulysses"),
    Case("ulysses-documents-padding", "Ulysses over packed documents with padding",
         "dilated", _with_empty, lambda n: ([4, 16], [1, 2]), documents=_documents, masked=True,
         strategy="ulysses"),
    Case("auto-dense", "dense dilated with strategy 'auto' (Ulysses sends less here)",
         "dilated", lambda p: _even(p, 16), lambda n: ([n], [1]), causal=True, strategy="auto"),
    Case("mesh", "a 2-D mesh (Ulysses x the exchange), uneven pieces with an empty one, causal",
         "dilated", _with_empty, lambda n: ([4, 12, 64], [1, 3, 2]), causal=True, mesh=True,
         strategy="auto"),
    Case("mesh-ring", "a 2-D mesh (Ulysses x the ring), uneven pieces, causal",
         "ring", _uneven, lambda n: ([n], [1]), causal=True, mesh=True),
)
CASE_NAMES = tuple(c.name for c in CASES)


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
    world_size: int
    cases: Tuple[str, ...]
    dtype: str
    device: str

    @property
    def steps(self) -> int:
        return len(self.cases)


def make_config(*, world_size: int, cases: Optional[Sequence[str]], dtype: str,
                device: str) -> VerifyConfig:
    """Check the options; ValueError names the option and value on a mistake."""
    if world_size < 2:
        raise ValueError(f"verify needs at least 2 ranks to compare with one device, got "
                         f"world size {world_size}")
    names = tuple(dict.fromkeys(cases or CASE_NAMES))
    unknown = [n for n in names if n not in CASE_NAMES]
    if unknown:
        raise ValueError(f"unknown case {unknown[0]!r}; cases: {', '.join(CASE_NAMES)}")
    if dtype == "auto":
        dtype = "float32" if device == "cuda" else "float64"
    if device == "cuda" and dtype == "float64":
        raise ValueError("--dtype float64 has no CUDA attention kernel here; use float32")
    return VerifyConfig(world_size=world_size, cases=names, dtype=dtype, device=device)


def _rows(case: Case, lengths: List[int], rank: int) -> List[Tuple[int, int]]:
    """Global row ranges of rank `rank`, in its local order."""
    if case.layout == "zigzag":
        return piece_ranges(sum(lengths), len(lengths), rank, "zigzag")
    start = sum(lengths[:rank])
    return [(start, start + lengths[rank])]


def _take(x: Tensor, ranges: List[Tuple[int, int]]) -> Tensor:
    """Rows `ranges` of x (b, N, ...) -> (b, n, ...), in order."""
    return torch.cat([x[:, lo:hi] for lo, hi in ranges], dim=1)


def _attention(case: Case, q, k, v, n: int, group, mask=None):
    """The case's op on (b, n, h, d) inputs; returns out (b, n, h, d), lse (b, h, n)."""
    segments, rates = case.patterns(n)
    documents = case.documents(n) if case.documents else None
    layout = case.layout if group is not None else "contiguous"
    if case.impl == "ring" and group is not None:
        return ring_attention(q, k, v, is_causal=case.causal, group=group, return_lse=True,
                              layout=layout, cu_seqlens=documents, key_padding_mask=mask)
    return dilated_attention(q, k, v, segments, rates, is_causal=case.causal, group=group,
                             return_lse=True, cu_seqlens=documents, key_padding_mask=mask,
                             layout=layout, strategy=case.strategy if group is not None
                             else "auto")


def _max_error(got: Tensor, want: Tensor) -> Tuple[float, float]:
    """(max |got - want|, max |want|) over finite entries; -inf must meet -inf."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        return math.inf, 1.0
    same = got == want  # covers matching infinities
    diff = torch.where(same, torch.zeros_like(got), (got - want).abs()).nan_to_num(nan=math.inf)
    finite = want[torch.isfinite(want)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return (float(diff.max()) if diff.numel() else 0.0), scale


def run_case(case: Case, group, config: VerifyConfig, device: str, seed: int) -> Dict[str, float]:
    """This rank's largest error (relative to the tolerance's scale) for one case."""
    dtype = getattr(torch, config.dtype)
    p = comm.group_size(group)
    if case.mesh:
        # every rank builds the mesh (new groups); rank (u, s) holds piece s * U + u
        group = launch.init_device_mesh(mesh_shape(p), device_type=device)
    rank = comm.group_rank(group)
    lengths = case.lengths(p)
    n = sum(lengths)
    heads, kv_heads = case.head_counts(p)
    gen = torch.Generator().manual_seed(seed)

    def full(heads: int) -> Tensor:  # (b, N, heads, d)
        return torch.randn(2, n, heads, case.head_dim, generator=gen).to(device, dtype)

    q, k, v, dout = full(heads), full(kv_heads), full(kv_heads), full(heads)
    # (b, h, N): an lse gradient too, so the lse path of the backward is checked
    dlse = torch.randn(2, heads, n, generator=gen).to(device, torch.float64 if
                                                          dtype == torch.float64 else
                                                          torch.float32)
    mask = (torch.rand(2, n, generator=gen) < 0.3).to(device) if case.masked else None
    ranges = _rows(case, lengths, rank)
    # single device: the whole sequence, no group
    qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
    out_ref, lse_ref = _attention(case, qf, kf, vf, n, None, mask)
    ((out_ref.double() * dout.double()).sum() + (lse_ref.double() * dlse.double()).sum()).backward()
    # sequence parallel: this rank's rows only
    ql, kl, vl = (_take(x, ranges).requires_grad_() for x in (q, k, v))
    out, lse = _attention(case, ql, kl, vl, n, group, None if mask is None else _take(mask, ranges))
    dlse_mine = torch.cat([dlse[:, :, lo:hi] for lo, hi in ranges], dim=2)
    loss = (out.double() * _take(dout, ranges).double()).sum() + (lse.double() *
                                                                 dlse_mine.double()).sum()
    loss.backward()
    worst = {"error": 0.0, "scale": 0.0}
    pairs = [
        ("out", out, _take(out_ref, ranges)),
        ("lse", lse, torch.cat([lse_ref[:, :, lo:hi] for lo, hi in ranges], dim=2)),
        ("dq", ql.grad, _take(qf.grad, ranges)),
        ("dk", kl.grad, _take(kf.grad, ranges)),
        ("dv", vl.grad, _take(vf.grad, ranges)),
    ]
    for name, got, want in pairs:
        if got is None:  # no gradient reached this rank's inputs
            got = torch.zeros_like(want)
        err, scale = _max_error(got, want)
        worst[name] = err
        worst["error"] = max(worst["error"], err)
        worst["scale"] = max(worst["scale"], scale)
    return worst


# a case's outcome per rank: its largest errors (see run_case)
_KEYS = ("error", "scale", "out", "lse", "dq", "dk", "dv")


def rank_main(world, config: VerifyConfig, progress: Callable[[str], None], *, device: str):
    """Run the selected cases on every rank of `world`; rank 0 returns one result per case.

    Every case ends with one small agreement of every rank's outcome, so all
    ranks learn of a failure on any of them. After a failed case every rank
    stops together: its collectives may have left the group out of step, so
    the remaining cases are reported as not run instead of being run.
    """
    results: List[Dict[str, object]] = []
    rank = comm.group_rank(world)
    for index, name in enumerate(config.cases):
        case = next(c for c in CASES if c.name == name)
        failure = None
        try:
            worst = run_case(case, world, config, device, seed=1000 + index)
        except Exception as exc:  # shared with every rank below
            failure = f"rank {rank}: {type(exc).__name__}: {exc}".splitlines()[0]
            worst = {key: math.inf for key in _KEYS}
        outcomes = _share_outcome(world, name, failure, worst)
        failures = [o["failure"] for o in outcomes if o["failure"] is not None]
        # the largest error of any rank; a failed rank counts as infinite error
        results.append({"name": name, "description": case.description,
                        "failure": "; ".join(failures) or None,
                        **{key: max(o[key] for o in outcomes) for key in _KEYS}})
        progress(name)
        if failures:
            for rest in config.cases[index + 1:]:
                results.append({"name": rest, "failure": "not run: an earlier case failed",
                                "description": next(c for c in CASES if c.name == rest).description,
                                **{key: math.inf for key in _KEYS}})
            break
    return results


def _share_outcome(world, name: str, failure: Optional[str],
                   worst: Dict[str, float]) -> List[Dict]:
    """Every rank's {"failure", *_KEYS} for case `name`, by rank (one small all-gather).

    Every rank must be at the same case. If the agreement itself fails (a
    peer is out of step or stuck in the failed case's traffic until the
    group's timeout), this rank's outcome is a failure.
    """
    mine = {"failure": failure, **worst}
    try:
        return comm.agree(world, {"case": name, **mine}, per_rank=tuple(mine))
    except Exception as exc:
        shared = f"rank {comm.group_rank(world)}: outcome not shared: {type(exc).__name__}: {exc}"
        return [{**mine, "failure": failure or shared.splitlines()[0]}]


def report(results: List[Dict[str, object]], config: VerifyConfig) -> int:
    """One line per case; 0 when every case passes, else 1."""
    tol = TOLERANCE[getattr(torch, config.dtype)]
    print(f"verify: {config.world_size} ranks, {config.device}, {config.dtype}; sequence-parallel "
          f"out, lse, dq, dk, dv against one device; tolerance {tol:g} x max(1, |reference|)")
    failed = 0
    for r in results:
        limit = tol * max(1.0, r["scale"])
        ok = r["failure"] is None and r["error"] <= limit
        failed += not ok
        detail = r["failure"] or (f"max error {r['error']:.2e} (out {r['out']:.1e}, lse "
                                  f"{r['lse']:.1e}, dq {r['dq']:.1e}, dk {r['dk']:.1e}, dv "
                                  f"{r['dv']:.1e})")
        print(f"{'PASS' if ok else 'FAIL'}  {r['name']:20s} {detail}  [{r['description']}]")
    print(f"{len(results) - failed} passed, {failed} failed")
    return 0 if failed == 0 else 1
