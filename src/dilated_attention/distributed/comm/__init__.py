"""Every ``torch.distributed`` call of the library, counted: one job per file.

No other library module imports ``torch.distributed``: they call the
functions here, which take the process group as an explicit argument
(``None`` means local: size 1, rank 0, nothing is sent) and count every
message and byte this process sends, so tests and benchmarks can assert the
traffic of an op. Library ops never create groups: launchers do
(``tools/launch.py``).

- ``counting.py``: ``count_communication`` and what it counts;
- ``groups.py``: process groups, device meshes and grids, sizes and ranks;
- ``agreement.py``: ``agree``, the small collective before an op;
- ``point_to_point.py``: ``RingComm`` and exchanges with any peers;
- ``release.py``: a collective returns only once gloo has let go of its
  tensors (a rank could otherwise abort at interpreter exit);
- ``collectives.py``: all-gather, all-reduce, reduce-scatter, broadcast and
  all-to-all, with uneven pieces.
"""

from .agreement import agree, fail_on_all_ranks
from .collectives import all_gather, all_reduce_, all_to_all, barrier, broadcast_, reduce_scatter
from .counting import CommStats, count_communication
from .groups import (Grid, Group, GroupLike, check_group_type, global_rank, group_rank,
                     group_size, is_distributed, members, resolve_group)
from .point_to_point import RingComm, Tensors, exchange, post_exchange, wait_exchange

__all__ = [
    "CommStats", "Grid", "Group", "GroupLike", "RingComm", "Tensors", "agree", "all_gather",
    "all_reduce_", "all_to_all", "barrier", "broadcast_", "check_group_type",
    "count_communication", "exchange", "fail_on_all_ranks", "global_rank", "group_rank",
    "group_size", "is_distributed", "members", "post_exchange", "reduce_scatter",
    "resolve_group", "wait_exchange",
]
