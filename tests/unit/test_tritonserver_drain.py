"""`tritonspec tritonserver -- CMD` (compose's triton service): at SIGTERM the models learn of the
shutdown (the drain file, with the grace period's end) before tritonserver gets its SIGINT, and
the command's exit code is tritonserver's. A stand-in process plays tritonserver."""

from __future__ import annotations

import signal
import subprocess
import sys

from backends.triton_models.admission import DRAIN_ENV

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


def test_sigterm_drains_then_stops_tritonserver_and_passes_its_exit_code():
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "client.cli.main", "tritonserver", "--shutdown-grace-s", "7", "--"]
        + [sys.executable, "-c", STAND_IN],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert wrapper.stdout.readline().strip() == "ready"
        wrapper.send_signal(signal.SIGTERM)
        left = wrapper.stdout.readline().split()
        assert wrapper.wait(timeout=30) == 3
    finally:
        wrapper.kill()
    assert left[0] == "left" and 6 < float(left[1]) <= 7
