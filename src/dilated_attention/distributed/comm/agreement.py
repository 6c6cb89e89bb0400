"""The agreement: one small collective before any collective work, so that every rank makes
the same call, and a bad input on one rank is an error on every rank (never a hang)."""

from __future__ import annotations

import pickle
from typing import Any, Callable, Dict, List, Mapping, NoReturn, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .collectives import all_gather_flat
from .counting import record
from .groups import Grid, Group, group_size, is_distributed, plain, resolve_group
from .release import released_on_return


def agree(
    group: Group,
    config: Union[Mapping[str, Any], Callable[[], Mapping[str, Any]]],
    *,
    per_rank: Sequence[str] = (),
) -> List[Dict[str, Any]]:
    """Check that every rank makes the same call; return every rank's dict.

    One all-gather of this rank's pickled `config` (plain picklable
    values: ints, floats, strings, tuples, dtypes). Keys in `per_rank` may
    differ between ranks (e.g. this rank's sequence length) and arrive in
    the returned list, indexed by group rank; every other key must be equal
    on all ranks, else every rank raises ``ValueError`` naming the first
    differing key in the dict's order (put the user's arguments before
    values derived from them) and each rank's value.

    A rank must reach this collective even when its own input is bad, or
    the others would wait for it until the group's timeout. So pass
    `config` as a zero-argument callable that validates and builds the
    dict: an exception it raises is shared in the same collective, the
    failing rank re-raises it and every other rank raises ``ValueError``
    naming that rank and its error::

        infos = comm.agree(group, lambda: _validated_config(q, k, v, ...), per_rank=("n",))

    With a local group (None or one rank) this is just the callable.
    """
    group = plain(group)
    if group is not None and not isinstance(group, (Grid, dist.ProcessGroup)):
        # anything else (a wrong kind, NON_GROUP_MEMBER) is resolve_group's error naming the
        # group: the public functions that reach other ranks first here (unshard_sequence,
        # shard_inputs, causal_lm_loss) raise it, not an AttributeError from c10d
        resolve_group(group)
    error: Optional[Exception] = None
    mine: Dict[str, Any] = {}
    try:
        mine = dict(config() if callable(config) else config)
    except Exception as exc:  # shared with every rank below, then re-raised
        if not is_distributed(group):
            raise
        error = exc
    if not is_distributed(group):
        return [mine]
    payload = {
        "config": mine,
        "error": None if error is None else f"{type(error).__name__}: {error}",
    }
    gather = _gather_objects
    if torch.compiler.is_compiling():
        # a sequence-parallel model under torch.compile: the exchange runs eagerly, a graph
        # break either way (pickle is not traceable), but traced into, Dynamo warned about it
        gather = torch.compiler.disable(_gather_objects)
    gathered = gather(payload, group)
    failures = [(r, p["error"]) for r, p in enumerate(gathered) if p["error"] is not None]
    if failures:
        if error is not None:
            raise error
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failures)
        raise ValueError(f"the call failed on another rank of the group ({detail})")
    configs = [p["config"] for p in gathered]
    _check_equal(configs, set(per_rank))
    return configs


def fail_on_all_ranks(group: Group, error: Exception) -> NoReturn:
    """Raise `error` here and a ValueError naming it on every other rank of `group`.

    For a rank whose input failed a check before the agreement: it joins
    the other ranks' agreement collective with its error instead of a
    config, so no rank waits for it. With a local group this just raises.
    """

    def failing_config() -> Dict[str, Any]:
        raise error

    agree(group, failing_config)
    raise error  # only reached when `group` is local


def _gather_objects(obj: Any, group: Group) -> List[Any]:
    """Every rank's picklable `obj`, by group rank (a Grid: by piece index).

    A Grid gathers in two steps, so that every rank of it sees every rank's
    object (an error anywhere reaches everyone): first within the heads group,
    then the heads groups' lists within the sequence group.
    """
    if not isinstance(group, Grid):
        data = pickle.dumps(obj)
        record("agree", 1, len(data) * (group_size(group) - 1))
        return _all_gather_bytes(data, group)
    row = [obj] if group.heads is None else _gather_objects(obj, group.heads)
    rows = [row] if group.sequence is None else _gather_objects(row, group.sequence)
    # rows[s][u] -> piece order s * U + u
    return [x for row in rows for x in row]


# Each rank's payload travels in a slot of this many bytes: its length (8 bytes, little
# endian), then the payload if it fits. An op's agreement (about 500 bytes pickled) and a
# model's fit, so one all-gather carries every rank's; where a payload does not fit, every
# rank sees its length in the same all-gather and all of them gather the payloads again,
# padded to the longest. (Two all-gathers every time before, the lengths then the
# payloads: a collective's round trip, and gloo's release wait, of every call under a
# group.)
AGREEMENT_SLOT_BYTES = 4096
_LENGTH_BYTES = 8


def _all_gather_bytes(data: bytes, group: Group) -> List[Any]:
    """Every rank's pickled payload, unpickled, by group rank.

    Not ``dist.all_gather_object``: in torch 2.13 it decodes through NumPy,
    which torch does not require. One all-gather of fixed slots (each rank's
    length and payload, ``AGREEMENT_SLOT_BYTES``), and a second one padded to
    the longest payload only where one does not fit its slot.
    """
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl" else torch.device("cpu")
    )
    size, slot = group_size(group), AGREEMENT_SLOT_BYTES
    head = len(data).to_bytes(_LENGTH_BYTES, "little")
    fits = _LENGTH_BYTES + len(data) <= slot
    mine = torch.zeros(slot, dtype=torch.uint8, device=device)
    filled = head + data if fits else head
    mine[: len(filled)] = torch.frombuffer(bytearray(filled), dtype=torch.uint8)
    # (size * slot,) -> (size, slot): one slot per rank
    rows = _all_gather_rows(mine, size, group)
    lengths = [int.from_bytes(bytes(row[:_LENGTH_BYTES].tolist()), "little") for row in rows]
    start = _LENGTH_BYTES
    longest = max(lengths)
    if _LENGTH_BYTES + longest > slot:  # every rank sees the same lengths: all gather again
        mine = torch.zeros(longest, dtype=torch.uint8, device=device)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows, start = _all_gather_rows(mine, size, group), 0
    return [pickle.loads(bytes(rows[r, start:start + n].tolist()))
            for r, n in enumerate(lengths)]


def _all_gather_rows(mine: torch.Tensor, size: int, group: Group) -> torch.Tensor:
    """Every rank's `mine` (m,) as the rows of a (size, m) tensor on the CPU."""
    everyone = torch.empty(size * mine.numel(), dtype=mine.dtype, device=mine.device)
    with released_on_return(group, everyone, mine):
        all_gather_flat(everyone, mine, group=group)
    # (size * m,) -> (size, m)
    return everyone.view(size, mine.numel()).cpu()


def _check_equal(configs: List[Dict[str, Any]], exempt: set) -> None:
    """Name the first key, in the configs' own order, on which ranks differ.

    Callers list what the user passed before what they derive from it (a
    kernel chosen from the dtype and dropout_p, say), so a difference in an
    argument is reported as that argument, not as a value derived from it.
    """
    # rank 0's order, then keys only other ranks have
    keys = [key for key in dict.fromkeys(k for c in configs for k in c) if key not in exempt]
    for key in keys:
        values = [c.get(key, "<missing>") for c in configs]
        if any(not _same(values[0], v) for v in values[1:]):
            listing = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(f"ranks disagree on {key!r}: {listing}")


def _same(a: Any, b: Any) -> bool:
    """Agreement values are plain data (ints, floats, strings, tuples, dtypes)."""
    return type(a) is type(b) and a == b
