"""The engine: a causal LM with a KV cache per sequence, as the verifier (serving/target.py)
and the draft_model drafter (methods/draft_model.py) use it, whichever runtime runs it.

A sequence's life: ``admit`` (when ``admissible``) -> ``share_prefix`` (blocks of a prompt
another sequence computed) -> ``grow`` (room for the step's tokens) -> ``forward`` (its new tokens enter its cache; logits of the last
few, hidden states of the layers asked for) -> ``truncate`` (rejected drafts out) or
``compact`` (a draft tree's accepted path into place) -> ``commit`` (its cached tokens are
final: later sequences may share them) -> ... -> ``release``. vLLM splits the same way: a
model runner's forward over the slots its KV cache manager hands out and frees
(vllm/v1/core/kv_cache_manager.py: ``allocate_slots``, ``free``, ``get_computed_blocks``).

Two engines implement it:

- ``LeanEngine`` (here): the lean runtime (``lean_lm.LeanCausalLM``) over its paged KV pool
  (``kv_cache.KVCachePool``): any rows in one ragged forward, tree masks, prefix caching,
  batch invariance.
- ``HFEngine`` (``hf_engine.py``): a transformers model with a ``DynamicCache`` per sequence;
  the rows of a batch are padded to the longest; chains only.

What an engine can do is said by its attributes, so its callers keep one code path:
``ragged`` (a prompt may share a forward with one-token steps, and a step's time follows its
tokens), ``tree_attention`` (rows may carry a tree mask and positions), ``batch_invariant``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from .kv_cache import KVCachePool
from .lean_lm import LeanCausalLM, Row, StepOutput

__all__ = ["Engine", "LeanEngine", "Row", "StepOutput"]


class Engine(ABC):
    """A causal LM and its sequences' KV caches. Errors about one sequence (unknown, over its
    reservation, a budget that is full) are ``kv_cache.SequenceError`` / ``KVCacheFullError``."""

    name: str  # for logs and reports
    config: Any  # the model's transformers config
    device: torch.device
    vocab_size: int  # token ids the embedding has
    logits_size: int  # columns of the logits (may exceed vocab_size: a padded LM head)
    batch_invariant: bool  # a token's logits are the same bits whatever shares its step
    ragged: bool  # rows of any lengths share a forward at the cost of their own tokens
    tree_attention: bool  # rows may carry a mask and positions (Row.mask / Row.positions)
    capacity_tokens: int | None  # the KV budget in tokens; None: unbounded
    prefix_caching: bool
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens found there

    @property
    @abstractmethod
    def reserved_tokens(self) -> int:
        """Tokens held by admitted sequences' reservations."""

    @abstractmethod
    def admit(self, seq_id: Hashable, reserve_tokens: int = 0, cache_salt: str = "") -> None:
        """Start a sequence with room for ``reserve_tokens`` tokens (0: ``grow`` takes it as
        needed), or raise KVCacheFullError; it shares cached prefixes only within its ``cache_salt``."""

    @abstractmethod
    def admissible(self, num_tokens: int, token_ids: Sequence[int] = (), cache_salt: str = "") -> bool:
        """Whether a new sequence of ``num_tokens`` tokens, starting with ``token_ids``, fits now."""

    @abstractmethod
    def grow(self, seq_id: Hashable, reserve_tokens: int) -> None:
        """Extend a sequence's reservation to at least ``reserve_tokens`` (before a step writes
        them), or raise KVCacheFullError."""

    @abstractmethod
    def room(self, seq_id: Hashable) -> int:
        """Tokens the sequence can still take within its reservation."""

    @abstractmethod
    def length(self, seq_id: Hashable) -> int:
        """Tokens the sequence has in its cache."""

    @abstractmethod
    def final_tokens(self, seq_id: Hashable) -> int:
        """Leading tokens other sequences may share: ``truncate`` never goes below them."""

    @abstractmethod
    def share_prefix(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Attach what another sequence already computed for the sequence's next tokens
        (``token_ids`` from position 0); returns how many tokens its cache grew by."""

    @abstractmethod
    def forward(
        self, rows: Sequence[Row], logits_rows: int | Sequence[int] = 1, hidden_layers: Sequence[int] = ()
    ) -> StepOutput:
        """One step: each row's new tokens [n] enter its sequence's cache (its length grows by n).
        Returns per row, in order, the logits [m, logits_size] of its last m new tokens
        (``logits_rows``: one m for all rows or one per row; 0: none) and {layer id: [n, hidden]}
        over its n new tokens for ``hidden_layers`` (vLLM's numbering: id i is the residual
        stream entering layer i, -1 or num_layers the final normed state)."""

    @abstractmethod
    def truncate(self, seq_id: Hashable, length: int) -> None:
        """Roll the sequence's cache back to its first ``length`` tokens."""

    @abstractmethod
    def compact(self, seq_id: Hashable, positions: list[int], start: int) -> None:
        """Keep the cached tokens at ``positions`` (ascending) as positions ``start``, ``start
        + 1``, ...: a draft tree's accepted path behind the tokens before it."""

    @abstractmethod
    def commit(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """The sequence's cached tokens are final (``token_ids`` starts with them)."""

    @abstractmethod
    def release(self, seq_id: Hashable) -> None:
        """Drop the sequence and its cache (an unknown id is ignored)."""


class LeanEngine(Engine):
    """The lean runtime over its paged KV pool: a thin adapter, the pool keeps the books."""

    name = "lean runtime"
    ragged = True
    tree_attention = True

    def __init__(self, lm: LeanCausalLM, pool: KVCachePool) -> None:
        self.lm, self.pool = lm, pool
        self.config, self.device = lm.config, lm.device
        self.vocab_size, self.logits_size = lm.vocab_size, lm.lm_head.out_features
        self.batch_invariant = lm.batch_invariant
        self.capacity_tokens = pool.capacity_tokens
        self.prefix_caching = pool.prefix_caching

    @classmethod
    def with_pool(cls, lm: LeanCausalLM, **pool: Any) -> LeanEngine:
        """The model with a new pool (``LeanCausalLM.new_pool``'s arguments)."""
        return cls(lm, lm.new_pool(**pool))

    @property
    def reserved_tokens(self) -> int:
        return self.pool.reserved_tokens

    @property
    def prefix_queries(self) -> int:
        return self.pool.prefix_queries

    @property
    def prefix_hits(self) -> int:
        return self.pool.prefix_hits

    def admit(self, seq_id: Hashable, reserve_tokens: int = 0, cache_salt: str = "") -> None:
        self.pool.admit(seq_id, reserve_tokens, cache_salt)

    def admissible(self, num_tokens: int, token_ids: Sequence[int] = (), cache_salt: str = "") -> bool:
        return self.pool.admissible(num_tokens, token_ids, cache_salt)

    def grow(self, seq_id: Hashable, reserve_tokens: int) -> None:
        self.pool.grow(seq_id, reserve_tokens)

    def room(self, seq_id: Hashable) -> int:
        return self.pool.room(seq_id)

    def length(self, seq_id: Hashable) -> int:
        return self.pool.length(seq_id)

    def final_tokens(self, seq_id: Hashable) -> int:
        return self.pool.final_tokens(seq_id)

    def share_prefix(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        return self.pool.share_prefix(seq_id, token_ids)

    def forward(
        self, rows: Sequence[Row], logits_rows: int | Sequence[int] = 1, hidden_layers: Sequence[int] = ()
    ) -> StepOutput:
        return self.lm.forward(self.pool, rows, logits_rows, hidden_layers)

    def truncate(self, seq_id: Hashable, length: int) -> None:
        self.pool.truncate(seq_id, length)

    def compact(self, seq_id: Hashable, positions: list[int], start: int) -> None:
        self.pool.compact(seq_id, positions, start)

    def commit(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        self.pool.commit(seq_id, token_ids)

    def release(self, seq_id: Hashable) -> None:
        self.pool.release(seq_id)
