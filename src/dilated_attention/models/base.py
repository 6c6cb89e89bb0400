"""What both LongNet models share: embeddings, positions, the head and loss, running blocks.

Notation: b batch, n tokens (this rank's piece under sequence parallelism),
e embed dim, v vocabulary.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import validation as check
from ..distributed import comm
from ..modules import deepcopy_sharing_group
from .checkpointing import run_blocks
from .config import LongNetConfig
from .layers import Block, Positions
from .loss import chunked_token_mean_loss, token_mean_loss


class LongNetBase(nn.Module):
    """What LongNetLM and LongNet share: token and position embeddings, the head and the loss,
    running a stack of blocks (with activation checkpointing), the replica check."""

    def __init__(self, config: LongNetConfig, device, dtype, process_group, strategy) -> None:
        super().__init__()
        if not isinstance(config, LongNetConfig):
            raise TypeError(f"config must be a LongNetConfig, got {type(config).__name__}")
        self.config = config
        self.process_group = process_group
        self.strategy = check.check_strategy(strategy)
        # training forwards that compare parameter checksums across the ranks
        # (_replica_checksums, _replica_check): how many have run (counted up to 2), and the
        # parameters' version sum at the last one (None once one ran after a change)
        self._replica_forwards = 0
        self._replica_versions: Optional[int] = -1
        self._factory = {"device": device, "dtype": check.check_module_dtype(dtype)}
        e = config.embed_dim
        self.embed = nn.Embedding(config.vocab_size, e, **self._factory)
        nn.init.normal_(self.embed.weight, std=e**-0.5)
        self.positions = Positions(config, self._factory)
        self.head = None
        if not config.tie_embeddings:
            self.head = nn.Linear(e, config.vocab_size, bias=False, **self._factory)
            nn.init.normal_(self.head.weight, std=e**-0.5)

    def __deepcopy__(self, memo: dict) -> "LongNetBase":
        return deepcopy_sharing_group(self, memo)

    def reset_parameters(self) -> None:
        """Draw every parameter again, from the distributions construction draws it from.

        For a model built on the meta device (no memory): ``model.to_empty(device=...)``,
        then this. Parameters are drawn in module order from torch's generator, so the same
        seed gives the same model wherever it was built (not the values construction drew:
        construction also draws torch's default initialisations, then overwrites them).
        """
        std = self.config.embed_dim**-0.5
        nn.init.normal_(self.embed.weight, std=std)
        self.positions.reset_parameters()
        if self.head is not None:
            nn.init.normal_(self.head.weight, std=std)
        for name, child in self.named_children():
            if name not in ("embed", "positions", "head"):
                # the stacks of blocks (nn.ModuleList) and the final norms
                for module in child if isinstance(child, nn.ModuleList) else (child,):
                    module.reset_parameters()

    def _replica_check(self) -> Optional[nn.Module]:
        """This model when this training forward under a group compares its parameters across
        ranks (one read of every parameter), else None. The first two such forwards check
        (a step of one micro-batch, updated by any means, shows a missed gradient reduction
        at the second), and, where the second came before the parameters changed (gradient
        accumulation), the first after an optimizer step changed them in place (their
        version counters move; an update through ``.data`` moves none)."""
        if self._replica_versions is None or not (
                torch.is_grad_enabled() and comm.is_distributed(self.process_group)):
            return None
        versions = sum(p._version for p in self.parameters())
        if self._replica_forwards < 2:
            self._replica_forwards += 1
            changed = self._replica_forwards == 2 and versions != self._replica_versions
        elif versions == self._replica_versions:
            return None  # not updated since: gradients still accumulating
        else:
            changed = True
        self._replica_versions = None if changed else versions
        return self

    def _blocks(self, n: int, *, gamma: float, causal: bool, cross: bool) -> nn.ModuleList:
        return nn.ModuleList(
            Block(self.config, gamma=gamma, causal=causal, cross_attention=cross,
                  factory=self._factory, process_group=self.process_group,
                  strategy=self.strategy)
            for _ in range(n)
        )

    def _norm(self) -> nn.LayerNorm:
        return nn.LayerNorm(self.config.embed_dim, eps=self.config.layer_norm_eps, **self._factory)

    def embed_at(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """(b, n) ids at positions (n,) (or (b, n), one row each) -> (b, n, e)."""
        x = self.embed(tokens)
        added = self.positions(positions, x)
        return x if added is None else x + added

    def rotary_at(self, positions: Tensor, like: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
        """The self-attentions' rotary tables at positions (n,) or (b, n) in like's dtype;
        None unless positions="rotary"."""
        return self.positions.rotary(positions, like)

    def _check_positions(self, largest: Optional[int]) -> None:
        """Positions past a learned table: an error on every rank (the caller agreed `largest`)."""
        if self.positions.table is not None and largest is not None and \
                largest >= self.config.max_seq_len:
            raise ValueError(
                f"positions up to {largest} exceed max_seq_len={self.config.max_seq_len} of the "
                f"learned position table"
            )

    def _run(self, layers: nn.ModuleList, x: Tensor, memory: Optional[Tensor] = None,
             cu_seqlens: Optional[Tuple[int, ...]] = None,
             rotary: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
        return run_blocks(layers, x, self.config.checkpoint, memory=memory, cu_seqlens=cu_seqlens,
                          rotary=rotary)

    def head_weight(self) -> Tensor:
        """(v, e): the head's weight, the token embedding's when tied."""
        return self.embed.weight if self.head is None else self.head.weight

    def logits(self, x: Tensor) -> Tensor:
        """Final hidden states (b, n, e) -> (b, n, v), through the (tied) head."""
        if self.head is None:
            return F.linear(x, self.embed.weight)
        return self.head(x)

    def _head_and_loss(self, x: Tensor, targets: Optional[Tensor],
                       return_logits: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """Final hidden states (b, n, e) -> (logits or None, loss or None).

        With targets and not return_logits the loss runs over chunks of rows
        and no logits exist (Note [chunked head loss] in loss.py).
        """
        check.check_bool("return_logits", return_logits)
        if targets is not None and not return_logits:
            return None, chunked_token_mean_loss(x, self.head_weight(), targets.long(),
                                                 self.process_group,
                                                 chunk_bytes=self.config.loss_chunk_bytes,
                                                 training=self.training)
        logits = self.logits(x)
        if targets is None:
            return logits, None
        return logits, token_mean_loss(logits, targets.long(), self.process_group)
