"""Which ranks an op runs over: process groups, device meshes and grids; sizes and ranks.

Groups: a ``ProcessGroup``, a ``DeviceMesh`` of one or two dimensions, or
None (local: size 1, rank 0, nothing is sent). A 2-D mesh is a ``Grid``:
its first dimension head-parallel (U ranks), its second sequence-parallel
(S ranks), and the rank at mesh coordinate (u, s) holds sequence piece
``s * U + u`` (USP's order). The collectives (``agree``, ``all_gather``,
``all_reduce_``, ``reduce_scatter``) take a Grid like a group of U * S
ranks whose rank is the piece index, so callers that only sum or gather
over "all ranks" need not know the shape; point-to-point traffic takes one
dimension's group.
"""

from __future__ import annotations

import dataclasses
from typing import Any, FrozenSet, Optional, Tuple, Union

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

# What the public functions and modules take as group= / process_group=
# (``resolve_group`` checks it and makes it a Group).
GroupLike = Optional[Union[dist.ProcessGroup, DeviceMesh]]
# What the library passes around once resolved: a process group, a 2-D grid, or None (local).
Group = Optional[Union[dist.ProcessGroup, "Grid"]]


@dataclasses.dataclass(frozen=True)
class Grid:
    """Ranks in a grid of U head-parallel x S sequence-parallel ranks (a 2-D DeviceMesh).

    heads: the U ranks that hold one contiguous block of the sequence (None when
    U == 1); sequence: the S ranks that hold the same heads after a head
    all-to-all (None when S == 1). The rank at (u, s) holds sequence piece
    s * U + u: ``group_rank(grid)`` is that piece index, ``group_size(grid)`` U * S.
    members: the global ranks of the whole grid (the mesh's).
    """

    heads: Group
    sequence: Group
    members: Tuple[int, ...] = ()

    @property
    def shape(self) -> Tuple[int, int]:
        return group_size(self.heads), group_size(self.sequence)

    @property
    def coordinate(self) -> Tuple[int, int]:
        return group_rank(self.heads), group_rank(self.sequence)


def check_group_type(group: Any, name: str = "group") -> None:
    """A TypeError naming `name` unless `group` is of a kind ``resolve_group`` takes: for
    constructors, which keep the group until a call resolves it (membership is checked
    then)."""
    if not (group is None or isinstance(group, (Grid, DeviceMesh, dist.ProcessGroup))
            or (isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER)):
        raise TypeError(
            f"{name} must be None, a torch.distributed.ProcessGroup or a 1-D/2-D DeviceMesh, "
            f"got {type(group).__name__} {group!r}"
        )


def resolve_group(group: Any, name: str = "group") -> Group:
    """The group an op runs over: a ProcessGroup, a Grid (2-D mesh) or None (local).

    Accepts None, a ``torch.distributed.ProcessGroup``, a 1-D ``DeviceMesh``
    (its group) or a 2-D one (a Grid: head-parallel x sequence-parallel).
    Anything else is a TypeError naming `name`; a group or mesh this rank is
    not a member of is a ValueError (it would otherwise compute alone).
    """
    if group is None or isinstance(group, Grid):
        return group
    if isinstance(group, DeviceMesh):
        if group.get_coordinate() is None:
            raise ValueError(f"{name}: this rank (global rank {dist.get_rank()}) is not in the "
                             f"device mesh {group}")
        if group.ndim == 1:
            return resolve_group(group.get_group(0), name)
        if group.ndim != 2:
            raise ValueError(f"{name} must be a 1-D or 2-D DeviceMesh (head-parallel x "
                             f"sequence-parallel), got a {group.ndim}-D mesh {group}")
        heads, sequence = (_one_or_none(group.get_group(dim)) for dim in (0, 1))
        if heads is None:
            return sequence
        return Grid(heads, sequence, tuple(group.mesh.flatten().tolist()))
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{name}: this rank (global rank {dist.get_rank()}) is not a member of the process "
            f"group (torch.distributed.new_group returned NON_GROUP_MEMBER here); call the op "
            f"only on the group's ranks"
        )
    check_group_type(group, name)
    if dist.get_rank(group) < 0:
        raise ValueError(f"{name}: this rank (global rank {dist.get_rank()}) is not a member "
                         f"of the process group {group!r}")
    return group


def _one_or_none(group: Group) -> Group:
    """None for a group of one rank: a mesh dimension of size 1 does nothing."""
    return None if dist.get_world_size(group) == 1 else group


def plain(group: Any) -> Group:
    """A DeviceMesh as the group or Grid it stands for; anything else as it is."""
    return resolve_group(group) if isinstance(group, DeviceMesh) else group


def is_distributed(group: Group) -> bool:
    """True when `group` is a process group (or grid) of more than one rank."""
    return group is not None and group_size(group) > 1


def moves_data(*tensors) -> bool:
    """Whether a collective over `tensors` has data to move: not for meta tensors (shape-only
    runs: estimate --dry-run on a fake group), whose c10d ops have no meta kernels before
    torch 2.11. Callers still count the bytes such a call would send."""
    return not all(t.is_meta for t in tensors)


def group_size(group: Group) -> int:
    """Ranks in `group`; None (local) is 1; a Grid U * S."""
    group = plain(group)
    if group is None:
        return 1
    if isinstance(group, Grid):
        heads, sequence = group.shape
        return heads * sequence
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's rank inside `group`; None (local) is 0; in a Grid its piece index."""
    group = plain(group)
    if group is None:
        return 0
    if isinstance(group, Grid):
        (u, s), (heads, _) = group.coordinate, group.shape
        return s * heads + u
    return dist.get_rank(group)


def members(group: Group) -> FrozenSet[int]:
    """The global ranks of `group` (a DeviceMesh, a Grid, a ProcessGroup); None: this one."""
    group = plain(group)
    if group is None:
        return frozenset((dist.get_rank(),) if dist.is_initialized() else (0,))
    if isinstance(group, Grid):
        return frozenset(group.members)
    return frozenset(dist.get_process_group_ranks(group))


def global_rank(group: Group, rank: int) -> int:
    """The global rank of group rank `rank` (p2p ops address global ranks)."""
    return rank if group is None else dist.get_global_rank(group, rank)
