"""Left-padded rows: where each row's sequence starts (its origin), agreed over ranks.

transformers' ``generate`` pads a batch of prompts on the left and numbers
each row's real tokens 0, 1, ... (position_ids from the mask's cumulative
sum), so that rotary positions are the row's own. The attention function
follows the positions: a row whose first real token has position 0 is
computed as the row alone, its dilated segments starting at that token
(``decoding``'s origin; docs/spec.md, Generation), and it generates exactly
what it generates alone. A row whose positions count its padding (a forward
given no position_ids) keeps the padding inside its segments, masked as key
padding, as before. Both rules read the same facts in the prefill (the
first real token's index and position) and in each decoding step (the new
token's position, t - s for a row alone), so the cache is read as it was
written.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor


def first_real_tokens(keep: Optional[Tensor], position_ids: Optional[Tensor],
                      batch: int) -> Optional[Tuple[Optional[Tuple[int, Optional[int]]], ...]]:
    """This rank's facts: per row, (local index, position) of its first real key, or None
    when the row has none here; None for the whole when no key is padded here (each row's
    first key is then its first real one, and position_facts has its position)."""
    if keep is None:
        return None
    index = keep.int().argmax(dim=1)  # (b,): the first True, 0 for a row of False
    found = keep.any(dim=1).tolist()
    positions = [None] * batch
    if position_ids is not None:
        rows = position_ids.expand(batch, -1) if position_ids.shape[0] == 1 else position_ids
        positions = rows.gather(1, index[:, None])[:, 0].tolist()
    return tuple((i, p) if f else None for i, p, f in zip(index.tolist(), positions, found))


def agreed_origins(infos: List[Dict[str, Any]], batch: int) -> Optional[Tuple[int, ...]]:
    """Where each row's sequence starts, from every rank's facts (``first_real_tokens`` as
    "real_from", position_facts' "first", the piece length "n"); None when every row starts
    at 0. Every rank reads every rank's facts, so all agree."""
    origins = []
    for row in range(batch):
        origin, offset = 0, 0
        for info in infos:
            found = _first_real(info, row)
            if found is not None:
                index, position = found
                origin = offset + index if position == 0 else 0
                break
            offset += info["n"]
        origins.append(origin)
    return tuple(origins) if any(origins) else None


def _first_real(info: Dict[str, Any], row: int) -> Optional[Tuple[int, Optional[int]]]:
    if info["n"] == 0:
        return None
    if info["real_from"] is not None:
        return info["real_from"][row]
    first = info["first"]
    return 0, None if first is None else first[row if len(first) > 1 else 0]


def decoding_origins(keep: Optional[Tensor], position_ids: Optional[Tensor],
                     t: int) -> Tuple[Optional[Tuple[int, ...]], Optional[Tensor]]:
    """(origins, the keep-mask the step still needs) of a step at position t.

    keep (b, t + 1): padding must be on the left (a hole after a row's first
    real token is refused: the prefill read its origin from positions that
    the hole would shift). A row whose new position is t - s (its first
    real token at s has position 0) starts at s; any other row starts at 0,
    its padding masked.
    """
    if keep is None:
        return None, None
    first = keep.int().argmax(dim=1)  # (b,)
    later = torch.arange(keep.shape[1], device=keep.device)[None] >= first[:, None]
    if bool((later & ~keep).any()):
        raise NotImplementedError(
            "decoding with a padding mask that has padding after a row's first real token: "
            "pad prompts on the left (generate continues each row at its end)"
        )
    starts = first.tolist()
    if position_ids is None:
        positions: Sequence[Optional[int]] = [None] * len(starts)
    else:
        positions = position_ids.reshape(-1).expand(len(starts)).tolist() \
            if position_ids.numel() == 1 else position_ids.reshape(-1).tolist()
    origins = tuple(s if p == t - s else 0 for s, p in zip(starts, positions))
    # padding inside a row's segments (a row at origin 0) must be masked
    masked = any(s > 0 and o == 0 for s, o in zip(starts, origins))
    return (origins if any(origins) else None), (keep if masked else None)
