"""vLLM's metric set on a real tritonserver's /metrics: a fresh server exports every metric
metrics.py declares, at 0 (so the Grafana dashboard shows 0, not "no data", and every query
it makes names an exported metric), and under perf_analyzer's load the counters add up to
what was sent; an OpenAI request's `n` is observed as vLLM observes it; KV cache usage rises
while a request holds part of the pool."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from backends.triton_models.metrics import ENGINE_METRICS, HISTOGRAM, SERVING_METRICS, SPEC_DECODE_EXTRAS
from client.api.triton import grpc_generate
from client.cli.perf_analyzer import run
from tests.fixtures.deploy import dashboard_queries, exposed, query_names
from tests.fixtures.helpers import metrics_text
from tests.fixtures.servers import fixture_server

SPEC = 'model="speculative",version="1"'
ENGINE = 'model="verifier",version="1"'
# A repetitive prompt: the ngram drafter (4 tokens a step) has drafts to propose.
PROMPT = "one two three four one two three four one two three four"
REQUESTS, MAX_TOKENS = 96, 16
GPU_ONLY = {"nv_gpu_utilization", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes"}


@pytest.fixture(scope="module")
def fresh_server(tmp_path_factory, tiny_model_dir):
    """A server of its own: the first test sees it before any request."""
    yield from fixture_server(tmp_path_factory, "fresh-metrics", tiny_model_dir)


def samples(text: str) -> dict[str, dict[str, float]]:
    """{series name: {label text: value}} of a /metrics page."""
    out: dict[str, dict[str, float]] = {}
    for m in re.finditer(r"^([\w:]+)(?:\{([^}]*)\})? (\S+)$", text, re.M):
        out.setdefault(m.group(1), {})[m.group(2) or ""] = float(m.group(3))
    return out


def value(text: str, name: str, labels: str) -> float:
    return samples(text).get(name, {}).get(labels, 0.0)


def wait_for_metrics(server, requests: float) -> str:
    """/metrics once `requests` requests are in it (request metrics are written from a thread
    of their own)."""
    deadline = time.monotonic() + 10
    while value(text := metrics_text(server), "vllm:request_params_n_count", SPEC) < requests:
        assert time.monotonic() < deadline, "the requests never reached /metrics"
        time.sleep(0.1)
    return text


def test_a_fresh_server_exports_every_metric_at_zero(fresh_server):
    text = metrics_text(fresh_server)
    found = samples(text)
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    for group, model in ((SERVING_METRICS, "speculative"), (ENGINE_METRICS, "verifier")):
        for name, (kind, _) in group.items():
            assert types.get(name) == kind, (name, types.get(name))
            series = found[f"{name}_count" if kind == HISTOGRAM else name]
            values = [v for labels, v in series.items() if f'model="{model}"' in labels and 'version="1"' in labels]
            assert values and set(values) == {0.0}, (name, series)
    for name in SPEC_DECODE_EXTRAS:  # tritonspec's per-method counters: ngram's
        positions = [f',position="{p}"' for p in range(4)] if name.endswith("_per_pos") else [""]
        assert found[name] == {f'method="ngram",model="speculative"{p}': 0.0 for p in positions}, name
    per_pos = found["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert per_pos == {f'model="speculative",position="{p}",version="1"': 0.0 for p in range(4)}  # the drafter's k
    success = found["vllm:request_success_total"]
    assert success == {f'finished_reason="{r}",{SPEC}': 0.0 for r in ("abort", "length", "stop")}
    buckets = found["vllm:request_params_n_bucket"]
    assert {k.split('le="')[1].split('"')[0] for k in buckets} == {"1", "2", "5", "10", "20", "+Inf"}


def test_every_dashboard_query_names_a_metric_of_a_fresh_server(fresh_server):
    served, _ = exposed(metrics_text(fresh_server))
    names = set().union(*(query_names(expr)[0] for expr in dashboard_queries()))
    assert names - served <= GPU_ONLY, names - served - GPU_ONLY


def perf_analyzer_load(server, tmp_path) -> None:
    """perf_analyzer as the compose load test runs it: REQUESTS gRPC streams of PROMPT, 8 at a
    time, each MAX_TOKENS tokens long (ignore_eos)."""
    data = tmp_path / "input.json"
    entry = {"text_input": [PROMPT], "max_tokens": [MAX_TOKENS], "ignore_eos": [True], "stream": [True]}
    data.write_text(json.dumps({"data": [entry]}))
    args = ["-m", "speculative", "-u", server.grpc_url, "-i", "grpc", "--streaming", "--input-data", str(data)]
    args += ["--concurrency-range", "8", "--request-count", str(REQUESTS)]
    result = run(args, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_counters_add_up_under_perf_analyzer_load(fresh_server, tmp_path):
    """Every request, prompt token, generated token and draft is counted once, whatever ran
    beside it: the vLLM counters against what was sent, vLLM's spec-decode counters against
    tritonspec's per-method ones and against each other."""
    prompt_tokens = grpc_generate(fresh_server.grpc_url, PROMPT, max_tokens=1).num_input_tokens
    wait_for_metrics(fresh_server, 1)
    before = metrics_text(fresh_server)
    perf_analyzer_load(fresh_server, tmp_path)
    after = wait_for_metrics(fresh_server, value(before, "vllm:request_params_n_count", SPEC) + REQUESTS)

    def delta(name: str, labels: str = SPEC) -> float:
        return value(after, name, labels) - value(before, name, labels)

    output_tokens = REQUESTS * MAX_TOKENS
    assert delta("vllm:prompt_tokens_total") == REQUESTS * prompt_tokens
    assert delta("vllm:generation_tokens_total") == output_tokens
    assert delta("vllm:request_success_total", f'finished_reason="length",{SPEC}') == REQUESTS
    assert delta("vllm:request_success_total", f'finished_reason="stop",{SPEC}') == 0
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:request_params_n",
    ):
        assert delta(f"{name}_count") == REQUESTS, name
    assert delta("vllm:request_prompt_tokens_sum") == REQUESTS * prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == output_tokens
    assert delta("vllm:request_params_n_sum") == REQUESTS
    # Phases add up: inference = prefill + decode (per request, so in sum too).
    inference, prefill, decode = (
        delta(f"vllm:request_{phase}_time_seconds_sum") for phase in ("inference", "prefill", "decode")
    )
    assert inference == pytest.approx(prefill + decode, rel=1e-6) and decode > 0
    steps = delta("vllm:time_per_output_token_seconds_count")
    assert 0 < steps == delta("vllm:inter_token_latency_seconds_count") <= output_tokens - REQUESTS
    # Speculation: ngram drafted and verified; vLLM's counters agree with tritonspec's per method.
    drafts, drafted, accepted = (
        delta(f"vllm:spec_decode_num_{n}_total") for n in ("drafts", "draft_tokens", "accepted_tokens")
    )
    assert 0 < drafts <= drafted <= 4 * drafts and accepted <= drafted
    ngram = 'method="ngram",model="speculative"'
    assert delta("tritonspec_spec_decode_num_draft_tokens", ngram) == drafted
    per_pos = [
        delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", f'model="speculative",position="{p}",version="1"')
        for p in range(4)
    ]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    # The engine: every step's tokens, the prompts among them.
    assert delta("vllm:iteration_tokens_total_count", ENGINE) > 0
    assert delta("vllm:iteration_tokens_total_sum", ENGINE) >= REQUESTS * prompt_tokens + drafted
    assert delta("vllm:num_preemptions_total") == 0
    assert value(after, "vllm:num_requests_running", SPEC) == 0 == value(after, "vllm:num_requests_waiting", SPEC)


def test_request_params_n_observes_an_openai_requests_n_once_per_prompt(fresh_server, tmp_path):
    """The front end runs each of n choices as a request of its own; vLLM observes n once per
    prompt (a parent request), and so does this server."""
    import openai

    from tests.e2e.test_openai_server import openai_api
    from tests.fixtures.servers import free_ports

    before = metrics_text(fresh_server)
    with openai_api(free_ports(1)[0], fresh_server.grpc_url, tmp_path / "openai.log") as front:
        client = openai.OpenAI(base_url=f"{front.base}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="speculative", prompt=[PROMPT, "The quick"], n=3, max_tokens=4)
    assert len(out.choices) == 6
    after = wait_for_metrics(fresh_server, value(before, "vllm:request_params_n_count", SPEC) + 2)

    def delta(name: str, labels: str = SPEC) -> float:
        return value(after, name, labels) - value(before, name, labels)

    assert (delta("vllm:request_params_n_count"), delta("vllm:request_params_n_sum")) == (2, 6)  # two prompts, n = 3
    finished = [delta("vllm:request_success_total", f'finished_reason="{r}",{SPEC}') for r in ("stop", "length")]
    assert sum(finished) == 6  # a request per choice


def test_kv_cache_usage_rises_while_a_request_holds_the_pool(fresh_server):
    """A request's reservation (its prompt and max_tokens) is held from admission to release."""

    def usage() -> float:
        return value(metrics_text(fresh_server), "vllm:kv_cache_usage_perc", ENGINE)

    assert usage() == 0
    request = threading.Thread(
        target=grpc_generate,
        args=(fresh_server.grpc_url, "Once upon a time"),
        kwargs={"max_tokens": 480, "ignore_eos": True},
    )
    request.start()
    seen = 0.0
    while request.is_alive() and seen == 0:
        seen = usage()
    request.join(60)
    assert 0 < seen <= 1, "the usage never rose while the request ran"
    deadline = time.monotonic() + 10  # released: back to 0
    while usage() > 0:
        assert time.monotonic() < deadline, "the KV cache usage never came back to 0"
        time.sleep(0.1)
