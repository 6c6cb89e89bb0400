"""Packed documents from what a transformers model passes: position_ids, cu_seq_lens, masks.

Every rank sends its position facts (``position_facts``) in the attention
function's agreement; ``agreed_documents`` turns every rank's facts into the
global document boundaries, so a disagreement is an error on every rank.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

from torch import Tensor

from ... import validation as check


def explicit_documents(kwargs) -> Optional[Tuple[int, ...]]:
    return check.check_cu_seqlens(kwargs.get("cu_seq_lens_q"), "cu_seq_lens_q")


def restarts(position_ids: Tensor) -> Tensor:
    """(b, n) -> (b, n - 1) bool: True where a position is not its predecessor's + 1.

    transformers' rule for packed documents (a new document starts there);
    for documents that restart at 0 it agrees with flash-attention's.
    """
    return position_ids[:, 1:] != position_ids[:, :-1] + 1


def position_facts(position_ids, batch: int, n: int, decoding: bool) -> Dict[str, Any]:
    """This rank's position_ids as plain values: first and last of each row, local restarts."""
    none = {"first": None, "last": None, "restarts": (), "same_rows": True, "rows": None}
    if position_ids is None or decoding:
        return none
    position_ids = check.check_position_ids(position_ids, batch, n)
    if n == 0:
        return {**none, "rows": position_ids.shape[0]}
    restart = restarts(position_ids)
    return {
        "first": tuple(position_ids[:, 0].tolist()),
        "last": tuple(position_ids[:, -1].tolist()),
        "restarts": tuple((restart.any(0).nonzero().flatten() + 1).tolist()),
        "same_rows": bool((position_ids == position_ids[:1]).all()),
        "rows": position_ids.shape[0],
    }


def agreed_documents(infos: List[Dict[str, Any]], explicit: Optional[Tuple[int, ...]], *,
               use_positions: bool, distributed: bool) -> Optional[Tuple[int, ...]]:
    """The global document boundaries [0, c1, ..., N] (None: one document), from every rank's facts.

    Sources: cu_seq_lens_q (global), transformers' packed-sequence mask and
    position_ids (read only without padding, as transformers does: the
    positions of a left-padded row restart too); where several speak they
    must agree. Under sequence parallelism documents must be declared in
    cu_seq_lens_q (``shard_inputs`` does): a rank that was given no
    position_ids gets 0 .. n-1 from transformers, and its restart at the
    piece border would otherwise pass for a document start. Every rank
    reads every rank's facts, so an error is raised on all of them.
    """
    lengths = [info["n"] for info in infos]
    offsets = [sum(lengths[:p]) for p in range(len(infos))]
    total = sum(lengths)
    starts: Set[int] = set()
    if use_positions:
        starts = _position_restarts(infos, offsets)
    for p, info in enumerate(infos):
        if info["overlay"] is None:
            continue
        ours = {s - offsets[p] for s in starts if offsets[p] < s < offsets[p] + lengths[p]}
        if set(info["overlay"]) != ours:
            raise ValueError(
                f"transformers' packed-sequence mask starts documents at rows "
                f"{check.brief(sorted(info['overlay']))} of rank {p}'s piece, but its "
                f"position_ids restart at {check.brief(sorted(ours))}"
            )
    if explicit is not None:
        check.check_documents(explicit, total, "cu_seq_lens_q")
        stray = sorted(starts - set(explicit))
        if stray:
            raise ValueError(
                f"position_ids restart at rows {check.brief(stray)}, which cu_seq_lens_q = "
                f"{check.brief(explicit)} does not list as document starts"
            )
        return explicit if len(explicit) > 2 else None
    if not starts:
        return None
    if distributed:
        raise ValueError(
            f"position_ids restart at rows {check.brief(sorted(starts))} of the whole sequence: "
            f"under sequence parallelism pass every rank its rows of the GLOBAL position_ids, "
            f"and cu_seq_lens_q/cu_seq_lens_k for packed documents (shard_inputs does both)"
        )
    if not all(info["same_rows"] for info in infos):
        raise ValueError("position_ids restart (packed documents) but differ between batch "
                         "rows; documents are shared by the batch: pass one row of "
                         "position_ids, or cu_seq_lens_q/cu_seq_lens_k")
    return (0, *sorted(starts), total)


def _position_restarts(infos: List[Dict[str, Any]], offsets: List[int]) -> Set[int]:
    """Global rows where position_ids restart: inside a piece, or at a border between pieces."""
    found: Set[int] = set()
    before = None  # the last positions of the nearest earlier non-empty piece
    for p, info in enumerate(infos):
        if info["first"] is None:
            continue
        found |= {offsets[p] + i for i in info["restarts"]}
        if before is not None and any(f != b + 1 for f, b in zip(info["first"], before)):
            found.add(offsets[p])
        before = info["last"]
    return found
