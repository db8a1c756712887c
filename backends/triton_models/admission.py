"""Whether the `speculative` model takes a new request, and when one in flight must end.

A request is refused at once, as retryable (Triton's UNAVAILABLE over gRPC; Triton's HTTP
/generate answers every error a model sends with 400; the message starts with `unavailable:`,
which the OpenAI front end answers with 503 and Retry-After), when

- `max_queued_requests` requests already wait for one of the `max_concurrent_requests` worker
  threads (the queue used to grow without bound);
- the server is shutting down: the stop (client/cli/tritonserver.py, `stop_gracefully`) writes
  the deadline of its grace period to the file named by $TRITONSPEC_DRAIN_FILE; requests in
  flight go on until that deadline and are then cut with an error (`past_grace`);
- a forward hung past its timeout (the watchdog, `fail`): the server is not ready for more.

While an instance has requests in flight, a marker file beside the drain file says so
(`requests_in_flight`): where those requests call the verifier or drafter over BLS, the stop
waits for the markers to go before tritonserver unloads those models under them.

A request's slot is free once its last response is on its way (`answered`), before its worker
releases its sequence in the peers: a client that sends its next request as soon as it has the
last answer is never refused for the one it just finished. Its marker stays until `finished`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("tritonspec.speculative")
DRAIN_ENV = "TRITONSPEC_DRAIN_FILE"
UNAVAILABLE = "unavailable: "  # how a retryable refusal's message starts
IN_FLIGHT = ".in-flight."  # an instance's marker: the drain file's name, this, its process and id
# How often a request's steps look for the drain file (`past_grace`): every step of every
# stream did, an open() and a FileNotFoundError each, ~2% of the GIL's time at 32 streams.
DRAIN_POLL_S = 0.1


def drain_file() -> Path | None:
    path = os.environ.get(DRAIN_ENV, "")
    return Path(path) if path else None


def start_drain(path: Path, grace_s: float) -> float:
    """Tell the models of the server whose $TRITONSPEC_DRAIN_FILE is `path` that it is shutting
    down, with `grace_s` left for the requests in flight; the deadline (time.time())."""
    deadline = time.time() + grace_s
    written = path.with_suffix(".tmp")
    written.write_text(repr(deadline))
    written.replace(path)  # atomic: a model never reads half a deadline
    return deadline


def requests_in_flight(drain: Path) -> bool:
    """Whether some instance of a server whose drain file is `drain` has requests in flight."""
    try:
        return any(p.name.startswith(drain.name + IN_FLIGHT) for p in drain.parent.iterdir())
    except OSError:  # the control directory is gone: so is the server
        return False


class Admission:
    def __init__(self, workers: int, max_waiting: int, drain: Path | None = None) -> None:
        if max_waiting < 0:
            raise ValueError(f"parameter max_queued_requests must be at least 0, got {max_waiting}")
        self.workers, self.max_waiting = workers, max_waiting
        self.drain = drain
        self.in_flight = 0  # admitted and not answered: running on a worker, or waiting for one
        self.busy = 0  # admitted and not finished: the marker is there while this is > 0
        self.deadline: float | None = None  # the end of the shutdown grace period (time.time())
        self.broken = ""  # why the server is not ready (the watchdog)
        self.next_drain_poll = 0.0  # time.monotonic() from which `past_grace` looks again
        self.lock = threading.Lock()
        # There while in_flight > 0 (requests_in_flight); None without a drain file.
        self.marker = drain.with_name(f"{drain.name}{IN_FLIGHT}{os.getpid()}.{id(self):x}") if drain else None

    def admit(self) -> str | None:
        """None, and the request counts until `finished`, or why it is refused."""
        if self.broken:
            return f"{UNAVAILABLE}the server is not ready: {self.broken}"
        with self.lock:
            if self.in_flight >= self.workers + self.max_waiting:
                return (
                    f"{UNAVAILABLE}the server is at its limit of {self.workers} requests running and "
                    f"{self.max_waiting} waiting (parameters max_concurrent_requests, max_queued_requests); "
                    "retry later"
                )
            self.in_flight += 1
            self.busy += 1
            if self.busy == 1:
                self._mark(True)
        # Asked once counted and marked: a stop writes the drain file, then looks for markers, so
        # either this request sees the drain, or the stop sees its marker and waits for it.
        if self.draining():
            self.finished()
            return f"{UNAVAILABLE}the server is shutting down and takes no new requests; retry later"
        return None

    def answered(self) -> None:
        """An admitted request's last response is on its way: its slot takes the next request."""
        with self.lock:
            self.in_flight -= 1

    def finished(self, answered: bool = False) -> None:
        """An admitted request's work is over (`answered`: its slot was freed already)."""
        with self.lock:
            if not answered:
                self.in_flight -= 1
            self.busy -= 1
            if self.busy == 0:
                self._mark(False)

    def close(self) -> None:
        """The instance unloads: its requests are over, whatever the count says."""
        self._mark(False)

    def _mark(self, busy: bool) -> None:
        if self.marker is None:
            return
        try:
            if busy:
                self.marker.touch()
            else:
                self.marker.unlink(missing_ok=True)
        except OSError as e:  # a stop then waits for nothing (busy) or for its deadline (idle)
            log.warning("could not %s %s: %s", "write" if busy else "remove", self.marker, e)

    def draining(self) -> bool:
        """Whether the launcher has started a shutdown (a stat of the drain file until it has)."""
        if self.deadline is None and self.drain is not None:
            try:
                self.deadline = float(self.drain.read_text())
                log.info("shutting down: new requests are refused, those in flight end by %.0f", self.deadline)
            except (OSError, ValueError):  # not there (yet), or caught half-written
                return False
        return self.deadline is not None

    def past_grace(self) -> bool:
        """Whether a request still in flight must end now: the shutdown's grace period is over.
        Asked at every step: before a shutdown has begun, the drain file is looked for at most
        every DRAIN_POLL_S (`admit` always looks)."""
        if self.deadline is None:
            now = time.monotonic()
            if now < self.next_drain_poll:
                return False
            self.next_drain_poll = now + DRAIN_POLL_S
        return self.draining() and time.time() >= self.deadline

    def fail(self, reason: str) -> None:
        """The server can no longer serve (a forward hung): refuse every new request."""
        if not self.broken:
            log.error("not ready from now on: %s", reason)
        self.broken = reason
