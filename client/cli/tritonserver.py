"""`tritonspec tritonserver [--shutdown-grace-s S] -- tritonserver ARGS...`: a tritonserver
that stops gracefully, for containers (docker-compose.yml), where it is the process `docker
stop` signals and the launcher (launcher.py, which needs the nvidia-pytriton wheel) is absent.

At SIGTERM or SIGINT it does what the launcher's stop does: the models refuse new requests
and cut those still in flight when the grace period ends (backends/triton_models/admission.py),
then tritonserver stops (SIGINT); its exit code is this command's. Give tritonserver an
--exit-timeout-secs longer than the grace period, and the container a stop_grace_period
longer than both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path

from backends.triton_models.admission import DRAIN_ENV, start_drain


def run_draining(command: list[str], grace_s: float) -> int:
    """Run `command` (tritonserver and its arguments) until it exits; drain it at a signal."""
    with tempfile.TemporaryDirectory(prefix="tritonspec-control-") as control:
        drain = Path(control) / "drain"
        started: list[subprocess.Popen] = []

        def stop(signum: int, frame: object) -> None:
            if not drain.exists():
                start_drain(drain, grace_s)
            for process in started:
                process.send_signal(signal.SIGINT)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        started.append(subprocess.Popen(command, env={**os.environ, DRAIN_ENV: str(drain)}))
        if drain.exists():  # signalled while it started
            started[0].send_signal(signal.SIGINT)
        return started[0].wait()
