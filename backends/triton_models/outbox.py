"""The `speculative` model's responses, built and sent from one thread, in order.

A streamed step's response costs this process ~0.15 ms of Python to build (mostly
pb_utils.Tensor) and the server process ~1.5 ms of work to pass on. Sent at once, both land on
this 2-core machine just as the sequence's next step starts: measured on SmolLM2 (ngram, one
stream, in process), the verify thread then took 0.45 ms to get going after its step was handed
over, against 0.2 ms when the response waited for it. So a response waits until the next
forward pass has started (`step_started`) or `hold_s` has passed since it was posted, whichever
comes first; a backlog never waits again, and the order of responses is kept. While a head
drafts on the verify thread (`holding`), a response whose hold runs out waits on for the
verification after the draft, the longer forward of the two.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

log = logging.getLogger("tritonspec.speculative")


class Sender(Protocol):
    def send(self, response: object = None, flags: int = 0) -> None: ...


class Outbox:
    def __init__(self, on_build_error: Callable[[Exception], object], hold_s: float = 0.001) -> None:
        # on_build_error(e): the response sent in place of one whose build failed, so the
        # client still gets an answer (and its final one, when that was due).
        self.on_build_error = on_build_error
        self.hold_s = hold_s
        self.items: queue.Queue = queue.Queue()
        self.cond = threading.Condition()
        self.steps_started = 0
        self.drafting = 0  # head drafts running on the verify thread (holding)
        self.thread = threading.Thread(target=self._loop, name="spec-send", daemon=True)
        self.thread.start()

    def post(self, sender: Sender, build: Callable[[], object], flags: int) -> None:
        """Queue a response; `build()` makes it on the sending thread."""
        with self.cond:
            started = self.steps_started
        self.items.put((sender, build, flags, time.monotonic() + self.hold_s, started))

    def step_started(self) -> None:
        """A forward pass began: the responses posted before it may go."""
        with self.cond:
            self.steps_started += 1
            self.cond.notify_all()

    def wait_for_step(self, timeout_s: float) -> None:
        """Until the next forward pass begins, or `timeout_s`."""
        with self.cond:
            started = self.steps_started
            self.cond.wait_for(lambda: self.steps_started != started, timeout_s)

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Around a head's draft on the verify thread: responses due meanwhile wait for the
        verification that follows. Sent during the draft, their work (this process's Python,
        the server's encoding) took the same two cores: an EAGLE-3 tree's drafting went from
        4.3-4.4 to 5.2-6.0 ms a step."""
        with self.cond:
            self.drafting += 1
        try:
            yield
        finally:
            with self.cond:
                self.drafting -= 1
                self.cond.notify()

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, then stop."""
        self.items.put(None)
        self.thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        while (item := self.items.get()) is not None:
            sender, build, flags, deadline, started = item
            with self.cond:
                while self.steps_started == started and ((left := deadline - time.monotonic()) > 0 or self.drafting):
                    self.cond.wait(left if left > 0 else None)
            try:
                response = build()
            except Exception as e:
                log.exception("could not build a response")
                response = self.on_build_error(e)
            try:
                sender.send(response, flags=flags)
            except Exception:  # a client that went away must not stop the others' responses
                log.exception("could not send a response")
