"""LongNet: the encoder-decoder LongNet model.

Notation: b batch, n target tokens, m source tokens (this rank's pieces under
sequence parallelism), e embed dim, v vocabulary.

Sequence parallelism follows LongNetLM's conventions (models/lm.py); the
encoder output is also gathered on every rank for the decoder's dense
cross-attention (O(M e) memory per rank, M the whole source).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.types
from torch import Tensor

from .. import validation as check
from ..distributed import comm
from ..distributed.sharding import gather_pieces
from .base import LongNetBase
from .config import LongNetConfig
from .inputs import agree_on_inputs, check_targets, check_tokens, config_fields, pick_targets
from .layers import magneto_gamma


class LongNet(LongNetBase):
    """Encoder-decoder LongNet: dilated self-attention in both stacks.

    ``forward(src_tokens, tgt_tokens, targets=None)`` -> ``(logits (b, n_tgt,
    v), None)`` without targets, ``(None, loss)`` with them (the loss over
    chunks of rows, as LongNetLM's; ``return_logits=True``: both). The encoder attends bidirectionally, the decoder causally,
    then (plain dense attention) over the whole encoder output. Source and
    target share the token embedding (and the head when tied).

    With ``process_group`` set, src/tgt/targets are this rank's pieces; the
    encoder output is gathered on every rank for the cross-attention. The
    loss and its gradients follow LongNetLM's convention.
    """

    def __init__(
        self, config: LongNetConfig, *, device: torch.types.Device = None,
        dtype: Optional[torch.dtype] = None, process_group: comm.GroupLike = None,
        strategy: str = "auto",
    ) -> None:
        super().__init__(config, device, dtype, process_group, strategy)
        enc_gamma, dec_gamma = magneto_gamma(config.num_layers, config.num_encoder_layers)
        self.encoder = self._blocks(
            config.num_encoder_layers, gamma=enc_gamma, causal=False, cross=False
        )
        self.encoder_norm = self._norm()
        self.decoder = self._blocks(config.num_layers, gamma=dec_gamma, causal=True, cross=True)
        self.decoder_norm = self._norm()

    def forward(
        self, src_tokens: Tensor, tgt_tokens: Tensor, targets: Optional[Tensor] = None, *,
        labels: Optional[Tensor] = None, return_logits: bool = False,
    ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        group = self.process_group
        vocab = self.config.vocab_size

        def inputs() -> Tuple[Tensor, ...]:
            # every check inside the agreement: a mistake on one rank raises on all
            check_tokens("src_tokens", src_tokens, vocab)
            check_tokens("tgt_tokens", tgt_tokens, vocab)
            if src_tokens.shape[0] != tgt_tokens.shape[0]:
                # cross-attention would broadcast a batch of 1 silently
                raise ValueError(
                    f"src_tokens and tgt_tokens must have the same batch size, got "
                    f"{src_tokens.shape[0]} and {tgt_tokens.shape[0]}"
                )
            picked, target_name = pick_targets(targets, labels)
            if picked is not None:
                check_targets(picked, tgt_tokens, vocab, target_name)
            check.check_bool("return_logits", return_logits)
            return src_tokens, tgt_tokens

        rank, lengths, _ = agree_on_inputs(
            group, ("src", "tgt"), inputs, has_targets=targets is not None or labels is not None,
            shared=lambda: config_fields(self.config), model=self._replica_check())
        targets = labels if targets is None else targets
        src_start = sum(lengths["src"][:rank])
        tgt_start = sum(lengths["tgt"][:rank])
        self._check_positions(max(sum(lengths["src"]), sum(lengths["tgt"])) - 1)
        device = src_tokens.device
        src_pos = torch.arange(src_start, src_start + src_tokens.shape[1], device=device)
        tgt_pos = torch.arange(tgt_start, tgt_start + tgt_tokens.shape[1], device=device)
        x = self.embed_at(src_tokens, src_pos)
        memory = self.encoder_norm(self._run(self.encoder, x,
                                             rotary=self.rotary_at(src_pos, x)))
        if comm.is_distributed(group):
            memory = gather_pieces(memory, group, lengths["src"])
        x = self.embed_at(tgt_tokens, tgt_pos)
        x = self._run(self.decoder, x, memory, rotary=self.rotary_at(tgt_pos, x))
        return self._head_and_loss(self.decoder_norm(x), targets, return_logits)
