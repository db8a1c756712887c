"""Paged KV cache: one preallocated pool per model instance, shared by all its sequences.

Layout: one tensor ``[num_layers, num_slots, 2 (K, V), num_kv_heads, head_dim]``, cut along the
slot axis into blocks of ``block_size`` token slots. A sequence owns a block table (its blocks,
in order) and a length; token ``t`` of a sequence lives in slot
``table[t // block_size] * block_size + t % block_size``. Token-major because one step's new K|V
rows (adjacent in the fused QKV output) then go in with one ``index_copy_``, and gathering a
batch's keys is a row ``index_select`` (20 us per layer for 8 rows x 200 tokens of SmolLM2 vs 25
us head-major); SDPA reads the strided per-head view of a run of slots as fast as a contiguous one.

Admission is exact and up front: ``admit`` takes the blocks for the sequence's worst case
(prompt + max new tokens + draft slack, the caller's number) right away, so a running sequence can
never run out, and a sequence that cannot fit is refused before it starts. Taking them up front
(instead of lazily) costs no capacity, since the reservation is held either way, and lets the
allocator hand out ONE contiguous run of blocks (best fit) whenever one exists: the row's keys are
then a view of the pool and a batch-1 step attends without any gather. When free space is
fragmented the sequence gets scattered blocks and the forward gathers its keys (exact, a little
slower). Nothing is ever copied to persist: the pool is the only KV memory, allocated (and
touched: zeros) once, so resident memory does not grow with traffic.

Rollback after rejected drafts is ``truncate`` (shorten the length; the stale slots are simply
overwritten by the next step). ``release`` returns the blocks.

Block size: 16 by default (vLLM's). Blocks are taken as one run when possible and gathers index
token slots, not blocks, so the block size does not change step time (``scripts/bench_runtime.py
--block-size 16/32/64``: batch 8 x 1 token 27.8 / 27.6 / 28.1 ms, x 5 tokens 52.9 / 53.9 / 55.4
ms, fastest of 40 forwards each). It only sets the rounding of a reservation (under one block
wasted per sequence), and small blocks will suit prefix sharing best.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from dataclasses import dataclass

import torch


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


class KVCachePool:
    """Preallocated paged KV memory for one model instance.

    Size it by ``capacity_tokens`` or by ``memory_gb`` (converted with ``bytes_per_token``).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        capacity_tokens: int | None = None,
        memory_gb: float | None = None,
        block_size: int = 16,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
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
        self._free = list(range(self.num_blocks))  # sorted
        self._seqs: dict[Hashable, _Sequence] = {}

    # -- bookkeeping -------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def reserved_tokens(self) -> int:
        """Token slots held by admitted sequences (reservations rounded up to whole blocks)."""
        return (self.num_blocks - len(self._free)) * self.block_size

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.block_size

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def length(self, seq_id: Hashable) -> int:
        """Tokens cached for the sequence."""
        return self._get(seq_id).length

    def reserved(self, seq_id: Hashable) -> int:
        """Token slots the sequence holds (its reservation rounded up to whole blocks)."""
        return len(self._get(seq_id).blocks) * self.block_size

    def room(self, seq_id: Hashable) -> int:
        """Tokens the sequence can still append within its reservation."""
        seq = self._get(seq_id)
        return len(seq.blocks) * self.block_size - seq.length

    def admit(self, seq_id: Hashable, reserve_tokens: int) -> None:
        """Reserve room for ``reserve_tokens`` tokens of a new sequence, or raise KVCacheFullError."""
        if seq_id in self._seqs:
            raise SequenceError(f"sequence {seq_id!r} is already admitted")
        if reserve_tokens < 1:
            raise SequenceError(f"sequence {seq_id!r}: reserve_tokens must be >= 1, got {reserve_tokens}")
        need = -(-reserve_tokens // self.block_size)
        if need > len(self._free):
            raise KVCacheFullError(
                f"KV cache full: sequence {seq_id!r} asks for {reserve_tokens} tokens "
                f"({need} blocks of {self.block_size}) but {self.reserved_tokens} of "
                f"{self.capacity_tokens} token slots are held by {self.num_sequences} sequences "
                f"({self.free_tokens} free); lower max_tokens (or the prompt) or raise "
                f"kv_cache_memory_gb ({self.bytes_per_token} bytes per token)"
            )
        blocks = self._take(need)
        bs = self.block_size
        contiguous = blocks[-1] - blocks[0] == need - 1
        if contiguous:
            start = blocks[0] * bs
            slots = torch.arange(start, start + need * bs)
        else:
            start = None
            slots = (torch.tensor(blocks)[:, None] * bs + torch.arange(bs)).flatten()
        self._seqs[seq_id] = _Sequence(blocks, slots, start)

    def grow(self, seq_id: Hashable, reserve_tokens: int) -> None:
        """Extend a sequence's reservation to at least ``reserve_tokens`` (a drafter's cache,
        which cannot know its worst case at admission), or raise KVCacheFullError."""
        seq = self._get(seq_id)
        need = -(-reserve_tokens // self.block_size) - len(seq.blocks)
        if need <= 0:
            return
        if need > len(self._free):
            raise KVCacheFullError(
                f"KV cache full: sequence {seq_id!r} needs {need} more blocks of {self.block_size} "
                f"but {self.free_tokens} token slots are free"
            )
        blocks = self._take(need)
        bs = self.block_size
        new_slots = (torch.tensor(blocks)[:, None] * bs + torch.arange(bs)).flatten()
        follows = seq.start is not None and blocks[0] == seq.blocks[-1] + 1 and blocks[-1] - blocks[0] == need - 1
        seq.blocks += blocks
        seq.slots = torch.cat([seq.slots, new_slots])
        seq.start = seq.start if follows else None

    def truncate(self, seq_id: Hashable, new_length: int) -> None:
        """Roll the sequence back to its first ``new_length`` tokens (no copy)."""
        seq = self._get(seq_id)
        if not 0 <= new_length <= seq.length:
            raise SequenceError(f"sequence {seq_id!r}: cannot truncate length {seq.length} to {new_length}")
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
        """Return the sequence's blocks to the pool (unknown ids are ignored: release is idempotent)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            for b in seq.blocks:
                bisect.insort(self._free, b)

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

    def _take(self, need: int) -> list[int]:
        """Best fit: the smallest run of free blocks that holds ``need``; else the lowest free blocks."""
        free = self._free
        best_len, best_at = None, 0  # smallest fitting run: its length and index in ``free``
        i = 0
        while i < len(free):
            j = i
            while j + 1 < len(free) and free[j + 1] == free[j] + 1:
                j += 1
            run = j - i + 1
            if run >= need and (best_len is None or run < best_len):
                best_len, best_at = run, i
                if run == need:
                    break
            i = j + 1
        taken = free[best_at : best_at + need]
        del free[best_at : best_at + need]
        return taken
