"""The language-model loss: token-mean cross-entropy over every rank, and its gradient convention.

Under sequence parallelism each rank holds its own tokens' logits; the loss
is the global token mean on every rank and its gradient P times this rank's
share (Note [gradients across ranks] in distributed/sharding.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..distributed.sharding import sum_across_ranks

IGNORE_INDEX = -100


def token_mean_loss(logits: Tensor, targets: Tensor, group) -> Tensor:
    """Cross-entropy averaged over every non-ignored token of every rank.

    Targets are aligned with the logits (position t predicts targets[t]);
    every rank of `group` calls it, a rank without targets too. When no rank
    has a target that is not ignored the loss is 0 (not 0/0 = NaN), still
    connected to the logits, so ``backward`` gives zero gradients. Under a
    group of P ranks the value is the global mean on every rank and the
    gradient is P times this rank's share of it, so that averaging the
    gradients over the group (all_reduce_gradients, DDP, FSDP2) sums the
    shares (Note [gradients across ranks] in distributed/sharding.py).
    """
    # fp32 for half-precision logits (fp64 stays fp64)
    acc = torch.promote_types(logits.dtype, torch.float32)
    # (b, n, v) -> (b * n, v)
    total = F.cross_entropy(
        logits.to(acc).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    count = (targets != IGNORE_INDEX).sum().to(acc)
    summed = sum_across_ranks(torch.stack([total, count]), group)
    # count 0 means total 0 (an empty sum): 0 / 1 instead of NaN; count >= 1 is unchanged
    return summed[0] / summed[1].clamp(min=1)

