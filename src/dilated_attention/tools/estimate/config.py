"""What ``estimate`` is asked: the call, its ranks and the device modelled, checked.

Notation: b batch, N total rows, P ranks, U x S a head-parallel x sequence-parallel
split of them, h heads, hk key/value heads, d head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import torch

from ...distributed import strategy as strategies
from ...distributed.sharding import piece_lengths
from ...distributed.ulysses import HeadSplit
from ...fused import MAX_HEAD_DIM
from ...backends import FUSED_BY_DEFAULT
from ...kernels import lse_dtype
from ...validation import check_dropout, check_strategy
from ...window import reaches
from ..settings import (AttentionSetting, check_mesh_heads, check_setting, check_window,
                        check_zigzag, default_threads, ring_layout)

DEVICES = ("cpu", "cuda")
# Lengths are torch indices: a sequence of 2^63 rows or more cannot be indexed.
MAX_SEQ_LEN = (1 << 63) - 1


@dataclasses.dataclass(frozen=True)
class EstimateConfig(AttentionSetting):
    seq_len: int
    world_size: int
    training: bool
    impl: str
    threads: int
    device: str = "cpu"
    strategy: str = "auto"
    mesh: Optional[Tuple[int, int]] = None  # (U head-parallel, S sequence-parallel)
    dropout: float = 0.0  # attention dropout (a model's attention_dropout): blockwise kernel

    @property
    def windowed(self) -> bool:
        """Whether the call runs sliding-window attention (window.py; over P ranks the halo
        exchange, distributed/halo.py): a window that
        does not reach across the sequence (functional's rule: a side of N - 1 keys or
        more is unbounded, and the ring runs)."""
        return self.window is not None and self.window < self.seq_len - 1

    def reaches(self) -> Tuple[int, int]:
        """(left, right): the window's reaches in rows (window.reaches)."""
        return reaches(self.window_size, self.seq_len)

    @property
    def patterns(self) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        if self.impl == "ring":  # dense attention: one segment of N, rate 1
            return (self.seq_len,), (1,)
        return self.segment_lengths, self.dilation_rates

    @property
    def layout(self) -> str:
        """The ring's zigzag balances causal work; a sliding window's halo exchange is
        balanced as it is, on contiguous pieces (as ``bench --window``)."""
        if self.impl == "ring" and self.window is None:
            return ring_layout(self.causal, self.world_size)
        return "contiguous"

    def lengths(self) -> Tuple[int, ...]:
        return tuple(piece_lengths(self.seq_len, self.world_size, self.layout))

    def shape(self) -> strategies.Shape:
        """What the traffic of the call depends on (``distributed.strategy``)."""
        return strategies.Shape(self.lengths(), self.patterns, self.causal, self.heads,
                                self.kv_heads, self.head_dim, self.batch,
                                self.torch_dtype.itemsize, lse_dtype(self.torch_dtype).itemsize,
                                None)


def make_config(
    *,
    seq_len: int,
    world_size: int = 1,
    segment_lengths: Optional[Sequence[int]] = None,
    dilation_rates: Optional[Sequence[int]] = None,
    heads: int = 12,
    head_dim: int = 64,
    kv_heads: Optional[int] = None,
    batch: int = 1,
    dtype: str = "float32",
    causal: bool = False,
    training: bool = False,
    impl: str = "dilated",
    threads: Optional[int] = None,
    device: str = "cpu",
    strategy: Optional[str] = None,
    mesh: Optional[Tuple[int, int]] = None,
    window: Optional[int] = None,
    dropout: float = 0.0,
) -> EstimateConfig:
    """Check the options; ValueError names the option and value on a mistake."""
    if seq_len > MAX_SEQ_LEN:
        raise ValueError(f"--seq-len {seq_len} is beyond torch's int64 indices: at most "
                         f"2^63 - 1 rows")
    segs, rates, kv_heads = check_setting(segment_lengths, dilation_rates, heads, kv_heads)
    strategy = check_strategy(strategy or "auto")
    if mesh is not None:
        u, sp = mesh
        if world_size not in (1, u * sp):
            raise ValueError(f"--mesh {u}x{sp} is {u * sp} ranks, but --world-size is "
                             f"{world_size}")
        world_size = u * sp
        if strategy == "exchange":
            raise ValueError("--strategy exchange needs a one-dimensional group: a --mesh runs "
                             "Ulysses over its first dimension")
        check_mesh_heads((u, sp), heads)
        HeadSplit.of(u, heads, kv_heads)
    elif strategy == "ulysses":
        if impl == "ring":
            raise ValueError("--strategy is the dilated op's; Ulysses for the ring: --mesh Px1")
        if heads % world_size:
            raise ValueError(f"--strategy ulysses at --world-size {world_size}: the ranks must "
                             f"divide the {heads} query heads")
        HeadSplit.of(world_size, heads, kv_heads)
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and threads is not None:
        raise ValueError(f"--threads {threads} sets CPU kernel threads: it does not apply to "
                         f"--device cuda")
    if world_size > seq_len:
        raise ValueError(
            f"--world-size {world_size} is larger than --seq-len {seq_len}: every rank "
            f"needs at least one row"
        )
    dropout = check_dropout(dropout, "dropout")
    if dropout and impl == "ring":
        raise ValueError("dropout is the dilated op's (the models' attention_dropout): "
                         "ring_attention has none")
    check_window(window, impl == "ring")
    if window is None and impl == "ring" and causal:
        check_zigzag(seq_len, world_size)
    return EstimateConfig(
        seq_len=seq_len, world_size=world_size, segment_lengths=segs, dilation_rates=rates,
        heads=heads, head_dim=head_dim, kv_heads=kv_heads, batch=batch, dtype=dtype,
        causal=causal, training=training, impl=impl,
        threads=default_threads(world_size) if threads is None else threads, device=device,
        strategy=strategy, mesh=mesh, window=window, dropout=dropout,
    )


def split(config: EstimateConfig) -> Tuple[int, int]:
    """(U head-parallel, S sequence-parallel) ranks: the mesh, or strategy.choose's decision."""
    if config.mesh is not None:
        return config.mesh
    p = config.world_size
    if p == 1 or config.impl == "ring" or config.strategy == "exchange":
        return 1, p
    if config.strategy == "ulysses" or strategies.auto_choice(config.shape()) == "ulysses":
        return p, 1
    return 1, p


def strategy_name(config: EstimateConfig) -> str:
    u, sp = split(config)
    inner = "exchange"
    if config.impl == "ring":
        inner = "halo exchange" if config.windowed else "ring"
    if u == 1:
        name = inner if sp > 1 else "local"
    else:
        name = f"{u}x{sp} (ulysses" + (f" x {inner})" if sp > 1 else ")")
    return name + (" (auto)" if config.strategy == "auto" and config.mesh is None and
                   config.impl == "dilated" and config.world_size > 1 else "")


def backend_for(config: EstimateConfig) -> str:
    """The kernel of the launches on the modelled device: what ``backends.select_backend``
    picks there.

    CPU: the flash op. CUDA: on a compute capability 9.0+ GPU with triton and
    without flash-attn (an H100), cuDNN for bf16/fp16 and the memory-efficient op for
    fp32; fp64 runs the blockwise kernel. Their meta kernels give the outputs' shapes,
    so the dry run allocates what the real launches allocate. Where the call runs the
    fused kernel (``fuses``), these are the launches on received keys only. With dropout,
    the blockwise kernel on any device (auto's choice there).
    """
    if config.dropout > 0:
        return "blockwise"
    if config.device == "cpu":
        return "cpu_flash"
    if config.torch_dtype in (torch.float16, torch.bfloat16):
        return "cuda_cudnn"
    return "cuda_efficient" if config.torch_dtype == torch.float32 else "blockwise"


def fuses(config: EstimateConfig) -> bool:
    """Whether the modelled GPU runs the dilated op with the fused Triton kernel (auto there:
    backends.FUSED_BY_DEFAULT): the whole op where a rank computes it (one device, Ulysses
    over every rank), else each rank's own pairs, the launches on received keys beside it
    (the exchange on contiguous pieces, as the estimate lays them out)."""
    return (config.device == "cuda" and config.impl == "dilated" and config.dropout == 0
            and config.torch_dtype in FUSED_BY_DEFAULT["cuda"]
            and config.head_dim <= MAX_HEAD_DIM)


def kernels_name(config: EstimateConfig) -> str:
    """The modelled CUDA kernels, as the report names them."""
    if not fuses(config):
        return backend_for(config)
    if split(config)[1] == 1:
        return "triton"
    return f"triton; {backend_for(config)} on received keys"
