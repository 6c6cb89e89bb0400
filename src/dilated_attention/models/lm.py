"""LongNetLM: the decoder-only LongNet language model.

Notation: b batch, n tokens (this rank's piece under sequence parallelism),
e embed dim, v vocabulary.

Sequence parallelism (``process_group=``): each rank passes its own
contiguous piece of every sequence (pieces may differ in length or be
empty). Embeddings, norms, feed-forwards, the head and the token losses work
on the local piece; only the dilated attention communicates (plus one tiny
agreement of piece lengths for the global positions and one all-reduce of
(loss sum, token count)). Parameters are replicated. The loss's value is
the global one; its gradient is scaled by the group size P so that each
rank's backward yields P times the gradient through its own tokens and an
AVERAGE over the sequence-parallel ranks is the full gradient: after
``backward`` call ``dilated_attention.all_reduce_gradients(model,
process_group)``, or wrap the model in DDP over the sequence-parallel (or
data x sequence) ranks, or FSDP2 over a mesh that includes them
(Note [gradients across ranks] in distributed/gradients.py). Two training forwards
(the first, and the first after an optimizer step) check, inside their
agreement, that the ranks hold the same parameters: models built from
different seeds, or a first step whose gradients were not reduced over the
sequence-parallel ranks, are an error on every rank, not a silent
divergence.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
import torch.types
from torch import Tensor

from .. import validation as check
from ..distributed import comm
from .base import LongNetBase
from .config import LongNetConfig
from .generation import generate
from .inputs import (agree_on_inputs, check_targets, check_tokens, config_fields,
                     document_starts, documents_of, pick_targets)
from .layers import magneto_gamma


class LongNetLM(LongNetBase):
    """Decoder-only LongNet language model.

    ``forward(tokens)`` with tokens (b, n) int ids returns ``(logits (b, n,
    v), None)``; ``forward(tokens, targets)`` returns ``(None, loss)``: the
    mean cross-entropy over every target that is not ``IGNORE_INDEX``
    (-100), over the whole sequence of all ranks (0, with zero gradients,
    when every target is ignored), computed over chunks of rows without
    ever holding the (b, n, v) logits (``return_logits=True`` computes and
    returns them too, at their memory cost). Targets are aligned with
    tokens (shift them yourself: targets[:, i] is the token after
    tokens[:, i]).

    With ``process_group`` set, tokens/targets are this rank's contiguous
    piece of each sequence, logits are this piece's, and the loss is the
    global one on every rank (its gradient P times this rank's share:
    average the gradients over the group, see the module docstring). Every
    rank must pass targets, or none.
    """

    def __init__(
        self, config: LongNetConfig, *, device: torch.types.Device = None,
        dtype: Optional[torch.dtype] = None, process_group: comm.GroupLike = None,
        strategy: str = "auto",
    ) -> None:
        super().__init__(config, device, dtype, process_group, strategy)
        _, gamma = magneto_gamma(config.num_layers)
        self.layers = self._blocks(config.num_layers, gamma=gamma, causal=True, cross=False)
        self.norm = self._norm()

    def forward(
        self, tokens: Tensor, targets: Optional[Tensor] = None, *, labels: Optional[Tensor] = None,
        cu_seqlens=None, position_ids: Optional[Tensor] = None, return_logits: bool = False,
    ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """tokens (b, n) -> (logits (b, n, v) or None, loss or None): logits without targets
        or with return_logits, the loss with targets.

        Packed documents: ``cu_seqlens`` (global boundaries [0, c1, ..., N],
        shared by the batch) or ``position_ids`` that restart at 0 where a
        document starts ((b, n) or (n,), this rank's rows of the global
        positions). Attention stays inside each document and positions
        restart at each document's start (with position_ids: they are the
        positions). ``labels`` is another name for ``targets``.
        """
        vocab = self.config.vocab_size

        def inputs() -> Tuple[Tensor, ...]:
            # every check inside the agreement: a mistake on one rank raises on all
            check_tokens("tokens", tokens, vocab)
            picked, target_name = pick_targets(targets, labels)
            if picked is not None:
                check_targets(picked, tokens, vocab, target_name)
            if cu_seqlens is not None and position_ids is not None:
                raise ValueError("pass cu_seqlens or position_ids (restarting at 0), not both")
            check.check_bool("return_logits", return_logits)
            return (tokens,)

        rank, lengths, infos = agree_on_inputs(
            self.process_group, ("tokens",), inputs,
            has_targets=targets is not None or labels is not None,
            facts=lambda: document_starts(position_ids, tokens, self.config.max_seq_len),
            fact_keys=("doc_starts", "max_position", "position_ids"),
            shared=lambda: {"cu_seqlens": check.check_cu_seqlens(cu_seqlens),
                            **config_fields(self.config)},
            model=self._replica_check(),
        )
        missing = [r for r, info in enumerate(infos) if not info["position_ids"]]
        if 0 < len(missing) < len(infos):  # agreed facts: every rank raises
            raise ValueError(f"position_ids must be passed on every rank of process_group or "
                             f"on none; rank(s) {missing} passed none")
        targets = labels if targets is None else targets
        pieces = lengths["tokens"]
        start, total = sum(pieces[:rank]), sum(pieces)
        documents = documents_of(infos, pieces, total)
        positions = self._positions_of(tokens, start, documents, position_ids, infos)
        x = self.embed_at(tokens, positions)
        x = self._run(self.layers, x, cu_seqlens=documents, rotary=self.rotary_at(positions, x))
        return self._head_and_loss(self.norm(x), targets, return_logits)

    def _positions_of(self, tokens: Tensor, start: int, documents: Optional[Tuple[int, ...]],
                      position_ids: Optional[Tensor], infos) -> Tensor:
        """(n,) this rank's positions: given, restarting per document, or global."""
        if position_ids is not None:
            maxima = [i["max_position"] for i in infos if i["max_position"] is not None]
            # not max(..., default=None): Dynamo cannot trace the keyword (a graph break)
            self._check_positions(max(maxima) if maxima else None)
            return (position_ids if position_ids.dim() == 1 else position_ids[0]).long()
        n = tokens.shape[1]
        rows = torch.arange(start, start + n, device=tokens.device)
        if documents is None:
            self._check_positions(sum(i["tokens_len"] for i in infos) - 1)
            return rows
        cu = torch.tensor(documents, device=tokens.device)
        # each row minus the start of its document
        doc_start = cu[torch.searchsorted(cu, rows, right=True) - 1]
        self._check_positions(max(e - s for s, e in zip(documents[:-1], documents[1:])) - 1)
        return rows - doc_start

    def generate(self, tokens: Tensor, max_new_tokens: int, *,
                 attention_mask: Optional[Tensor] = None, temperature: float = 0.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_token_id: Union[int, Sequence[int], None] = None,
                 pad_token_id: Optional[int] = None, use_cache: bool = True,
                 generator: Optional[torch.Generator] = None) -> Tensor:
        """Extend tokens (b, n) by up to max_new_tokens ids -> (b, n + steps).

        temperature 0 is greedy; > 0 samples from softmax(logits / T),
        restricted to the top_k logits when given, then to the nucleus of
        top_p when given (the fewest most probable ids whose probabilities
        sum to top_p or more); generator seeds it. eos_token_id (an id or a
        sequence of ids) ends a row: after it the row gets pad_token_id
        (default: the first eos id), and generation stops once every row has
        ended (steps < max_new_tokens then); each row's ids are those it
        generates alone.
        With use_cache (default) each new token runs one position through
        the layers against cached keys/values: the same computation as
        rerunning the whole sequence (use_cache=False) in another order, so
        equal to rounding; in bf16/fp16 greedy ids can differ where two
        logits lie within a rounding step (docs/generation.md).
        Dropout is off during generation.

        attention_mask (b, n), 1 for real tokens and 0 for padding on the
        left (as transformers pads a batch of prompts): each row generates
        exactly what it generates alone (its real tokens take the positions
        0, 1, ... and its segments start at its first real token); the
        padding stays in the returned ids.

        With ``process_group`` set, every rank passes the SAME whole tokens
        (and the same generator state when sampling); the prompt runs
        sequence-parallel, each rank keeps only its rows of the cache (about
        (n + max_new_tokens) / P of them) and every rank returns the ids one
        process returns (Note [sharded generation] in decoding.py). One
        agreement first checks that the ranks passed the same arguments and
        hold the same parameters: a mismatch is an error on every rank.
        """
        return generate(self, tokens, max_new_tokens, attention_mask=attention_mask,
                        temperature=temperature, top_k=top_k, top_p=top_p,
                        eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                        use_cache=use_cache, generator=generator)
