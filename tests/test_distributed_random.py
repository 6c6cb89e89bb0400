"""Randomized (seeded, deterministic) sequence-parallel configurations on real gloo ranks.

For each world size P in (2, 3, 4), one spawn runs ~25 cases drawn from
``random.Random(P)``: random (often uneven, sometimes empty) pieces, 1-3
dilation patterns, GQA head counts, causal or not. Every rank builds the
full-sequence tensors from the case's seed and compares its own rows of
out, lse, dq, dk, dv (upstream gradients on out AND lse) with

- the single-process ``dilated_attention`` on the concatenated sequence
  (for ``dilated_attention(..., group=pg)``), and
- ``reference.reference_attention`` (for ``ring_attention``, contiguous
  pieces; also zigzag when N is divisible by 2P),

in float64 to 1e-9; some cases pass head_dim-strided inputs (``_strided``)
to the distributed side. A mismatch reports the full config; to reproduce one,
add it to ``REGRESSION_CASES`` (run in the same spawn, before the random
cases).
"""

from __future__ import annotations

import functools
import random
from typing import Dict, List, Tuple

import pytest
import torch

from dilated_attention import dilated_attention
from dilated_attention.distributed import comm
from dilated_attention import ring_attention
from dilated_attention.distributed.sharding import piece_ranges
from dist_harness import run_distributed
from reference import close, grads, reference_attention

WORLDS = (2, 3, 4)
CASES_PER_WORLD = 25
DTYPE = torch.float64

# Minimal configs that once failed, by world size (same keys as _random_case;
# "strided": the distributed side's q, k, v are stored head_dim-major, see _strided).
REGRESSION_CASES: Dict[int, List[Dict]] = {
    # the CPU flash kernel read a strided head_dim as if contiguous: wrong out and grads
    2: [dict(world=2, index=-1, seed=7, lengths=(2, 1), segs=(3,), rates=(1,), causal=False,
             h=1, hk=1, d=2, b=1, strided=True)],
    3: [],
    4: [],
}


def _piece_length(rng: random.Random) -> int:
    # uniform 0..40 would almost never give the edge cases: empty and tiny pieces
    kind = rng.random()
    if kind < 0.15:
        return 0
    if kind < 0.4:
        return rng.randint(1, 4)
    return rng.randint(1, 40)


def _random_case(rng: random.Random, world: int, index: int) -> Dict:
    lengths = [_piece_length(rng) for _ in range(world)]
    if sum(lengths) == 0:
        lengths[rng.randrange(world)] = rng.randint(1, 40)
    if rng.random() < 0.3:  # make N divisible by 2P so the zigzag ring runs too
        last = max(p for p in range(world) if lengths[p])
        lengths[last] += -sum(lengths) % (2 * world)
    n = sum(lengths)
    segs, rates = [], []
    for _ in range(rng.randint(1, 3)):
        w = rng.randint(1, 2 * n + 3)
        segs.append(w)
        rates.append(rng.randint(1, w))
    h = rng.randint(1, 6)
    hk = rng.choice([x for x in range(1, h + 1) if h % x == 0])
    return dict(world=world, index=index, seed=1000 * world + index, lengths=tuple(lengths),
                segs=tuple(segs), rates=tuple(rates), causal=rng.random() < 0.5, h=h, hk=hk,
                d=rng.choice((4, 8)), b=rng.choice((1, 2)), strided=rng.random() < 0.2)


def _cases(world: int) -> List[Dict]:
    rng = random.Random(world)
    return REGRESSION_CASES[world] + [_random_case(rng, world, i) for i in range(CASES_PER_WORLD)]


def _inputs(case: Dict) -> Tuple[torch.Tensor, ...]:
    """Full-sequence q, k, v, dout (b, n, h, d), dlse (b, h, n): the same on every process."""
    gen = torch.Generator().manual_seed(case["seed"])
    b, n, h, hk, d = case["b"], sum(case["lengths"]), case["h"], case["hk"], case["d"]
    return tuple(torch.randn(*shape, generator=gen, dtype=DTYPE) for shape in (
        (b, n, h, d), (b, n, hk, d), (b, n, hk, d), (b, n, h, d), (b, h, n)))


def _rows(x: torch.Tensor, ranges, dim: int = 1) -> torch.Tensor:
    return torch.cat([x.narrow(dim, lo, hi - lo) for lo, hi in ranges], dim=dim)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # rows that attend nothing have lse = -inf and take no lse gradient
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _strided(x: torch.Tensor) -> torch.Tensor:
    """The same values with head_dim not unit-stride: (b, n, h, d) stored as (d, h, b, n)."""
    return x.permute(3, 2, 0, 1).contiguous().permute(2, 3, 1, 0)


def _with_grads(fn, q, k, v, dout, dlse, strided=False):
    """out, lse and (dq, dk, dv) of `fn(q, k, v) -> (out, lse)` under upstream (dout, dlse)."""
    prep = _strided if strided else torch.Tensor.clone
    q, k, v = (prep(x.detach()).requires_grad_() for x in (q, k, v))
    out, lse = fn(q, k, v)
    dq, dk, dv = grads([out, _finite(lse)], [dout, dlse], [q, k, v])
    return {"out": out.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}


def _compare(got: Dict, want: Dict, ranges, what: str) -> List[str]:
    errors = []
    for key, dim in (("out", 1), ("lse", 2), ("dq", 1), ("dk", 1), ("dv", 1)):
        try:
            close(got[key], _rows(want[key], ranges, dim), DTYPE, key)
        except AssertionError as exc:
            errors.append(f"{what}: {exc}")
    return errors


def _check_case(group, case: Dict) -> List[str]:
    """This rank's mismatches (config included) of the dilated op and the ring."""
    world, rank = comm.group_size(group), comm.group_rank(group)
    lengths = case["lengths"]
    start = sum(lengths[:rank])
    ranges = [(start, start + lengths[rank])]
    full = _inputs(case)
    q, k, v, dout, dlse = full
    segs, rates, causal = case["segs"], case["rates"], case["causal"]
    where = f"rank {rank}, config {case!r}"

    def dilated(group_):
        return lambda q, k, v: dilated_attention(q, k, v, segs, rates, is_causal=causal,
                                                 group=group_, return_lse=True)

    want = _with_grads(dilated(None), *full)
    strided = case.get("strided", False)
    got = _with_grads(dilated(group), *(_rows(x, ranges) for x in (q, k, v, dout)),
                      _rows(dlse, ranges, 2), strided)
    errors = _compare(got, want, ranges, f"dilated_attention, {where}")

    dense = _with_grads(lambda q, k, v: reference_attention(q, k, v, causal=causal), *full)
    layouts = [("contiguous", ranges)]
    n = sum(lengths)
    if n % (2 * world) == 0:
        layouts.append(("zigzag", piece_ranges(n, world, rank, "zigzag")))
    for layout, rows in layouts:
        def ring(q, k, v, layout=layout):
            return ring_attention(q, k, v, is_causal=causal, group=group, return_lse=True,
                                  layout=layout)

        got = _with_grads(ring, *(_rows(x, rows) for x in (q, k, v, dout)), _rows(dlse, rows, 2),
                          strided)
        errors += _compare(got, dense, rows, f"ring_attention layout={layout}, {where}")
    return errors


def _run_cases(group, world: int) -> List[str]:
    errors = []
    for case in _cases(world):
        try:
            errors += _check_case(group, case)
        except Exception as exc:  # name the config in the rank's traceback
            raise RuntimeError(f"rank {comm.group_rank(group)}, config {case!r}: {exc}") from exc
    return errors


@functools.lru_cache(maxsize=None)
def _spawn(world: int) -> List[List[str]]:
    return run_distributed(_run_cases, world, world, timeout=240)


def test_random_cases_are_deterministic_and_varied():
    assert _cases(3) == _cases(3)
    cases = [c for w in WORLDS for c in _cases(w)]
    assert any(0 in c["lengths"] for c in cases)
    assert any(sum(c["lengths"]) % (2 * c["world"]) == 0 for c in cases)
    assert any(c["hk"] < c["h"] for c in cases) and any(c["causal"] for c in cases)
    assert any(max(c["segs"]) >= sum(c["lengths"]) for c in cases)
    assert any(c["strided"] for c in cases) and not all(c["strided"] for c in cases)


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS)
def test_random_configs_match_single_process(world):
    errors = [e for rank_errors in _spawn(world) for e in rank_errors]
    assert not errors, f"{len(errors)} mismatches:\n" + "\n".join(errors[:10])
