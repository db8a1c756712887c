"""`tritonspec tritonserver -- CMD` (compose's triton service) and the graceful stop it shares
with the launcher (client/cli/tritonserver.py): at SIGTERM the models learn of the shutdown (the
drain file, with the grace period's end) before tritonserver gets its SIGINT, which waits for
the requests in flight where they call a peer over BLS; the command's exit code is
tritonserver's. A stand-in process plays tritonserver; through a real server:
tests/e2e/test_lifecycle_server.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from backends.triton_models.admission import DRAIN_ENV, Admission, requests_in_flight
from backends.triton_models.pbtxt import set_parameter
from client.cli.launcher import DEFAULT_REPOSITORY
from client.cli.tritonserver import DRAIN_MARGIN_S, model_repositories, wait_for_drain

STAND_IN = f"""
import os, signal, sys, time
def stop(signum, frame):
    deadline = float(open(os.environ["{DRAIN_ENV}"]).read())
    print(f"left {{deadline - time.time():.1f}}", flush=True)
    sys.exit(3)
signal.signal(signal.SIGINT, stop)
print("ready", flush=True)
time.sleep(60)
"""


def _sigterm(grace_s: float, stand_in: str, *args: str) -> tuple[str, int]:
    """Run `tritonspec tritonserver` over a stand-in's script, SIGTERM it once the stand-in is
    ready: the stand-in's next line and the command's exit code."""
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "client.cli.main", "tritonserver", "--shutdown-grace-s", str(grace_s), "--"]
        + [sys.executable, "-c", stand_in, *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert wrapper.stdout.readline().strip() == "ready"
        wrapper.send_signal(signal.SIGTERM)
        said = wrapper.stdout.readline().strip()
        return said, wrapper.wait(timeout=30)
    finally:
        wrapper.kill()


def test_sigterm_drains_then_stops_tritonserver_and_passes_its_exit_code():
    said, code = _sigterm(7, STAND_IN)
    left = said.split()
    assert code == 3
    assert left[0] == "left" and 6 < float(left[1]) <= 7


def test_the_wait_for_the_drain_ends_when_the_requests_end_at_the_deadline_or_with_the_server(tmp_path):
    """wait_for_drain, with a request in flight (its instance's marker): it waits until the grace
    period's end and DRAIN_MARGIN_S, or until the server is gone, or returns as soon as the
    request ends; with none in flight, at once."""
    drain = tmp_path / "drain"
    admission = Admission(workers=1, max_waiting=0, drain=drain)
    assert admission.admit() is None and requests_in_flight(drain)
    start = time.monotonic()
    assert not wait_for_drain(drain, time.time() + 0.5 - DRAIN_MARGIN_S, lambda: True)
    assert 0.45 < time.monotonic() - start < 5
    start = time.monotonic()
    assert not wait_for_drain(drain, time.time() + 60, lambda: False)
    assert time.monotonic() - start < 1
    threading.Timer(0.3, admission.finished).start()
    start = time.monotonic()
    assert wait_for_drain(drain, time.time() + 60, lambda: True)
    assert 0.25 < time.monotonic() - start < 5
    assert not requests_in_flight(drain) and wait_for_drain(drain, time.time() + 60, lambda: True)


# Plays tritonserver with one request in flight in a `speculative` instance (its admission and
# marker), which ends 1.5 s after the drain began; says at SIGINT whether it had ended.
IN_FLIGHT_STAND_IN = f"""
import os, signal, sys, time
from pathlib import Path
from backends.triton_models.admission import Admission
admission = Admission(workers=1, max_waiting=0, drain=Path(os.environ["{DRAIN_ENV}"]))
assert admission.admit() is None
def stop(signum, frame):
    print("in flight" if admission.in_flight else "ended", flush=True)
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
print("ready", flush=True)
while not admission.draining():
    time.sleep(0.01)
time.sleep(1.5)
admission.finished()
time.sleep(60)
"""


@pytest.mark.parametrize("verifier_in_process", ["auto", "false"])
def test_tritonserver_is_stopped_after_the_requests_only_where_they_call_peers_over_bls(tmp_path, verifier_in_process):
    """The shipped placement (everything in the `speculative` model's process): SIGINT at once,
    with the request in flight, as before (its unload waits for it). The verifier over BLS
    (verifier_in_process "false"): SIGINT once the request has ended."""
    repository = tmp_path / "repository"
    for name in ("speculative", "verifier", "drafter"):
        (repository / name).mkdir(parents=True)
        text = (DEFAULT_REPOSITORY / name / "config.pbtxt").read_text()
        if name == "speculative":
            text = set_parameter(text, "verifier_in_process", verifier_in_process)
        (repository / name / "config.pbtxt").write_text(text)
    said, code = _sigterm(30, IN_FLIGHT_STAND_IN, f"--model-repository={repository}")
    assert code == 0 and said == ("ended" if verifier_in_process == "false" else "in flight")


def test_the_repositories_of_a_tritonserver_command():
    command = ["tritonserver", "--model-repository=/a", "--model-store", "/b", "--log-verbose=1", "--model-repository"]
    assert model_repositories(command) == [Path("/a"), Path("/b")]
