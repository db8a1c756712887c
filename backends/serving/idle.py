"""What a model's sequence idleness is measured on (the idle timeout frees the state of
sequences whose client vanished without END)."""

from __future__ import annotations

import time
from collections.abc import Callable


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
