"""Brute-force float64 references for the tests (SPEC.md, "A brute-force reference").

Everything here is dense and slow on purpose: an (n x m) score matrix per
head, built from the definitions with no cleverness, so that it is obviously
correct for small n. Other test files import from here (the tests directory
is on sys.path under pytest), e.g. ``from reference import reference_attention``.

Notation: b batch, n query rows, m key rows, h query heads, hk key/value
heads, d head dim. Layout (b, n, h, d); every returned lse is (b, h, n),
the layout of the public API's ``return_lse=True``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.testing import assert_close

# (rtol, atol) against a float64 reference; SPEC.md "Dtypes and tolerance".
# atol is relative to the largest finite reference value (see `close`).
TOLERANCE = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (3e-2, 3e-2),
}


def dilated_counts(
    n: int, h: int, segment_lengths: Sequence[int], dilation_rates: Sequence[int], causal: bool,
    cu_seqlens: Optional[Sequence[int]] = None, first_head: int = 0,
) -> Tensor:
    """c (h, n, n) int64: in how many patterns query t of head j attends key u.

    Straight from SPEC.md "One pattern": W = min(w, n), segments
    [a, min(a + W, n)), head j selects local index (t - a) with
    (t - a) mod r == j mod r, a selected query attends the selected keys of
    its own segment (u <= t too when causal). With `cu_seqlens` every
    document is such a sequence on its own (no key outside it). Head j is
    model head first_head + j (its offset counts from there).
    """
    if cu_seqlens is not None:
        counts = torch.zeros(h, n, n, dtype=torch.int64)
        for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            if e > s:
                counts[:, s:e, s:e] = dilated_counts(e - s, h, segment_lengths, dilation_rates,
                                                     causal, first_head=first_head)
        return counts
    counts = torch.zeros(h, n, n, dtype=torch.int64)
    pos = torch.arange(n)
    for w, r in zip(segment_lengths, dilation_rates):
        seg_w = min(w, n)
        segment = pos // seg_w  # (n,) which segment a position is in
        local = pos - segment * seg_w  # (n,) t - a
        for j in range(h):
            selected = local % r == (first_head + j) % r  # (n,)
            # (n, 1) & (1, n): query t and key u both selected, same segment
            attends = selected[:, None] & selected[None, :]
            attends &= segment[:, None] == segment[None, :]
            if causal:
                attends &= pos[None, :] <= pos[:, None]
            counts[j] += attends.long()
    return counts


def attention_with_counts(
    q: Tensor, k: Tensor, v: Tensor, counts: Tensor, scale: Optional[float] = None,
    dropout: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Softmax attention with logits s(t, u) + log c(t, u) (-inf where c == 0), in float64.

    q (b, n, h, d), k/v (b, m, hk, d), counts broadcastable to (b, h, n, m).
    Query head j reads key/value head j // (h // hk). Returns out (b, n, h, d)
    and lse (b, h, n), both float64; a row with no keys gets out 0 and lse
    -inf. Differentiable, and its gradients are finite everywhere (masked
    entries are chosen with torch.where, never computed as exp(-inf - -inf)).
    dropout (b, h, n, m): factors multiplying the probabilities before they
    weight v (0 where dropped, 1 / (1 - p) kept); the lse is the undropped one.
    """
    q, k, v = q.double(), k.double(), v.double()
    b, n, h, d = q.shape
    hk = k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    kv_head = torch.arange(h) // (h // hk)  # query head j -> key/value head
    k_h, v_h = k[:, :, kv_head], v[:, :, kv_head]  # (b, m, hk, d) -> (b, m, h, d)
    counts = torch.as_tensor(counts).expand(b, h, n, k.shape[1])  # (b, h, n, m)
    allowed = counts > 0
    has_keys = allowed.any(-1, keepdim=True)  # (b, h, n, 1)
    scores = torch.einsum("bnhd,bmhd->bhnm", q, k_h) * scale
    scores = scores + torch.log(counts.clamp(min=1).double())
    # Masked keys get -inf; a row with no keys at all gets 0 everywhere so its
    # logsumexp (and that of its gradient) stays finite; it is masked below.
    fill = torch.where(has_keys, -math.inf, 0.0)
    scores = torch.where(allowed, scores, fill)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (b, h, n, 1)
    probs = torch.where(allowed, torch.exp(scores - lse), 0.0)
    if dropout is not None:
        probs = probs * dropout
    out = torch.einsum("bhnm,bmhd->bnhd", probs, v_h)
    lse = torch.where(has_keys, lse, -math.inf).squeeze(-1)
    return out, lse


def reference_dilated_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    cu_seqlens: Optional[Sequence[int]] = None,
    key_padding_mask: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Exact dilated attention (SPEC.md) in float64: out (b, n, h, d), lse (b, h, n).

    cu_seqlens: packed documents, each attended on its own; key_padding_mask
    (b, n) bool: True keys leave every softmax (their counts become 0).
    """
    n, h = q.shape[1], q.shape[2]
    counts = dilated_counts(n, h, segment_lengths, dilation_rates, causal, cu_seqlens)
    if key_padding_mask is not None:
        # (h, n, n) -> (b, h, n, n) with masked key columns zeroed
        counts = counts[None].masked_fill(key_padding_mask[:, None, None, :], 0)
    return attention_with_counts(q, k, v, counts, scale)


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: Optional[float] = None,
    key_padding_mask: Optional[Tensor] = None, dropout: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Dense softmax attention in float64: out (b, n, h, d), lse (b, h, n).

    q (b, n, h, d), k/v (b, m, hk, d), GQA by head mapping j -> j // (h // hk).
    ``causal``: query t sees keys u <= t (top-left aligned, as SDPA; for
    n == m the usual lower triangle). key_padding_mask (b, m): True = ignore.
    dropout (b, h, n, m): given dropout factors, as for `attention_with_counts`.
    """
    n, m = q.shape[1], k.shape[1]
    counts = torch.ones(n, m, dtype=torch.int64)
    if causal:
        counts = torch.tril(counts)
    if key_padding_mask is not None:
        # (n, m) -> (b, 1, n, m) with masked key columns zeroed
        counts = counts[None, None].masked_fill(key_padding_mask[:, None, None, :], 0)
    return attention_with_counts(q, k, v, counts, scale, dropout)


def grads(outputs: Sequence[Tensor], grad_outputs: Sequence[Tensor], inputs: Sequence[Tensor]):
    """torch.autograd.grad with upstream gradients (graph kept); unused inputs give zeros."""
    result = torch.autograd.grad(
        outputs, inputs, grad_outputs, retain_graph=True, allow_unused=True
    )
    return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(inputs, result))


def close(got: Tensor, want: Tensor, dtype: torch.dtype, what: str = "",
          terms: float = 1.0) -> None:
    """got ~ want (float64) to the tolerance of `dtype`, atol scaled by the size of `want`.

    Scaling atol matters for gradients: an entry that is exactly 0 in theory
    (a query that attends only itself has dq = 0) is a difference of two
    O(|dout| |v|) terms, so its rounding error is relative to those, not to 0.
    `terms` is the factor those terms carry beyond |dout| |v| (dq and dk: the
    scale times |k| or |q|), so such an entry is held to their rounding.
    Infinities must match exactly.
    """
    rtol, atol = TOLERANCE[dtype]
    finite = want[torch.isfinite(want)]
    size = max(1.0, terms, finite.abs().max().item()) if finite.numel() else max(1.0, terms)
    assert_close(got.double(), want, rtol=rtol, atol=atol * size, msg=lambda m: f"{what}: {m}")


def window_counts(n: int, window: Tuple[int, int], causal: bool = False,
                  cu_seqlens: Optional[Sequence[int]] = None) -> Tensor:
    """c (n, n) int64: 1 where query t attends key u under a sliding window (SPEC.md,
    "Sliding windows"): t - left <= u <= t + right (-1 unbounded; causal: right = 0),
    both in one document of `cu_seqlens`."""
    left, right = window
    right = 0 if causal else right
    t, u = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = torch.ones(n, n, dtype=torch.bool)
    if left >= 0:
        allowed &= u >= t - left
    if right >= 0:
        allowed &= u <= t + right
    if cu_seqlens is not None:
        doc = torch.bucketize(torch.arange(n), torch.as_tensor(cu_seqlens[1:-1]), right=True)
        allowed &= doc[:, None] == doc[None, :]
    return allowed.long()


def reference_window_attention(
    q: Tensor, k: Tensor, v: Tensor, window: Tuple[int, int], causal: bool = False,
    scale: Optional[float] = None, cu_seqlens: Optional[Sequence[int]] = None,
    key_padding_mask: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Sliding-window attention in float64: out (b, n, h, d), lse (b, h, n)."""
    counts = window_counts(q.shape[1], window, causal, cu_seqlens)
    if key_padding_mask is not None:
        # (n, n) -> (b, 1, n, n) with masked key columns zeroed
        counts = counts[None, None].masked_fill(key_padding_mask[:, None, None, :], 0)
    return attention_with_counts(q, k, v, counts, scale)


def philox4x32(seed: int, c0, c1, c2, c3, rounds: int = 10):
    """Philox4x32-10 (Salmon et al., 2011) as triton.language.philox computes it: the four
    uint32 words (numpy uint64 arrays) of counters (c0, c1, c2, c3) under the 64-bit key
    `seed` (low word first)."""
    import numpy as np

    word = np.uint64(0xFFFFFFFF)
    c = [np.asarray(x, dtype=np.uint64) & word for x in np.broadcast_arrays(c0, c1, c2, c3)]
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    mul_a, mul_b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(rounds):
        # products of two words fit in 64 bits: high word >> 32, low word & mask
        prod_a, prod_b = mul_a * c[0], mul_b * c[2]
        c = [(prod_b >> np.uint64(32)) ^ c[1] ^ k0, prod_b & word,
             (prod_a >> np.uint64(32)) ^ c[3] ^ k1, prod_a & word]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & word, (k1 + np.uint64(0xBB67AE85)) & word
    return c


def fused_dropout_factors(seed: int, dropout_p: float, selections: Tensor) -> Tensor:
    """(b, h, n, m) float64 factors of the fused kernels' dropout (Note [fused dropout] in
    fused.py) for `attention_with_counts`; selections (P, b, h, n, m): 1 where pattern i
    selects the pair. Pattern i keeps a pair where the 31 high bits of Philox word i mod 4
    of counter (t, u, batch row, head * 8 + i // 4) are at least p * 2^31; a pair weighs
    its keeping patterns / its patterns / (1 - threshold / 2^31)."""
    import numpy as np

    threshold = int(dropout_p * 2**31)
    _, b, h, n, m = selections.shape
    batch, head, t, u = np.meshgrid(np.arange(b), np.arange(h), np.arange(n), np.arange(m),
                                    indexing="ij")
    kept = np.zeros((b, h, n, m))
    for i, selected in enumerate(selections.numpy()):
        word = philox4x32(seed, t, u, batch, head * 8 + i // 4)[i % 4]
        kept += selected * ((word >> np.uint64(1)) >= threshold)
    counts = selections.sum(0).numpy()
    factors = kept / np.maximum(counts, 1) / (1 - threshold / 2**31)
    return torch.from_numpy(np.where(counts > 0, factors, 0.0))
