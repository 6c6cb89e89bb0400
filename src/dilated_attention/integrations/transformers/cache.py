"""The key/value cache of sharded generation: a transformers ``Cache`` that keeps this rank's rows.

``generate`` (generation.py) hands ``model.generate`` a ``ShardedCache``.
Each layer keeps what Note [sharded generation] (decoding.py) assigns this
rank: the keys and values of its piece of the prompt, as the layer computed
them in the prefill, and its block of the new rows, allocated once after
the prefill. It reports the GLOBAL number of tokens seen
(``get_seq_length``, ``get_mask_sizes``), so that transformers builds the
positions and masks of the whole sequence, and it returns each update's own
keys and values: the prefill attends them sequence-parallel; a decoding
step's attention function reads this rank's rows from the cache instead
(``rows``, ``position``; backend.serving).

Importing this module imports transformers.

Notation: b batch, hk key/value heads, d head dim; transformers' layout
(b, hk, n, d), ours (b, n, hk, d) (a transposed view).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from ...decoding import CachedRows, CachePlan


class ShardedLayer(CacheLayerMixin):
    """One layer's rows on this rank: its prompt piece, then its block of new rows."""

    is_sliding = False

    def __init__(self, plan: CachePlan, prompt_len: int, whole_prompt: bool) -> None:
        super().__init__()
        self.plan = plan
        self.prompt_len = prompt_len
        self.whole_prompt = whole_prompt  # the prompt runs whole on every rank
        self.seen = 0  # tokens of the whole sequence seen so far, on every rank alike
        self.prompt: Optional[CachedRows] = None
        self.block: Optional[CachedRows] = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args,
               **kwargs) -> Tuple[Tensor, Tensor]:
        """Keep this rank's rows of (b, hk, m, d) keys and values; return them unchanged."""
        if self.seen == 0:
            self._keep_prompt(key_states, value_states)
        else:
            self._keep_new_row(key_states, value_states)
        return key_states, value_states

    def _keep_prompt(self, k: Tensor, v: Tensor) -> None:
        self.lazy_initialization(k, v)
        start, stop = self.plan.prompt
        if self.whole_prompt:
            k, v = (x[:, :, start:stop].clone() for x in (k, v))
        # (b, hk, m, d) -> (b, m, hk, d): views
        self.prompt = CachedRows(k.transpose(1, 2), v.transpose(1, 2), start, stop - start)
        self.block = self.plan.empty_block(k, v, heads_first=True)
        self.seen = self.prompt_len

    def _keep_new_row(self, k: Tensor, v: Tensor) -> None:
        if k.shape[2] != 1:
            raise NotImplementedError(f"sharded generation feeds one new token at a time, got "
                                      f"{k.shape[2]}")
        self.block = self.plan.store(self.block, self.seen, k[:, :, 0], v[:, :, 0])
        self.seen += 1

    def rows(self) -> List[CachedRows]:
        return [self.prompt, self.block]

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    # its name before transformers 5.13 (abstract there)
    get_max_cache_shape = get_max_length

    def _unsupported(self, what: str):
        raise NotImplementedError(f"sharded generation keeps each rank's rows in place: {what} "
                                  f"(beam search, assisted or contrastive decoding) is not "
                                  f"supported")

    def reorder_cache(self, beam_idx) -> None:
        self._unsupported("reordering the cache")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("cropping the cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("repeating the batch")

    def batch_select_indices(self, indices) -> None:
        self._unsupported("selecting batch rows")


class ShardedCache(Cache):
    """The cache of one sharded ``generate`` call (see the module docstring).

    group: the ranks generating; prefill_group: the group the prompt runs
    over (None when it runs whole on every rank); decoding: set by generate
    for each forward, True once the prompt has run.
    """

    def __init__(self, num_layers: int, plan: CachePlan, prompt_len: int, group: Any,
                 prefill_group: Any) -> None:
        whole = prefill_group is None
        super().__init__(layers=[ShardedLayer(plan, prompt_len, whole) for _ in range(num_layers)])
        self.plan = plan
        self.group = group
        self.prefill_group = prefill_group
        self.decoding = False

    def rows(self, layer: int) -> List[CachedRows]:
        """This rank's rows of `layer` (ours (b, n, hk, d) layout), the new token's included."""
        return self.layers[layer].rows()

    def position(self, layer: int) -> int:
        """The position of the token that `layer` stored last."""
        return self.layers[layer].seen - 1
