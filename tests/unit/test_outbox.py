"""Outbox: responses are built and sent from one thread, in order, once the next step started
or their hold ran out; a failed build or send never stops the others."""

from __future__ import annotations

import threading
import time

from backends.triton_models.outbox import Outbox
from tests.unit.test_cancellation import wait_for


class Sender:
    """Stands in for a Triton response sender: records what was sent, when and from which thread."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.sent: list[tuple[object, int, str, float]] = []

    def send(self, response: object = None, flags: int = 0) -> None:
        if self.fail:
            raise RuntimeError("the client went away")
        self.sent.append((response, flags, threading.current_thread().name, time.monotonic()))


def built(value: str, log: list[str] | None = None):
    def build() -> str:
        if log is not None:
            log.append(threading.current_thread().name)
        return value

    return build


def test_responses_are_built_and_sent_on_the_sending_thread_in_order():
    outbox, sender, builds = Outbox(str, hold_s=0.0), Sender(), []
    for i in range(5):
        outbox.post(sender, built(f"r{i}", builds), flags=1 if i == 4 else 0)
    outbox.close()
    assert [(r, f) for r, f, _, _ in sender.sent] == [("r0", 0), ("r1", 0), ("r2", 0), ("r3", 0), ("r4", 1)]
    assert set(builds) == {"spec-send"} and {t for _, _, t, _ in sender.sent} == {"spec-send"}


def test_a_response_waits_for_the_next_step_to_start():
    outbox, sender = Outbox(str, hold_s=30.0), Sender()
    outbox.post(sender, built("r0"), flags=0)
    time.sleep(0.2)
    assert sender.sent == []  # the hold is long: only a started step lets it go
    outbox.step_started()
    assert wait_for(lambda: len(sender.sent) == 1)
    outbox.close()


def test_a_step_started_before_the_post_does_not_release_it():
    outbox, sender = Outbox(str, hold_s=30.0), Sender()
    outbox.step_started()
    outbox.post(sender, built("r0"), flags=0)
    time.sleep(0.2)
    assert sender.sent == []
    outbox.step_started()
    assert wait_for(lambda: len(sender.sent) == 1)
    outbox.close()


def test_without_a_next_step_a_response_goes_when_its_hold_runs_out():
    outbox, sender = Outbox(str, hold_s=0.05), Sender()
    posted = time.monotonic()
    outbox.post(sender, built("last"), flags=1)
    assert wait_for(lambda: len(sender.sent) == 1)
    assert sender.sent[0][3] - posted >= 0.05
    outbox.close()


def test_a_response_whose_hold_runs_out_during_a_draft_waits_for_the_next_step():
    outbox, sender = Outbox(str, hold_s=0.01), Sender()
    with outbox.holding():
        outbox.post(sender, built("r0"), flags=0)
        time.sleep(0.2)
        assert sender.sent == []  # its hold ran out while the head drafted
    assert wait_for(lambda: len(sender.sent) == 1)  # the draft ended: it goes (nothing else would start)
    with outbox.holding():
        outbox.post(sender, built("r1"), flags=0)
        outbox.step_started()  # a verification began: it goes, draft or not
        assert wait_for(lambda: len(sender.sent) == 2)
    outbox.close()


def test_a_backlog_waits_once_not_once_per_response():
    outbox, sender = Outbox(str, hold_s=1.0), Sender()
    for i in range(4):
        outbox.post(sender, built(f"r{i}"), flags=0)
    assert wait_for(lambda: len(sender.sent) == 4, timeout_s=10.0)
    times = [t for _, _, _, t in sender.sent]
    assert times[-1] - times[0] < 0.9  # each hold counts from its own post, all about the same moment
    outbox.close()


def test_a_failed_build_sends_the_error_response_with_the_same_flags():
    def broken() -> str:
        raise ValueError("no such tensor")

    outbox, sender = Outbox(lambda e: f"error: {e}", hold_s=0.0), Sender()
    outbox.post(sender, broken, flags=1)
    outbox.post(sender, built("next"), flags=0)
    outbox.close()
    assert [(r, f) for r, f, _, _ in sender.sent] == [("error: no such tensor", 1), ("next", 0)]


def test_a_sender_that_fails_does_not_stop_the_others():
    outbox, gone, sender = Outbox(str, hold_s=0.0), Sender(fail=True), Sender()
    outbox.post(gone, built("lost"), flags=1)
    outbox.post(sender, built("kept"), flags=1)
    outbox.close()
    assert [r for r, _, _, _ in sender.sent] == ["kept"]


def test_waiting_for_a_step_ends_when_one_starts_or_at_the_timeout():
    outbox = Outbox(lambda e: None)
    start = time.monotonic()
    outbox.wait_for_step(0.1)  # no step: the timeout
    assert time.monotonic() - start >= 0.1
    threading.Timer(0.2, outbox.step_started).start()
    start = time.monotonic()
    outbox.wait_for_step(30.0)
    assert time.monotonic() - start < 10
    outbox.close()
