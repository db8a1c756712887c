"""The OpenAI front end's /health readiness (client/api/openai_frontend.py, ReadinessWatch):
answered from a check made on a thread of its own, never older than `stale_s`."""

from __future__ import annotations

import threading
import time

from client.api import openai_frontend
from client.api.openai_frontend import Backend, ReadinessWatch
from tests.fixtures.servers import free_ports


def unreachable_backend() -> Backend:
    """A backend whose Triton is not there: never ready."""
    return Backend(f"127.0.0.1:{free_ports(1)[0]}", "m", tokenizer=None, context_window=512)


def test_the_first_probe_asks_then_the_watch_answers(monkeypatch):
    # The watch's first check held until the first call has returned: an unreachable Triton
    # answers at once, and the watch's thread could otherwise answer before the call reads it.
    ask, asked = openai_frontend._triton_ready, threading.Event()
    monkeypatch.setattr(openai_frontend, "_triton_ready", lambda backend: asked.wait() and ask(backend))
    watch = ReadinessWatch(unreachable_backend(), interval_s=0.05)
    assert watch.current() is None  # no answer yet: /health asks Triton itself
    asked.set()
    deadline = time.monotonic() + 10
    while watch.current() is None:
        assert time.monotonic() < deadline, "the watch never answered"
        time.sleep(0.05)
    assert watch.current() is False


def test_an_old_answer_is_not_used():
    watch = ReadinessWatch(unreachable_backend(), interval_s=3600, stale_s=0.5)
    watch.current()
    deadline = time.monotonic() + 10
    while watch.last is None:
        assert time.monotonic() < deadline, "the watch never answered"
        time.sleep(0.05)
    watch.last = (time.monotonic() - 1.0, True)  # a ready answer, older than stale_s
    assert watch.current() is None
    watch.last = (time.monotonic(), True)
    assert watch.current() is True
