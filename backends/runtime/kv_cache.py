"""Paged KV cache: one preallocated pool per model instance, shared by all its sequences.

Layout: one tensor ``[num_layers, num_slots, 2 (K, V), num_kv_heads, head_dim]``, cut along the
slot axis into blocks of ``block_size`` token slots. A sequence owns a block table (its blocks,
in order) and a length; token ``t`` of a sequence lives in slot
``table[t // block_size] * block_size + t % block_size``. Token-major because one step's new K|V
rows (adjacent in the fused QKV output) then go in with one ``index_copy_``, and gathering a
batch's keys is a row ``index_select`` (20 us per layer for 8 rows x 200 tokens of SmolLM2 vs 25
us head-major); SDPA reads the strided per-head view of a run of slots as fast as a contiguous one.

Blocks are taken as tokens are written: ``admit`` may reserve nothing, and ``grow`` takes the
blocks a step's new tokens need just before it runs (vLLM's ``KVCacheManager.allocate_slots``),
so a request holds what it has written, not its worst case (a chat without max_tokens used to
hold its whole context window from the start). Who runs when the pool is short (a queue for new
sequences, preemption of running ones) is the caller's business (serving/kv_scheduler.py); here
``grow`` raises KVCacheFullError and ``admissible`` says whether a new sequence fits now. A grown
sequence's next block is the one right after its last when that one is free, so a sequence that
grows alone stays one contiguous run: the row's keys are then a view of the pool and a batch-1
step attends without any gather. Blocks of sequences growing side by side interleave and the
forward gathers their keys (exact, a little slower). Nothing is ever copied to persist: the pool
is the only KV memory, allocated once. Its pages are left untouched until a step writes them
(zeroing 4 GB took 6-9 s on a 2-core VM), so resident memory grows with use up to the pool's
size, and no further: a soak's RSS climbs while new blocks (and cached prefixes) fill in, then
stays flat.

Rollback after rejected drafts is ``truncate`` (shorten the length; the stale slots are simply
overwritten by the next step). ``release`` returns the blocks.

Prefix caching (``prefix_caching=True``, the verifier's pool): every whole block of a sequence's
final tokens is registered under a key that names its tokens and everything before them (a SHA-256
chain, as vLLM's). A later sequence whose tokens start the same way attaches those blocks instead of
computing them again (``share_prefix``): the block is shared, counted by references, and never
written, since a sequence only writes past its own length and a shared block lies wholly below it.
Its own reserved block at that place goes back to the pool, so a shared prefix is held once. A
released block that holds a registered prefix stays cached until its room is needed: admission
counts it as free, and ``_take`` evicts the least recently released first. A new sequence looks
its prefix up before it takes any block (``admit`` reserves nothing, ``share_prefix`` holds the
cached blocks, then ``grow``), so its own cached prefix is never evicted to make room for it. On
the batch-invariant runtime a token's K/V has the same bits however its prompt was cut into
steps, so a reused prefix gives exactly the logits of a recomputed one.

Whose blocks may be shared: a key starts from a root that names the deployment's namespace and
the request's ``cache_salt`` (vLLM's: the salt goes into the first block's hash,
vllm/v1/core/kv_cache_utils.py ``generate_block_hash_extra_keys``), so sequences with different
salts or namespaces share nothing: a client cannot time another tenant's prompts.

Block size: 16 by default (vLLM's). Blocks are taken as one run when possible and gathers index
token slots, not blocks, so the block size does not change step time (``scripts/bench_runtime.py
--block-size 16/32/64``: batch 8 x 1 token 27.8 / 27.6 / 28.1 ms, x 5 tokens 52.9 / 53.9 / 55.4
ms, fastest of 40 forwards each). It only sets the rounding of a reservation (under one block
wasted per sequence), and small blocks will suit prefix sharing best.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

BLOCK_SIZE = 16  # token slots per block, unless a pool is given another


class SequenceError(ValueError):
    """A request about a sequence the pool cannot honour (unknown id, over its reservation, ...)."""


class KVCacheFullError(SequenceError):
    """A sequence's reservation does not fit in the pool's free blocks."""


@dataclass
class _Sequence:
    blocks: list[int]
    slots: torch.Tensor  # [len(blocks) * block_size] pool slot of each token position
    start: int | None  # first slot when the blocks are one contiguous run, else None
    length: int = 0
    keys: list[bytes] = field(default_factory=list)  # prefix key of each whole final block (prefix caching)
    root: bytes = b""  # what its first block's key starts from: the namespace and the request's cache_salt


def _slots(blocks: list[int], block_size: int) -> tuple[torch.Tensor, int | None]:
    """Every token slot of ``blocks`` in order, and the first slot when they are one run."""
    if not blocks:
        return torch.zeros(0, dtype=torch.long), None
    if all(b == blocks[0] + i for i, b in enumerate(blocks)):
        start = blocks[0] * block_size
        return torch.arange(start, start + len(blocks) * block_size), start
    return (torch.tensor(blocks)[:, None] * block_size + torch.arange(block_size)).flatten(), None


def _block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a block of ``token_ids`` after the prefix keyed ``parent``."""
    return hashlib.sha256(parent + b"".join(t.to_bytes(8, "little") for t in token_ids)).digest()


def _key_root(namespace: str, cache_salt: str) -> bytes:
    """The parent of a sequence's first block key: none without a namespace or salt (keys as
    before), else a digest of both, so blocks are shared only within the same pair."""
    if not namespace and not cache_salt:
        return b""
    return hashlib.sha256(b"tritonspec-prefix\0" + namespace.encode() + b"\0" + cache_salt.encode()).digest()


class _FreeBlocks:
    """The free block ids as maximal runs of consecutive ids, so that taking and returning
    blocks costs time in the number of runs, not of blocks (the tiny test model's 4 GB pool
    holds 524,288 blocks: walking them in Python cost ~100 ms an admission)."""

    def __init__(self, num_blocks: int) -> None:
        self._runs: dict[int, int] = {0: num_blocks}  # first block -> run length
        self._ends: dict[int, int] = {num_blocks: 0}  # one past the last block -> first block
        self._count = num_blocks

    def __len__(self) -> int:
        return self._count

    def add(self, block: int) -> None:
        """Return one block, merging it with the runs it touches."""
        first, end = block, block + 1
        if (before := self._ends.pop(block, None)) is not None:
            first = before
            del self._runs[before]
        if (after := self._runs.pop(end, None)) is not None:
            del self._ends[end + after]
            end += after
        self._runs[first], self._ends[end] = end - first, first
        self._count += 1

    def take(self, need: int) -> list[int]:
        """The first ``need`` blocks of the smallest run that holds them (the lowest such run);
        when none does, the lowest free blocks. The caller has made sure ``need`` are free."""
        fitting = [(length, first) for first, length in self._runs.items() if length >= need]
        if fitting:
            _, first = min(fitting)
            return self._cut(first, need)
        taken: list[int] = []
        for first in sorted(self._runs):
            taken += self._cut(first, min(need - len(taken), self._runs[first]))
            if len(taken) == need:
                break
        return taken

    def take_at(self, first: int, most: int) -> list[int]:
        """Up to ``most`` blocks from ``first`` on, when a free run starts there (else none)."""
        length = self._runs.get(first)
        return self._cut(first, min(most, length)) if length else []

    def _cut(self, first: int, n: int) -> list[int]:
        """Take the first ``n`` blocks of the run starting at ``first``."""
        length = self._runs.pop(first)
        end = first + length
        if n < length:
            self._runs[first + n] = length - n
            self._ends[end] = first + n
        else:
            del self._ends[end]
        self._count -= n
        return list(range(first, first + n))


class KVCachePool:
    """Preallocated paged KV memory for one model instance.

    Size it by ``capacity_tokens`` or by ``memory_gb`` (converted with ``bytes_per_token``).
    ``namespace``: mixed into every prefix key (a deployment's own, e.g. per tenant group), as a
    request's ``cache_salt`` is into its own.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        capacity_tokens: int | None = None,
        memory_gb: float | None = None,
        block_size: int = BLOCK_SIZE,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        prefix_caching: bool = False,
        namespace: str = "",
    ) -> None:
        if (capacity_tokens is None) == (memory_gb is None):
            raise ValueError("give exactly one of capacity_tokens and memory_gb")
        self.block_size = block_size
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
        if capacity_tokens is None:
            capacity_tokens = int(memory_gb * 2**30) // self.bytes_per_token
        self.num_blocks = capacity_tokens // block_size
        if self.num_blocks < 1:
            raise ValueError(f"a KV pool of {capacity_tokens} tokens holds no block of {block_size}")
        num_slots = self.num_blocks * block_size
        # Uninitialised: the forward reads only slots it wrote (padding repeats a written slot),
        # and untouched pages of a large pool then cost no memory until used.
        self.kv = torch.empty(num_layers, num_slots, 2, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.layers = list(self.kv.unbind(0))  # per layer [slots, 2, kv_heads, head_dim]
        self._free = _FreeBlocks(self.num_blocks)
        self._seqs: dict[Hashable, _Sequence] = {}
        self.prefix_caching = prefix_caching
        self.namespace = namespace
        self._refs = [0] * self.num_blocks  # sequences holding each block
        self._key_block: dict[bytes, int] = {}  # registered prefix -> the block holding it
        self._block_key: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, held by none: oldest first
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found (not computed again)

    # -- bookkeeping -------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def reserved_tokens(self) -> int:
        """Token slots held by admitted sequences (reservations rounded up to whole blocks)."""
        return self.capacity_tokens - self.free_tokens

    @property
    def free_tokens(self) -> int:
        """Token slots no sequence holds (cached prefixes among them: evicted when needed)."""
        return (len(self._free) + len(self._evictable)) * self.block_size

    @property
    def prefix_cached_tokens(self) -> int:
        """Token slots of registered prefixes that no sequence holds now."""
        return len(self._evictable) * self.block_size

    @property
    def usage(self) -> float:
        """The fraction of the pool's blocks that sequences hold (vLLM's kv_cache_usage_perc:
        cached prefixes nobody holds count as free)."""
        return self.reserved_tokens / self.capacity_tokens

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def length(self, seq_id: Hashable) -> int:
        """Tokens cached for the sequence."""
        return self._get(seq_id).length

    def final_tokens(self, seq_id: Hashable) -> int:
        """Leading tokens of the sequence in registered blocks (prefix caching): other sequences
        may share them, so ``truncate`` never goes below."""
        return len(self._get(seq_id).keys) * self.block_size

    def reserved(self, seq_id: Hashable) -> int:
        """Token slots the sequence holds (its reservation rounded up to whole blocks)."""
        return len(self._get(seq_id).blocks) * self.block_size

    def room(self, seq_id: Hashable) -> int:
        """Tokens the sequence can still append within its reservation."""
        seq = self._get(seq_id)
        return len(seq.blocks) * self.block_size - seq.length

    def admit(self, seq_id: Hashable, reserve_tokens: int = 0, cache_salt: str = "") -> None:
        """Start a sequence holding room for ``reserve_tokens`` tokens (0: none yet, ``grow``
        takes blocks as they are needed), or raise KVCacheFullError. ``cache_salt``: it shares
        prefix blocks only with sequences of the same salt."""
        if seq_id in self._seqs:
            raise SequenceError(f"sequence {seq_id!r} is already admitted")
        if reserve_tokens < 0:
            raise SequenceError(f"sequence {seq_id!r}: reserve_tokens must be >= 0, got {reserve_tokens}")
        need = -(-reserve_tokens // self.block_size)
        if need * self.block_size > self.free_tokens:
            raise KVCacheFullError(
                f"KV cache budget full: sequence {seq_id!r} asks for {reserve_tokens} tokens "
                f"({need} blocks of {self.block_size}) but {self.reserved_tokens} of "
                f"{self.capacity_tokens} token slots are held by {self.num_sequences} sequences "
                f"({self.free_tokens} free); retry later, lower max_tokens (or the prompt) or raise "
                f"kv_cache_memory_gb ({self.bytes_per_token} bytes per token)"
            )
        blocks = self._take(need)
        self._seqs[seq_id] = _Sequence(
            blocks, *_slots(blocks, self.block_size), root=_key_root(self.namespace, cache_salt)
        )

    def admissible(self, num_tokens: int, token_ids: Sequence[int] = (), cache_salt: str = "") -> bool:
        """Whether a new sequence of ``num_tokens`` tokens fits now, its first tokens being
        ``token_ids``: the cached blocks of their prefix that it would share are not counted
        as room (they are not evicted for it) nor as need."""
        need = -(-num_tokens // self.block_size)
        shared = self._cached_prefix(token_ids, _key_root(self.namespace, cache_salt))[:need]
        cached_free = sum(1 for block in shared if block in self._evictable)
        return need - len(shared) <= len(self._free) + len(self._evictable) - cached_free

    def grow(self, seq_id: Hashable, reserve_tokens: int) -> None:
        """Extend a sequence's reservation to at least ``reserve_tokens`` (before a step writes
        them), or raise KVCacheFullError. Its next blocks follow its last one where free."""
        seq = self._get(seq_id)
        need = -(-reserve_tokens // self.block_size) - len(seq.blocks)
        if need <= 0:
            return
        if need * self.block_size > self.free_tokens:
            raise KVCacheFullError(
                f"KV cache budget full: sequence {seq_id!r} needs {need} more blocks of {self.block_size} "
                f"but {self.free_tokens} token slots are free"
            )
        seq.blocks += self._take(need, after=seq.blocks[-1] if seq.blocks else None)
        seq.slots, seq.start = _slots(seq.blocks, self.block_size)

    def truncate(self, seq_id: Hashable, new_length: int) -> None:
        """Roll the sequence back to its first ``new_length`` tokens (no copy)."""
        seq, final = self._get(seq_id), self.final_tokens(seq_id)
        if not final <= new_length <= seq.length:
            raise SequenceError(
                f"sequence {seq_id!r}: cannot truncate length {seq.length} to {new_length}"
                + (f" (its first {final} tokens are final)" if final else "")
            )
        seq.length = new_length

    def compact(self, seq_id: Hashable, positions: list[int], start: int) -> None:
        """Keep the tokens at ``positions`` (ascending, each >= its new place) as positions
        ``start``, ``start + 1``, ... (the accepted path of a draft tree); the length becomes
        ``start + len(positions)``. Copies only the tokens that move."""
        seq = self._get(seq_id)
        if any(b <= a for a, b in zip(positions, positions[1:])) or (positions and positions[-1] >= seq.length):
            raise SequenceError(f"sequence {seq_id!r}: cannot keep positions {positions} of {seq.length}")
        if positions and positions[0] < start:
            raise SequenceError(f"sequence {seq_id!r}: positions {positions} start before {start}")
        moves = [(p, start + i) for i, p in enumerate(positions) if p != start + i]
        if moves:
            src, dst = zip(*moves)
            # Gathered before written: overlapping moves are exact.
            src, dst = seq.slots[list(src)].to(self.kv.device), seq.slots[list(dst)].to(self.kv.device)
            self.kv.index_copy_(1, dst, self.kv.index_select(1, src))
        seq.length = start + len(positions)

    def release(self, seq_id: Hashable) -> None:
        """Return the sequence's blocks to the pool (unknown ids are ignored: release is idempotent).
        A block holding a registered prefix stays cached for later sequences until its room is needed."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            for b in seq.blocks:
                self._drop(b)

    # -- prefix caching ----------------------------------------------------------------------

    def share_prefix(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Attach cached blocks for the sequence's next tokens: ``token_ids`` are its tokens
        from position 0, those past its length are about to be computed. Whole blocks found
        registered under the same prefix join the sequence (its length grows by them, their K/V
        is not computed again); returns the number of tokens attached. Only from a whole-block
        length whose blocks are all registered (``commit``), and never past ``token_ids``."""
        seq = self._get(seq_id)
        bs = self.block_size
        index = seq.length // bs
        if not self.prefix_caching or len(token_ids) <= seq.length or seq.length % bs or len(seq.keys) != index:
            return 0
        self.prefix_queries += len(token_ids) - seq.length
        attached = 0
        while (index + 1) * bs <= len(token_ids):
            key = self._next_key(seq, token_ids)
            shared = self._key_block.get(key)
            if shared is None:
                break
            if index == len(seq.blocks):  # past its reservation: the block joins it
                self._hold(shared)
                seq.blocks.append(shared)
            elif seq.blocks[index] != shared:  # its own block there goes back: the prefix is held once
                self._hold(shared)
                self._drop(seq.blocks[index])
                seq.blocks[index] = shared
            seq.keys.append(key)
            attached += bs
            index += 1
        if attached:
            seq.length += attached
            seq.slots, seq.start = _slots(seq.blocks, bs)
            self.prefix_hits += attached
        return attached

    def commit(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """The sequence's cached tokens are final (``token_ids`` starts with them): register
        its new whole blocks, so later sequences with the same prefix can share them."""
        seq = self._get(seq_id)
        if not self.prefix_caching:
            return
        bs = self.block_size
        for index in range(len(seq.keys), min(seq.length, len(token_ids)) // bs):
            key = self._next_key(seq, token_ids)
            seq.keys.append(key)
            if key not in self._key_block:  # else another block already holds it: this one stays private
                self._key_block[key] = seq.blocks[index]
                self._block_key[seq.blocks[index]] = key

    # -- for the forward ---------------------------------------------------------------------

    def slots(self, seq_id: Hashable) -> torch.Tensor:
        """Pool slot of every reserved token position of the sequence, ``[reserved]`` int64."""
        return self._get(seq_id).slots

    def contiguous_start(self, seq_id: Hashable) -> int | None:
        """First slot of the sequence when its blocks form one run (its keys are then a view)."""
        return self._get(seq_id).start

    def blocks(self, seq_id: Hashable) -> list[int]:
        return self._get(seq_id).blocks

    def extend(self, seq_id: Hashable, n: int) -> int:
        """Grow the sequence by ``n`` tokens about to be written; returns the old length."""
        seq = self._get(seq_id)
        old = seq.length
        if old + n > len(seq.blocks) * self.block_size:
            raise SequenceError(
                f"sequence {seq_id!r}: {old} cached + {n} new tokens exceed its reservation of "
                f"{len(seq.blocks) * self.block_size} tokens; admit it with a larger reserve_tokens"
            )
        seq.length = old + n
        return old

    # -- internals ---------------------------------------------------------------------------

    def _get(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise SequenceError(f"sequence {seq_id!r} is not in the KV cache (never admitted or released)") from None

    def _next_key(self, seq: _Sequence, token_ids: Sequence[int]) -> bytes:
        """The prefix key of the sequence's first block without one, holding those of ``token_ids``."""
        index, bs = len(seq.keys), self.block_size
        return _block_key(seq.keys[-1] if seq.keys else seq.root, token_ids[index * bs : (index + 1) * bs])

    def _cached_prefix(self, token_ids: Sequence[int], root: bytes) -> list[int]:
        """The registered blocks holding the whole blocks ``token_ids`` starts with, in order."""
        if not self.prefix_caching:
            return []
        blocks, key, bs = [], root, self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            key = _block_key(key, token_ids[start : start + bs])
            block = self._key_block.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _hold(self, block: int) -> None:
        self._refs[block] += 1
        self._evictable.pop(block, None)

    def _drop(self, block: int) -> None:
        """One holder less; a block nobody holds is free, or cached when it holds a prefix."""
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._block_key:
                self._evictable[block] = None
            else:
                self._free.add(block)

    def _take(self, need: int, after: int | None = None) -> list[int]:
        """The blocks right after block ``after`` where free; then best fit: the smallest run of
        free blocks that holds the rest, else the lowest free blocks. Cached prefixes are
        evicted, least recently released first, when free blocks alone are too few."""
        while len(self._free) < need:
            block, _ = self._evictable.popitem(last=False)
            del self._key_block[self._block_key.pop(block)]
            self._free.add(block)
        taken = [] if after is None else self._free.take_at(after + 1, need)
        if len(taken) < need:
            taken += self._free.take(need - len(taken))
        for block in taken:
            self._refs[block] = 1
        return taken
