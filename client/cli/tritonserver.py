"""`tritonspec tritonserver [--shutdown-grace-s S] -- tritonserver ARGS...`: a tritonserver
that stops gracefully, for containers (docker-compose.yml), where it is the process `docker
stop` signals and the launcher (launcher.py, which needs the nvidia-pytriton wheel) is absent;
and the graceful stop itself (`stop_gracefully`), which the launcher's stop runs too.

At SIGTERM or SIGINT it does what the launcher's stop does: the models refuse new requests
and cut those still in flight when the grace period ends (backends/triton_models/admission.py),
then tritonserver stops (SIGINT); its exit code is this command's. Where requests call a peer
over BLS, the SIGINT waits until they have ended (at most the grace period and DRAIN_MARGIN_S).
Give tritonserver an --exit-timeout-secs longer than the grace period, and the container a
stop_grace_period longer than the grace period, DRAIN_MARGIN_S and the models' unload (a few
seconds) together (docker-compose.yml: 30 s, 60 s).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from backends.triton_models.admission import DRAIN_ENV, requests_in_flight, start_drain
from backends.triton_models.topology import Placement

log = logging.getLogger("tritonspec.server")
# How long past the grace period's end a stop still waits for requests in flight: the models
# cut theirs at their next step after it, and the cut request then releases its peers' state.
DRAIN_MARGIN_S = 5.0
POLL_S = 0.05


def model_repositories(command: list[str]) -> list[Path]:
    """The model repositories a tritonserver command line serves (--model-repository, or its
    old name --model-store; each may be given several times)."""
    found = []
    for i, arg in enumerate(command):
        for flag in ("--model-repository", "--model-store"):
            if arg.startswith(flag + "="):
                found.append(Path(arg.split("=", 1)[1]))
            elif arg == flag and i + 1 < len(command):
                found.append(Path(command[i + 1]))
    return found


def drain_first(repositories: list[Path]) -> str:
    """Why a stop must let the requests in flight end before tritonserver stops, or "" where it
    need not: tritonserver's stop unloads every model at once, and a request's next BLS call to
    the verifier or drafter then fails; one that verifies and drafts in its own process is
    unharmed (the `speculative` model's unload waits for its requests)."""
    plans = [Placement.read(repository) for repository in repositories]
    if not any(plan.orchestrators for plan in plans):  # nothing to go by: waiting costs nothing here
        return f"no placement plan found in {', '.join(map(str, repositories)) or 'the command'}"
    called = {o: peers for plan in plans for o, peers in plan.called_over_bls().items()}
    return "; ".join(f"{o} calls {' and '.join(peers)} over BLS" for o, peers in called.items())


def wait_for_drain(drain: Path, deadline: float, running: Callable[[], bool]) -> bool:
    """Wait until no request is in flight in the server whose drain file is `drain`, until the
    grace period's `deadline` (time.time()) and DRAIN_MARGIN_S have passed, or until the server
    is not `running`; whether the requests ended."""
    while requests_in_flight(drain):
        if time.time() >= deadline + DRAIN_MARGIN_S or not running():
            return False
        time.sleep(POLL_S)
    return True


def stop_gracefully(process: subprocess.Popen, drain: Path, grace_s: float, repositories: list[Path]) -> None:
    """Stop tritonserver `process` (its $TRITONSPEC_DRAIN_FILE is `drain`, it serves
    `repositories`): the models refuse new requests at once and cut those in flight when
    `grace_s` has passed; where requests call a peer over BLS (`drain_first`), they end first;
    then SIGINT. A second stop while the first waits sends SIGINT at once."""
    if process.poll() is not None:
        return
    if drain.exists():
        process.send_signal(signal.SIGINT)
        return
    deadline = start_drain(drain, grace_s)
    reason = drain_first(repositories)
    if reason:
        log.info("letting the requests in flight end (up to %g s) before stopping tritonserver: %s", grace_s, reason)
        if not wait_for_drain(drain, deadline, lambda: process.poll() is None):
            log.warning("stopping tritonserver with requests still in flight")
    process.send_signal(signal.SIGINT)


def run_draining(command: list[str], grace_s: float) -> int:
    """Run `command` (tritonserver and its arguments) until it exits; drain it at a signal."""
    repositories = model_repositories(command)
    with tempfile.TemporaryDirectory(prefix="tritonspec-control-") as control:
        drain = Path(control) / "drain"
        started: list[subprocess.Popen] = []
        signalled: list[int] = []

        def begin_stop() -> None:
            # On a thread of its own: the wait for the drain must not hold up this one's wait().
            args = (started[0], drain, grace_s, repositories)
            threading.Thread(target=stop_gracefully, args=args, daemon=True).start()

        def stop(signum: int, frame: object) -> None:
            signalled.append(signum)
            if started:
                begin_stop()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        started.append(subprocess.Popen(command, env={**os.environ, DRAIN_ENV: str(drain)}))
        if signalled:  # signalled while it started
            begin_stop()
        return started[0].wait()
