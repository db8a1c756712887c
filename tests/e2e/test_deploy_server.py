"""deploy/ against a real tritonserver: every metric (and label) the Grafana dashboard
queries is one the server exposes on /metrics, and the compose load test's perf_analyzer
arguments and input file work against the `speculative` model."""
from __future__ import annotations

import json
import re

from client.api.triton import grpc_generate
from tests.helpers import metrics_text
from tests.test_compose import DEPLOY, load_compose, loadtest_args

# Triton exposes these only on hosts with a GPU (Triton's metrics documentation).
GPU_ONLY = {"nv_gpu_utilization", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes"}
# Labels Prometheus adds to every scraped series, or that only GPU metrics carry.
ADDED_LABELS = {"instance", "job", "gpu_uuid"}
_KEYWORDS = {"by", "on", "ignoring", "without", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def dashboard_queries() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "tritonspec.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    queries = [t["expr"] for p in panels for t in p["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return queries


def query_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) that a PromQL expression (or label_values()) refers to."""
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    labels = set()
    for match in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"(\w+)\s*[=!]~?", match))
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    for clause in re.findall(r"\b(?:by|on|ignoring|without|group_left|group_right)\s*\(([^)]*)\)", expr):
        labels |= {name.strip() for name in clause.split(",") if name.strip()}
    expr = re.sub(r"\b(by|on|ignoring|without|group_left|group_right)\s*\([^)]*\)", " ", expr)
    if m := re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", expr.strip()):
        return {m.group(1)}, labels | {m.group(2)}
    names = {name for name in re.findall(r"\b([A-Za-z_:][\w:]*)\b(?!\s*\()", expr) if name not in _KEYWORDS}
    return names, labels


def exposed(text: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) on a /metrics page."""
    names = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    labels = {label for block in re.findall(r"^\w+\{([^}]*)\}", text, re.M) for label in re.findall(r"(\w+)=", block)}
    return names, labels


def test_query_parser_finds_names_and_labels():
    names, labels = query_names('1 + sum by (method) (rate(a_total{model="x",instance=~"$i"}[5m])) '
                                '/ on (method) group_left sum(rate(b{z!="1"}[1m]))')
    assert names == {"a_total", "b"} and labels == {"method", "model", "instance", "z"}


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
    assert {"nv_inference_request_success", "nv_inference_request_failure", "nv_inference_compute_infer_duration_us",
            "nv_inference_count", "nv_inference_exec_count"} <= names


def test_loadtest_arguments_and_input_work_against_the_server(tiny_server, tmp_path):
    """The loadtest service's perf_analyzer call, with only the address, the concurrency, the
    window size, the paths and the output length changed for this machine."""
    from client.cli.perf_analyzer import run

    args = loadtest_args(load_compose("docker-compose.yml"))
    rows = json.loads((DEPLOY / "perf_input.json").read_text())["data"]
    data = tmp_path / "input.json"
    data.write_text(json.dumps({"data": [{**row, "max_tokens": [6]} for row in rows]}))
    export = tmp_path / "export.json"
    local = {"-u": tiny_server.grpc_url, "--input-data": str(data), "--concurrency-range": "1:2:1",
             "--measurement-request-count": "4", "--profile-export-file": str(export)}
    args = [local.get(previous, arg) for previous, arg in zip(["", *args], args)]
    done = run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    experiments = json.loads(export.read_text())["experiments"]
    assert [e["experiment"]["value"] for e in experiments] == [1, 2]
    requests = [r for e in experiments for r in e["requests"]]
    assert requests and all(r["response_timestamps"] for r in requests)
