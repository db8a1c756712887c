"""perf_analyzer against the real server: concurrent gRPC streams with speculation, as a
load test and a regression test for concurrent-BLS stability (a stub crash or stall fails
it), then the server must be ready and hold no per-sequence state."""
from __future__ import annotations

import csv
import json

from client.perf_analyzer import run
from tests.helpers import wait_for_no_active_sequences


def test_perf_analyzer_streaming_load(tiny_server, tmp_path):
    data = tmp_path / "input.json"
    data.write_text(json.dumps({"data": [
        {"text_input": ["def add(a, b):\n    return a + b\ndef add(a, b):"], "max_tokens": [24], "stream": [True]},
        {"text_input": ["The quick brown fox"], "max_tokens": [24], "stream": [True]},
    ]}))
    report = tmp_path / "pa.csv"
    result = run(["-m", "speculative", "-u", tiny_server.grpc_url, "-i", "grpc", "--streaming",
                  "--input-data", str(data), "--concurrency-range", "4",
                  "--measurement-interval", "3000", "--max-trials", "3", "--stability-percentage", "100",
                  "-f", str(report)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = list(csv.DictReader(report.open()))
    assert rows and float(rows[0]["Inferences/Second"]) > 0
    assert tiny_server.is_ready()
    assert not any(wait_for_no_active_sequences(tiny_server).values())
