"""deploy/ against a real tritonserver: every metric (and label) the Grafana dashboard
queries is one the server exposes on /metrics, and the compose load test's perf_analyzer
arguments and input file work against the `speculative` model."""

from __future__ import annotations

import json

from client.api.triton import grpc_generate
from tests.fixtures.deploy import DEPLOY, dashboard_queries, exposed, load_compose, loadtest_args, query_names
from tests.fixtures.helpers import metrics_text

# Triton exposes these only on hosts with a GPU (Triton's metrics documentation).
GPU_ONLY = {"nv_gpu_utilization", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes"}
# Labels Prometheus adds to every scraped series, or that only GPU metrics carry.
ADDED_LABELS = {"instance", "job", "gpu_uuid"}


def test_dashboard_queries_only_what_the_server_exposes(tiny_server):
    grpc_generate(tiny_server.grpc_url, "The quick brown fox jumps over the lazy dog. The", max_tokens=24)
    served_names, served_labels = exposed(metrics_text(tiny_server))
    names, labels = set(), set()
    for expr in dashboard_queries():
        n, l = query_names(expr)
        names |= n
        labels |= l
    assert names - served_names <= GPU_ONLY, names - served_names - GPU_ONLY
    assert labels - served_labels <= ADDED_LABELS, labels - served_labels - ADDED_LABELS
    # Every acceptance metric of the project is on the dashboard, with Triton's own.
    ours = {n for n in served_names if n.startswith("tritonspec_")}
    assert ours >= {"tritonspec_active_sequences", "tritonspec_spec_decode_num_accepted_tokens"}
    assert ours <= names
    assert {
        "nv_inference_request_success",
        "nv_inference_request_failure",
        "nv_inference_compute_infer_duration_us",
        "nv_inference_count",
        "nv_inference_exec_count",
    } <= names


def test_loadtest_arguments_and_input_work_against_the_server(tiny_server, tmp_path):
    """The loadtest service's perf_analyzer call, with only the address, the concurrency, the
    window size, the paths and the output length changed for this machine."""
    from client.cli.perf_analyzer import run

    args = loadtest_args(load_compose("docker-compose.yml"))
    rows = json.loads((DEPLOY / "perf_input.json").read_text())["data"]
    data = tmp_path / "input.json"
    data.write_text(json.dumps({"data": [{**row, "max_tokens": [6]} for row in rows]}))
    export = tmp_path / "export.json"
    local = {
        "-u": tiny_server.grpc_url,
        "--input-data": str(data),
        "--concurrency-range": "1:2:1",
        "--measurement-request-count": "4",
        "--profile-export-file": str(export),
    }
    args = [local.get(previous, arg) for previous, arg in zip(["", *args], args)]
    done = run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    experiments = json.loads(export.read_text())["experiments"]
    assert [e["experiment"]["value"] for e in experiments] == [1, 2]
    requests = [r for e in experiments for r in e["requests"]]
    assert requests and all(r["response_timestamps"] for r in requests)
