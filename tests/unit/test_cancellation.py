"""CancellationWatch: cancellation is polled in its own thread, never after forget()."""

from __future__ import annotations

import threading
import time

from backends.serving.cancellation import CancellationWatch


class Sender:
    """Stands in for a Triton response sender: is_cancelled() takes `delay_s`, like the round
    trip to the server process, and records which thread asked and when."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.cancelled = False
        self.calls: list[tuple[str, float, float]] = []  # (thread, start, end)

    def is_cancelled(self) -> bool:
        start = time.monotonic()
        time.sleep(self.delay_s)
        self.calls.append((threading.current_thread().name, start, time.monotonic()))
        return self.cancelled


def wait_for(condition, timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return False


def test_a_cancelled_client_is_seen_without_asking_from_the_request_thread():
    watch = CancellationWatch(interval_s=0.01)
    sender, other = Sender(), Sender()
    is_cancelled, other_cancelled = watch.watch(sender), watch.watch(other)
    assert wait_for(lambda: len(sender.calls) >= 2)
    assert not is_cancelled()
    sender.cancelled = True
    assert wait_for(is_cancelled)
    assert not other_cancelled()
    assert {thread for thread, _, _ in sender.calls} == {"spec-cancel-watch"}
    calls = len(sender.calls)
    time.sleep(0.05)
    assert len(sender.calls) == calls  # once cancelled, it stays so without more round trips
    assert is_cancelled()


def test_forget_waits_for_a_poll_in_progress_and_none_starts_after_it():
    watch = CancellationWatch(interval_s=0.001)
    sender = Sender(delay_s=0.05)
    watch.watch(sender)
    assert wait_for(lambda: sender.calls)  # a poll has run
    time.sleep(0.02)  # most likely inside the next one
    watch.forget(sender)
    forgotten_at = time.monotonic()
    time.sleep(0.15)
    assert all(end <= forgotten_at for _, _, end in sender.calls), "a poll ran after forget() returned"


def test_a_sender_that_fails_is_taken_as_not_cancelled():
    class Closed(Sender):
        def is_cancelled(self) -> bool:
            super().is_cancelled()
            raise RuntimeError("response factory already released")

    watch = CancellationWatch(interval_s=0.005)
    closed, live = Closed(), Sender()
    closed_cancelled, live_cancelled = watch.watch(closed), watch.watch(live)
    live.cancelled = True
    assert wait_for(live_cancelled)  # the failing sender did not stop the thread
    assert len(closed.calls) >= 1 and not closed_cancelled()
