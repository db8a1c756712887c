"""Which of the target's sequences hold KV blocks now: admission in arrival order and
preemption when the pool runs short, as vLLM's scheduler does it
(vllm/v1/core/sched/scheduler.py at v0.10.0, ``Scheduler.schedule``), in the shape of this
server, where each request's thread brings its sequence's steps one at a time.

- A sequence holds the blocks it has written: before each step the engine grows it by that
  step's tokens (its pending tokens and drafts; rejected drafts' slots are simply reused).
- Running sequences' steps go first, oldest admitted first. When the pool is short, the newest
  admitted running sequence is preempted: its blocks go back to the pool and it waits at the
  head of the queue; once admitted again, its next step recomputes its tokens (prompt and output
  so far) into fresh blocks (vLLM's recompute preemption; with prefix caching most of them are
  found cached). On the batch-invariant runtime the recomputed keys and values are the same bits,
  so the output is exactly what it would have been.
- New sequences wait in arrival order and are admitted while they fit; none overtakes the head
  of the queue (unless its client stopped asking: serving/target.py's ABSENT_HEAD_S), and a
  running sequence is never preempted to admit a waiting one.

A step that cannot run now is answered ``waiting`` (serving/target.py) with nothing changed; the
orchestrator sends it again shortly, for at most its queue timeout (serving/orchestrator.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from backends.runtime.engine import Engine
from backends.runtime.kv_cache import KVCacheFullError


@dataclass(frozen=True)
class KVStats:
    """The target's KV pool and queue, as vLLM reports them (the operator's metrics read these)."""

    kv_usage: float  # fraction of the pool held by running sequences (vLLM's kv_cache_usage_perc); 0: unbounded
    num_running: int  # sequences holding KV blocks (vLLM's num_requests_running)
    num_waiting: int  # new and preempted sequences waiting for room (vLLM's num_requests_waiting)
    num_preemptions: int  # since start (vLLM's num_preemptions_total)


class Scheduler:
    """The running sequences (admission order) and the waiting ones (FIFO) of one engine.
    `preempted(seq_id)` is told when a sequence loses its blocks: its cache starts over."""

    def __init__(self, engine: Engine, preempted: Callable[[int], None]) -> None:
        self.engine = engine
        self.preempted = preempted
        self.running: OrderedDict[int, None] = OrderedDict()  # oldest admitted first
        self.waiting: OrderedDict[int, None] = OrderedDict()  # arrival order; preempted ones at the head
        self.num_preemptions = 0

    def enqueue(self, seq_id: int) -> None:
        """A new sequence waits for room for its first step."""
        self.waiting[seq_id] = None

    def is_running(self, seq_id: int) -> bool:
        return seq_id in self.running

    def forget(self, seq_id: int) -> None:
        """The sequence ended (the caller releases its blocks)."""
        self.running.pop(seq_id, None)
        self.waiting.pop(seq_id, None)

    def admit(
        self, seq_id: int, num_tokens: int, token_ids: Sequence[int], cache_salt: str, absent: Collection[int] = ()
    ) -> bool:
        """Admit a waiting sequence whose step needs `num_tokens` in its cache (its first
        `token_ids` may be found cached) when it heads the queue (`absent`: those ahead of it
        whose clients stopped asking, passed over) and fits; the engine then holds it with no
        blocks yet. KVCacheFullError when it can never fit."""
        if next((s for s in self.waiting if s not in absent), None) != seq_id:
            return False
        self._check_fits(seq_id, num_tokens)
        if not self.engine.admissible(num_tokens, token_ids, cache_salt):
            return False
        self.engine.admit(seq_id, 0, cache_salt)
        del self.waiting[seq_id]
        self.running[seq_id] = None
        return True

    def make_room(self, seq_id: int, num_tokens: int) -> bool:
        """Grow a running sequence's blocks to hold `num_tokens`, preempting the newest running
        sequences while the pool is short; False when that was this one (it waits now)."""
        self._check_fits(seq_id, num_tokens)
        while True:
            try:
                self.engine.grow(seq_id, num_tokens)
                return True
            except KVCacheFullError:
                victim = next(reversed(self.running))
                self.preempt(victim)
                if victim == seq_id:
                    return False

    def preempt(self, seq_id: int) -> None:
        """Free a running sequence's blocks; it waits at the head of the queue."""
        self.engine.release(seq_id)
        del self.running[seq_id]
        self.waiting[seq_id] = None
        self.waiting.move_to_end(seq_id, last=False)
        self.num_preemptions += 1
        self.preempted(seq_id)

    def stats(self) -> KVStats:
        capacity = self.engine.capacity_tokens
        usage = self.engine.reserved_tokens / capacity if capacity else 0.0
        return KVStats(usage, len(self.running), len(self.waiting), self.num_preemptions)

    def _check_fits(self, seq_id: int, num_tokens: int) -> None:
        capacity = self.engine.capacity_tokens
        if capacity is not None and num_tokens > capacity:
            raise KVCacheFullError(
                f"sequence {seq_id}: its next step needs {num_tokens} tokens in the KV cache, more than "
                f"the whole pool holds ({capacity}); raise kv_cache_memory_gb or lower max_model_len"
            )
