"""perf_analyzer against the real server: concurrent gRPC streams with speculation, as a
load test and a regression test for concurrent-BLS stability (a stub crash or stall fails
it), then the server must be ready and hold no per-sequence state."""

from __future__ import annotations

import csv
import json

from client.cli.perf_analyzer import run
from tests.fixtures.helpers import genai_perf_report, wait_for_no_active_sequences


def streaming_args(url: str, concurrency: int, request_count: int, *extra: str) -> list[str]:
    """perf_analyzer's arguments for gRPC streams to `speculative`: one measurement of
    `request_count` requests (no stability windows for a busy machine to fail)."""
    return [
        "-m",
        "speculative",
        "-u",
        url,
        "-i",
        "grpc",
        "--streaming",
        "--concurrency-range",
        str(concurrency),
        "--request-count",
        str(request_count),
        *extra,
    ]


def test_perf_analyzer_streaming_load(tiny_server, tmp_path):
    data = tmp_path / "input.json"
    data.write_text(
        json.dumps(
            {
                "data": [
                    {
                        "text_input": ["def add(a, b):\n    return a + b\ndef add(a, b):"],
                        "max_tokens": [24],
                        "stream": [True],
                    },
                    {"text_input": ["The quick brown fox"], "max_tokens": [24], "stream": [True]},
                ]
            }
        )
    )
    report = tmp_path / "pa.csv"
    result = run(
        streaming_args(tiny_server.grpc_url, 4, 16, "--input-data", str(data), "-f", str(report)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = list(csv.DictReader(report.open()))
    assert rows and float(rows[0]["Inferences/Second"]) > 0
    assert tiny_server.is_ready()
    assert not any(wait_for_no_active_sequences(tiny_server).values())


def test_genai_perf_against_the_server(tiny_server, tiny_model_dir, tmp_path):
    """genai-perf as users run it (vLLM-backend request format: text_input, stream,
    exclude_input_in_output, sampling_parameters with numbers as strings)."""
    genai_perf_report(tmp_path, tiny_server.grpc_url, tiny_model_dir, "--endpoint-type", "kserve", "--backend", "vllm")
    assert tiny_server.is_ready()
    assert not any(wait_for_no_active_sequences(tiny_server).values())


def test_perf_analyzer_without_input_data(tiny_server):
    """perf_analyzer fills every input it has no data for with random bytes and cannot fill the
    variable-length ones, so `tritonspec perf-analyzer` sends the benchmark prompts when no
    --input-data is given."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "client.cli.main", "perf-analyzer", *streaming_args(tiny_server.grpc_url, 2, 4)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "no --input-data given; sending the" in done.stderr and "Concurrency: 2, throughput" in done.stdout
