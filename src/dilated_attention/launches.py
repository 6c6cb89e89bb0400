"""Kernel launches over rows of a sequence: the loops every dilated op shares.

A launch runs one head group (patterns.HeadGroup) of one pattern over a
chunk of equal segments (patterns.Region): gather the selected rows into a
dense ``(b * segments, rows, heads, d)`` batch (a free view for rate 1), call
the kernel, and merge the result into whole-sequence fp32 accumulators with
the log-sum-exp merge. The backward runs the same launches with the final
merged out/lse and scatters the gradients back. The single-device op runs
every launch of the sequence; the sequence-parallel op runs the launches of
the segments that lie inside its rank (and its own slices of the others).

Notation: b batch, n rows, h query heads, hk key/value heads, d head dim.
"""

from __future__ import annotations

from typing import Iterable, Iterator, List, NamedTuple, Optional

import torch
from torch import Tensor

from .kernels import KernelOptions, attention_backward, attention_forward
from .merge import merge_, merge_selected_
from .patterns import HeadGroup, Patterns, Region, gather, head_groups, regions, scatter_add_
from .patterns import segments_view

# Segments are launched in chunks of at most max(ROWS_PER_LAUNCH, 1/16 of the
# region) rows: the gathered copies and the kernel's output stay a small
# fraction of the input whatever n is, each launch is large enough to keep
# every core busy (a GPU needs far more rows in flight than a CPU to hide its
# launch latency), and a region never takes more than ~16 launches, so the
# per-launch Python and merge overhead stays constant too (this is also what
# keeps shape-only runs on meta tensors fast).
ROWS_PER_LAUNCH = {"cpu": 4096, "cuda": 131072}
MAX_LAUNCHES_PER_REGION = 16


class Launch(NamedTuple):
    """One kernel call: the heads of `group` over every segment of `region`.

    `id` numbers the launches of one call on one rank; dropout seeds derive
    from it (KernelOptions.for_launch), so backward replays forward's masks.
    """

    id: int
    region: Region
    group: HeadGroup


def chunks(region: Region, device: torch.device) -> Iterator[Region]:
    """Split a region into consecutive regions that each make one launch."""
    rows = max(
        ROWS_PER_LAUNCH.get(device.type, ROWS_PER_LAUNCH["cpu"]),
        -(-region.num_segments * region.seg_len // MAX_LAUNCHES_PER_REGION),
    )
    per_launch = max(1, rows // region.seg_len)
    for first in range(0, region.num_segments, per_launch):
        yield Region(
            region.start + first * region.seg_len,
            min(per_launch, region.num_segments - first),
            region.seg_len,
        )


def region_launches(
    region: Region, groups: Iterable[HeadGroup], device: torch.device, first_id: int
) -> List[Launch]:
    """The launches of `groups` over `region`, numbered from `first_id`."""
    groups = tuple(groups)
    out: List[Launch] = []
    for chunk in chunks(region, device):
        for group in groups:
            out.append(Launch(first_id + len(out), chunk, group))
    return out


def sequence_launches(n: int, h: int, hk: int, patterns: Patterns,
                      device: torch.device) -> Iterator[Launch]:
    """Every launch of the single-device op over n rows, in order."""
    next_id = 0
    for w, r in zip(*patterns):
        for region in regions(n, w):
            groups = head_groups(0, region.seg_len, r, h, hk, str(device))
            for launch in region_launches(region, groups, device, next_id):
                yield launch
                next_id += 1


def forward_launches(q: Tensor, k: Tensor, v: Tensor, launches: Iterable[Launch],
                     acc_out: Tensor, acc_lse: Tensor, opts: KernelOptions) -> None:
    """Run `launches` over rows of q and k/v; merge each into the (b, n, h, ...) accumulators."""
    for launch in launches:
        region, group = launch.region, launch.group
        # (b, n, h, d) -> (b * segments, rows, heads, d)
        q_g = gather(q, region, group.q_heads, group.q_index, group.identity)
        k_g = gather(k, region, group.kv_heads, group.kv_index, group.identity)
        v_g = gather(v, region, group.kv_heads, group.kv_index, group.identity)
        out_g, lse_g = attention_forward(q_g, k_g, v_g, opts.for_launch(launch.id))
        del q_g, k_g, v_g
        merge_rows(acc_out, acc_lse, region, group, out_g, lse_g)
        del out_g, lse_g  # free before the next launch gathers


def merge_rows(acc_out: Tensor, acc_lse: Tensor, region: Region, group: HeadGroup,
               out_g: Tensor, lse_g: Tensor) -> None:
    """Merge a launch's (b * s, rows, heads, ...) results into the (b, n, h, ...) accumulators."""
    seg_out, seg_lse = segments_view(acc_out, region), segments_view(acc_lse, region)
    # (b * s, rows, heads, ...) -> (b, s, rows, heads, ...)
    out_g = out_g.unflatten(0, seg_out.shape[:2])
    lse_g = lse_g.unflatten(0, seg_out.shape[:2])
    if group.identity:
        merge_(seg_out, seg_lse, out_g, lse_g)
        return
    merge_selected_(seg_out, seg_lse, (slice(None), slice(None), group.q_index, group.q_heads),
                    out_g, lse_g)


def backward_launches(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      launches: Iterable[Launch], dq: Tensor, dk: Tensor, dv: Tensor,
                      opts: KernelOptions, dlse: Optional[Tensor]) -> None:
    """Gradients of `forward_launches`' launches, accumulated into dq, dk, dv (fp32)."""
    for launch in launches:
        region, group = launch.region, launch.group
        q_sel = (region, group.q_heads, group.q_index, group.identity)
        kv_sel = (region, group.kv_heads, group.kv_index, group.identity)
        dq_g, dk_g, dv_g = attention_backward(
            gather(dout, *q_sel),
            gather(q, *q_sel),
            gather(k, *kv_sel),
            gather(v, *kv_sel),
            gather(out, *q_sel),
            gather(lse, *q_sel),
            opts.for_launch(launch.id),
            dlse=None if dlse is None else gather(dlse, *q_sel),
        )
        scatter_add_(dq, *q_sel, dq_g)
        scatter_add_(dk, *kv_sel, dk_g)
        scatter_add_(dv, *kv_sel, dv_g)
        del dq_g, dk_g, dv_g  # free before the next launch gathers
