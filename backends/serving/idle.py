"""What a model's sequence idleness is measured on (the idle timeout frees the state of
sequences whose client vanished without END)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any


class IdleClock:
    """Seconds a model instance has spent waiting for work. While a batch runs the clock
    stands still, so a request queued behind a long step (Triton's sequence batchers
    dispatch as soon as the instance is free) never makes its sequence look idle, however
    long it waited. Time spent in the other model (a slow drafter, for the verifier) does
    count: `sequence_idle_timeout_s` must stay above the longest single step."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self.now = now
        self.idle_s = 0.0
        self.idle_since: float | None = now()

    def __call__(self) -> float:
        return self.idle_s + (0.0 if self.idle_since is None else self.now() - self.idle_since)

    def busy(self) -> None:
        """A batch starts."""
        if self.idle_since is not None:
            self.idle_s += self.now() - self.idle_since
            self.idle_since = None

    def idle(self) -> None:
        """The batch is done."""
        self.idle_since = self.now()


def release_idle(
    sequences: Mapping[int, Any],
    now: float,
    idle_s: float,
    keep: Collection[int],
    release: Callable[[int], object],
    log: logging.Logger,
) -> list[int]:
    """Release the sequences (each with a `last_used` time on the same clock as `now`) idle for
    `idle_s` since their last step ended; `keep`: those with a step in hand, never idle."""
    stale = [sid for sid, seq in sequences.items() if sid not in keep and now - seq.last_used > idle_s]
    for sid in stale:
        release(sid)
    if stale:
        log.warning("released %d idle sequences: %s", len(stale), stale)
    return stale
