"""The engine (engine.py) over a transformers causal LM: the models and devices the lean
runtime does not run (other architectures, GPUs with batch invariance off, torch's dynamic
int8 drafter).

Each sequence has its own ``DynamicCache``. A lone row runs on its own cache: no padding, no
copy. Several rows run as one padded batch: their caches are left-padded to the longest and
stacked, the new tokens right-padded, an attention mask hides both pads and explicit position
ids keep each sequence's own positions. The stacked cache is kept while the same rows go on
one token at a time (a drafter's k draft positions) and written back into each sequence's
cache when anything else touches one of them: copied in and out once per batch, not once a
step. Rollback is ``DynamicCache.crop``. No tree attention: a caller cuts trees to chains.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from .device import keep_attention_off_cudnn
from .engine import Engine, Row, StepOutput
from .kv_cache import KVCacheFullError, SequenceError


@dataclass
class _Sequence:
    cache: DynamicCache
    reserved: int  # tokens held against the budget until release


@dataclass
class _Stack:
    """Rows' caches stacked for padded forwards; written back by ``HFEngine._unstack``."""

    seq_ids: list[Hashable]
    cache: DynamicCache  # per layer [rows, kv_heads, start + width + steps, head_dim]
    start: int  # the longest cached length: where the first forward's new tokens begin
    lengths: list[int]  # each row's new tokens in the first forward (right-padded to width)
    width: int
    mask: torch.Tensor  # [rows, keys so far]: 0 at the pads
    positions: torch.Tensor  # [rows, tokens of the latest forward]
    last: torch.Tensor  # [rows, 1] index of each row's last real token in the latest forward
    steps: int = 0  # one-token forwards after the first


class HFEngine(Engine):
    name = "transformers"
    ragged = False  # a prompt in a batch would pad every row to its length
    tree_attention = False
    batch_invariant = False
    prefix_caching = False
    prefix_queries = prefix_hits = 0

    def __init__(self, model: torch.nn.Module, capacity_tokens: int | None = None) -> None:
        """`capacity_tokens`: the budget the sequences' reservations are admitted against."""
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.logits_size = model.get_output_embeddings().out_features
        self.capacity_tokens = capacity_tokens
        self._seqs: dict[Hashable, _Sequence] = {}
        self._stack: _Stack | None = None
        keep_attention_off_cudnn(self.device)

    @property
    def reserved_tokens(self) -> int:
        return sum(seq.reserved for seq in self._seqs.values())

    def cache(self, seq_id: Hashable) -> DynamicCache:
        """The sequence's own cache, with everything fed so far."""
        return self._get(seq_id).cache

    def _get(self, seq_id: Hashable) -> _Sequence:
        if self._stack is not None and seq_id in self._stack.seq_ids:
            self._unstack()
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise SequenceError(f"sequence {seq_id!r} is not in the KV cache (never admitted or released)") from None

    def admit(self, seq_id: Hashable, reserve_tokens: int = 0, cache_salt: str = "") -> None:
        if seq_id in self._seqs:
            raise SequenceError(f"sequence {seq_id!r} is already admitted")
        held = self.reserved_tokens
        if self.capacity_tokens is not None and held + reserve_tokens > self.capacity_tokens:
            raise KVCacheFullError(
                f"KV cache budget full: this request may need {reserve_tokens} tokens and running sequences "
                f"hold {held} of {self.capacity_tokens}; retry later, lower max_tokens, or raise kv_cache_memory_gb"
            )
        self._seqs[seq_id] = _Sequence(DynamicCache(config=self.config), reserve_tokens)

    def admissible(self, num_tokens: int, token_ids: Sequence[int] = (), cache_salt: str = "") -> bool:
        return self.capacity_tokens is None or self.reserved_tokens + num_tokens <= self.capacity_tokens

    def grow(self, seq_id: Hashable, reserve_tokens: int) -> None:
        seq = self._get(seq_id)
        extra = reserve_tokens - seq.reserved
        if extra > 0 and self.capacity_tokens is not None and self.reserved_tokens + extra > self.capacity_tokens:
            raise KVCacheFullError(
                f"KV cache budget full: sequence {seq_id!r} needs {extra} more tokens and "
                f"{self.reserved_tokens} of {self.capacity_tokens} are held"
            )
        seq.reserved = max(seq.reserved, reserve_tokens)

    def room(self, seq_id: Hashable) -> int:
        seq = self._get(seq_id)
        return seq.reserved - seq.cache.get_seq_length()

    def length(self, seq_id: Hashable) -> int:
        return self.cache(seq_id).get_seq_length()

    def final_tokens(self, seq_id: Hashable) -> int:
        self._get(seq_id)
        return 0  # no prefix caching: nothing is shared

    def share_prefix(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        self._get(seq_id)
        return 0

    def truncate(self, seq_id: Hashable, length: int) -> None:
        cache = self.cache(seq_id)
        current = cache.get_seq_length()
        if not 0 <= length <= current:
            raise SequenceError(f"sequence {seq_id!r}: cannot truncate length {current} to {length}")
        cache.crop(length - current)  # tokens to remove, as a negative count (0: none)

    def compact(self, seq_id: Hashable, positions: list[int], start: int) -> None:
        raise NotImplementedError("the transformers engine has no tree attention: verify a tree's first chain")

    def commit(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        self._get(seq_id)  # nothing to register: no prefix caching

    def release(self, seq_id: Hashable) -> None:
        if self._stack is not None and seq_id in self._stack.seq_ids:
            self._unstack()
        self._seqs.pop(seq_id, None)

    # -- the forward ---------------------------------------------------------------------------

    def forward(
        self, rows: Sequence[Row], logits_rows: int | Sequence[int] = 1, hidden_layers: Sequence[int] = ()
    ) -> StepOutput:
        counts = [logits_rows] * len(rows) if isinstance(logits_rows, int) else list(logits_rows)
        for row in rows:
            if row.mask is not None or row.positions is not None:
                raise SequenceError(f"sequence {row.seq_id!r}: the transformers engine has no tree attention")
        if len(rows) == 1:
            return self._forward_one(rows[0], counts[0], hidden_layers)
        return self._forward_batch(rows, counts, hidden_layers)

    def _forward_one(self, row: Row, m: int, layers: Sequence[int]) -> StepOutput:
        """A lone row on its own cache."""
        ids = torch.as_tensor(row.token_ids, device=self.device).view(1, -1)  # [1, n]
        out = self.model(
            input_ids=ids,
            cache=self.cache(row.seq_id),
            use_cache=True,
            logits_to_keep=max(m, 1),  # 0 would mean every position's
            output_hidden_states=bool(layers),
        )
        logits = out.logits[0]  # [max(m, 1), V]
        return StepOutput([logits[logits.shape[0] - m :]], [_hidden(out, 0, ids.shape[1], layers)])

    def _forward_batch(self, rows: Sequence[Row], counts: list[int], layers: Sequence[int]) -> StepOutput:
        """The rows as one padded batch, on the stacked cache of the step before when the same
        rows go on one token each, else on a new stack. A forward that fails leaves each
        sequence's cache where its last good step left it."""
        stack = self._stack
        going_on = stack is not None and stack.seq_ids == [row.seq_id for row in rows]
        if going_on and all(len(row.token_ids) == 1 for row in rows):
            ids, lengths = self._advance(stack, rows), [1] * len(rows)
        else:
            going_on = False
            self._unstack()
            stack, ids = self._stack_rows(rows)
            lengths = stack.lengths
        # each row's last M positions (clamped at its first), M the most logits a row asks for
        m = max(max(counts), 1)
        keep = (stack.last - torch.arange(m - 1, -1, -1, device=self.device)).clamp(min=0)  # [rows, M]
        self._stack = None
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=stack.mask,
                position_ids=stack.positions,
                cache=stack.cache,
                use_cache=True,
                logits_to_keep=keep,
                output_hidden_states=bool(layers),
            )
        except BaseException:
            if going_on:  # the steps before this one go back to their sequences, not its partial entries
                stack.steps -= 1
                self._stack = stack
                self._unstack()
            raise
        self._stack = stack
        logits = [out.logits[i, m - count :] for i, count in enumerate(counts)]  # each [count, V]
        return StepOutput(logits, [_hidden(out, i, n, layers) for i, n in enumerate(lengths)])

    def _advance(self, stack: _Stack, rows: Sequence[Row]) -> torch.Tensor:
        """The stack one token further for each row; the rows' tokens [rows, 1]."""
        stack.mask = F.pad(stack.mask, (0, 1), value=1)
        stack.positions = stack.positions.gather(1, stack.last) + 1
        stack.last = torch.zeros_like(stack.last)
        stack.steps += 1
        return torch.stack([torch.as_tensor(row.token_ids, device=self.device).view(-1) for row in rows])

    def _stack_rows(self, rows: Sequence[Row]) -> tuple[_Stack, torch.Tensor]:
        """A new stack for the rows, and their new tokens right-padded [rows, width]."""
        tokens = [_token_list(row.token_ids) for row in rows]
        caches = [self.cache(row.seq_id) for row in rows]
        cached = [cache.get_seq_length() for cache in caches]
        lengths = [len(t) for t in tokens]
        start, width = max(cached), max(lengths)
        dev = self.device
        stack = _Stack(
            seq_ids=[row.seq_id for row in rows],
            cache=stack_caches(caches, cached, self.config),
            start=start,
            lengths=lengths,
            width=width,
            mask=torch.tensor(
                [[0] * (start - c) + [1] * (c + n) + [0] * (width - n) for c, n in zip(cached, lengths)], device=dev
            ),
            positions=torch.tensor([list(range(c, c + width)) for c in cached], device=dev),
            last=torch.tensor([[n - 1] for n in lengths], device=dev),
        )
        ids = torch.tensor([t + [0] * (width - n) for t, n in zip(tokens, lengths)], device=dev)
        return stack, ids

    def _unstack(self) -> None:
        """Append what the stacked forwards fed to each row's own cache."""
        stack, self._stack = self._stack, None
        if stack is not None:
            caches = [self._seqs[seq_id].cache for seq_id in stack.seq_ids]
            fed = [stack.steps] * len(caches)
            append_new_entries(stack.cache, caches, stack.start, stack.lengths, stack.width, fed)


def _token_list(token_ids: torch.Tensor | Sequence[int]) -> list[int]:
    return token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)


def _hidden(out: Any, row: int, n: int, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """{layer id: [n, hidden]} of a row's n new tokens. Layer id i = the residual stream entering
    decoder layer i (vLLM's and EAGLE-3's numbering: transformers' hidden_states[i]); id
    num_layers or -1 = the final hidden state after the final norm (what EAGLE-1, Medusa and MTP read)."""
    return {i: out.hidden_states[i][row, :n] for i in layers}


def select_hidden(hidden_states: tuple, row: int, kept: int, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """[kept, layers, hidden] float32 on the CPU of transformers' ``hidden_states`` for one row
    (vLLM's numbering, as ``_hidden``): what the verifier returns, for callers of the model itself."""
    layers = [hidden_states[i][row, :kept] for i in layer_ids]
    return torch.stack(layers, dim=1).float().cpu()


def stack_caches(caches: list[DynamicCache], lengths: list[int], config: Any) -> DynamicCache:
    """One batched cache from per-sequence caches of `lengths`, each left-padded to the longest."""
    batched = DynamicCache(config=config)
    longest = max(lengths)
    if longest == 0:
        return batched
    shaped = next(c for c, n in zip(caches, lengths) if n)  # gives an empty cache its shape
    for layer_idx, template in enumerate(shaped.layers):
        keys, values = [], []
        for cache, n in zip(caches, lengths):
            own = cache.layers[layer_idx] if n else template
            keys.append(F.pad(own.keys[:1, :, :n], (0, 0, longest - n, 0)))
            values.append(F.pad(own.values[:1, :, :n], (0, 0, longest - n, 0)))
        batched.update(torch.cat(keys), torch.cat(values), layer_idx)
    return batched


def append_new_entries(
    batched: DynamicCache, caches: list[DynamicCache], start: int, lengths: list[int], gap: int, fed: list[int]
) -> None:
    """The inverse of `stack_caches` for the new entries: row i's `lengths[i]` new tokens (at
    `start`) and its `fed[i]` tokens fed one at a time after them (at `start + gap`) onto caches[i]."""
    for row, own in enumerate(caches):
        device = batched.layers[0].keys.device
        keep = torch.cat(
            [
                torch.arange(start, start + lengths[row], device=device),
                torch.arange(start + gap, start + gap + fed[row], device=device),
            ]
        )
        for layer_idx, layer in enumerate(batched.layers):
            own.update(layer.keys[row : row + 1, :, keep], layer.values[row : row + 1, :, keep], layer_idx)
