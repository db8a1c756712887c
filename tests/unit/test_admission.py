"""The `speculative` model's admission (backends/triton_models/admission.py): a bounded queue,
the shutdown's drain file and grace period, and the watchdog's verdict, each refusal retryable
and worded for the client. Through a real server: tests/e2e/test_lifecycle_server.py."""

from __future__ import annotations

import time

import pytest

from backends.triton_models.admission import DRAIN_POLL_S, UNAVAILABLE, Admission, requests_in_flight, start_drain


def test_requests_beyond_the_workers_and_the_queue_are_refused_until_one_finishes():
    admission = Admission(workers=2, max_waiting=1)
    assert all(admission.admit() is None for _ in range(3))
    refusal = admission.admit()
    assert refusal.startswith(UNAVAILABLE)
    assert "at its limit of 2 requests running and 1 waiting" in refusal and "max_queued_requests" in refusal
    admission.finished()
    assert admission.admit() is None


def test_without_a_queue_only_the_workers_run():
    admission = Admission(workers=1, max_waiting=0)
    assert admission.admit() is None and admission.admit() is not None


def test_a_negative_queue_is_refused_by_name():
    with pytest.raises(ValueError, match="max_queued_requests must be at least 0, got -1"):
        Admission(workers=1, max_waiting=-1)


def test_the_drain_file_stops_admission_and_ends_the_grace_period(tmp_path):
    drain = tmp_path / "drain"
    admission = Admission(workers=1, max_waiting=8, drain=drain)
    assert admission.admit() is None and not admission.past_grace()
    drain.write_text("")  # caught half-written: not yet a shutdown
    assert admission.admit() is None
    drain.write_text(repr(time.time() + 0.2))
    refusal = admission.admit()
    assert refusal == f"{UNAVAILABLE}the server is shutting down and takes no new requests; retry later"
    assert not admission.past_grace()
    time.sleep(0.25)
    assert admission.past_grace()


def test_steps_look_for_the_drain_file_at_most_every_poll_interval(tmp_path, monkeypatch):
    drain = tmp_path / "drain"
    admission = Admission(workers=1, max_waiting=8, drain=drain)
    looked = []
    draining = admission.draining
    monkeypatch.setattr(admission, "draining", lambda: looked.append(1) or draining())
    assert not any(admission.past_grace() for _ in range(1000))
    assert len(looked) == 1  # a step a millisecond would have looked 1000 times
    drain.write_text(repr(time.time() - 1))  # a shutdown whose grace period is over
    time.sleep(DRAIN_POLL_S)
    assert admission.past_grace()


def test_a_hung_forward_leaves_the_server_refusing_everything():
    admission = Admission(workers=1, max_waiting=8)
    admission.fail("a verify step hung: verifier did not answer within 1 s (parameter step_timeout_s)")
    assert admission.admit() == (
        f"{UNAVAILABLE}the server is not ready: a verify step hung: verifier did not answer within 1 s "
        "(parameter step_timeout_s)"
    )


def test_the_openai_front_end_answers_a_refusal_with_503_and_retry_after():
    from client.api.openai_frontend import generation_error
    from client.api.triton import GenerationError

    admission = Admission(workers=2, max_waiting=0)
    admission.admit(), admission.admit()
    refusal = admission.admit()
    error = generation_error(GenerationError(refusal))
    response = error.response()
    assert (error.status, error.code, response.headers["Retry-After"]) == (503, "server_unavailable", "1")
    assert error.message.startswith("the server is at its limit of 2 requests running and 0 waiting")


def test_an_instance_with_requests_in_flight_leaves_a_marker_beside_the_drain_file(tmp_path):
    """The marker a stop waits for (client/cli/tritonserver.py): there from the first request
    admitted until the last one finishes, one per instance; a request refused for the drain
    leaves none."""
    drain = tmp_path / "drain"
    first, second = Admission(workers=2, max_waiting=0, drain=drain), Admission(workers=1, max_waiting=0, drain=drain)
    assert not requests_in_flight(drain)
    assert first.admit() is None and first.admit() is None and second.admit() is None
    assert len(list(tmp_path.glob("drain.in-flight.*"))) == 2
    first.finished()
    second.finished()
    assert requests_in_flight(drain)
    first.finished()
    assert not requests_in_flight(drain)
    start_drain(drain, 30)
    assert first.admit().startswith(UNAVAILABLE) and first.in_flight == 0
    assert not requests_in_flight(drain)
    assert Admission(workers=1, max_waiting=0).admit() is None  # no drain file: no marker
    assert list(tmp_path.iterdir()) == [drain]


def test_an_answered_request_frees_its_slot_and_keeps_its_marker_until_it_finishes(tmp_path):
    """`answered`: the last response is on its way, the next request is admitted while the
    worker still releases the sequence; the stop still waits for it (the marker) until `finished`."""
    drain = tmp_path / "drain"
    admission = Admission(workers=1, max_waiting=0, drain=drain)
    assert admission.admit() is None and admission.admit() is not None
    admission.answered()
    assert admission.admit() is None and requests_in_flight(drain)
    admission.finished(answered=True)
    assert requests_in_flight(drain) and admission.admit() is not None  # the second runs
    admission.finished()
    assert not requests_in_flight(drain) and admission.admit() is None
