"""`tritonspec serve` in the foreground, as a user runs it: ready banner, Ctrl-C, clean exit."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from client.api.triton import grpc_generate
from client.cli.launcher import pids_with_cmdline
from tests.fixtures import ROOT
from tests.fixtures.servers import free_ports


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "client.cli.main", "serve", *args]


def test_serve_prints_endpoints_and_stops_cleanly_on_ctrl_c(tiny_model_dir, tmp_path):
    http, grpc, metrics = free_ports(3)
    cli = serve_command(
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--http-port",
        str(http),
        "--grpc-port",
        str(grpc),
        "--metrics-port",
        str(metrics),
    )
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cli, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 180
        while "Ctrl-C stops the server" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "serve never became ready"
            time.sleep(0.5)
        banner = (tmp_path / "serve.log").read_text()
        assert f"http://127.0.0.1:{http}" in banner and f"127.0.0.1:{grpc}" in banner and "curl" in banner
        assert grpc_generate(f"127.0.0.1:{grpc}", "The quick", max_tokens=4).num_output_tokens == 4
        prefix = f"tritonspec_{proc.pid}_{http}_"
        assert pids_with_cmdline(prefix)
        proc.send_signal(signal.SIGTERM)  # what process managers send; Ctrl-C takes the same path
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not pids_with_cmdline(prefix)
    assert not list(Path("/dev/shm").glob(f"{prefix}*"))


def test_serve_refuses_bad_arguments_before_starting(tiny_model_dir):
    for args, message in (
        (["--model", "/no/such/model"], "neither a local directory"),
        (["--model", str(tiny_model_dir), "-sc", '{"method": "ngram", "bogus": 1}'], "Unknown key 'bogus'"),
    ):
        result = subprocess.run(serve_command(*args), capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert result.returncode == 2 and message in result.stderr
