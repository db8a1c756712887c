"""The metric set of backends/triton_models/metrics.py against vLLM's and Triton's vLLM
backend's (names and types), the shipped Grafana dashboard against it, and the OpenAI front
end's pieces that need no server: the parameter a model's refusal names, the Responses
request read as a chat request, the front end's own counters. (A real server exporting
them all at 0 and moving them: tests/e2e/test_vllm_metrics.py.)"""

from __future__ import annotations

import time

import pytest

from backends.triton_models.metrics import (
    COUNTER,
    ENGINE_METRICS,
    GAUGE,
    HISTOGRAM,
    SERVING_METRICS,
    SPEC_DECODE_EXTRAS,
    MetricWriter,
    build_1_2_5_buckets,
    histogram_buckets,
)
from client.api.openai_frontend import generation_error
from client.api.openai_http import OpenAIError
from client.api.openai_responses import chat_body
from client.api.openai_utility import RouteCounts
from client.api.triton import server_error
from tests.fixtures.deploy import dashboard_queries, query_names

DECLARED = {**SERVING_METRICS, **ENGINE_METRICS, **SPEC_DECODE_EXTRAS}
# The names an operator coming from vLLM or Triton's vLLM backend looks for (issue 60), as a
# Prometheus scrape of vLLM shows them (a counter's `_total` appended), with their types.
VLLM_SET = {
    "vllm:spec_decode_num_drafts_total": COUNTER,
    "vllm:spec_decode_num_draft_tokens_total": COUNTER,
    "vllm:spec_decode_num_accepted_tokens_total": COUNTER,
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": COUNTER,
    "vllm:kv_cache_usage_perc": GAUGE,
    "vllm:num_preemptions_total": COUNTER,
    "vllm:iteration_tokens_total": HISTOGRAM,
    "vllm:time_per_output_token_seconds": HISTOGRAM,
    "vllm:request_queue_time_seconds": HISTOGRAM,
    "vllm:request_inference_time_seconds": HISTOGRAM,
    "vllm:request_prefill_time_seconds": HISTOGRAM,
    "vllm:request_decode_time_seconds": HISTOGRAM,
    "vllm:request_prompt_tokens": HISTOGRAM,
    "vllm:request_generation_tokens": HISTOGRAM,
    "vllm:request_params_n": HISTOGRAM,
    "vllm:request_success_total": COUNTER,
    "vllm:num_requests_running": GAUGE,
    "vllm:num_requests_waiting": GAUGE,
    "vllm:prompt_tokens_total": COUNTER,
    "vllm:generation_tokens_total": COUNTER,
    "vllm:time_to_first_token_seconds": HISTOGRAM,
    "vllm:e2e_request_latency_seconds": HISTOGRAM,
    "vllm:prefix_cache_queries_total": COUNTER,
    "vllm:prefix_cache_hits_total": COUNTER,
}


def test_every_vllm_metric_is_declared_with_vllms_type():
    assert {name: DECLARED.get(name, (None,))[0] for name in VLLM_SET} == VLLM_SET


def test_buckets_are_vllms():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(2048)[-3:] == [500, 1000, 2000]
    assert histogram_buckets("vllm:request_params_n", 2048) == [1, 2, 5, 10, 20]
    assert histogram_buckets("vllm:iteration_tokens_total", 2048)[:3] == [1, 8, 16]
    assert histogram_buckets("vllm:request_queue_time_seconds", 2048)[:3] == [0.3, 0.5, 0.8]
    for name, (kind, _) in DECLARED.items():
        if kind == HISTOGRAM:
            buckets = histogram_buckets(name, 2048)
            assert buckets == sorted(set(buckets)), name


def test_every_dashboard_query_names_a_declared_metric():
    """Triton's own `nv_*` and the active-sequences gauge aside, the dashboard reads only
    what metrics.py declares (a histogram by its _bucket / _sum / _count series)."""
    exported = set(DECLARED) | {"tritonspec_active_sequences"}
    exported |= {
        f"{n}{s}" for n, (kind, _) in DECLARED.items() if kind == HISTOGRAM for s in ("_bucket", "_sum", "_count")
    }
    names = set().union(*(query_names(expr)[0] for expr in dashboard_queries()))
    ours = {n for n in names if not n.startswith("nv_")}
    assert ours <= exported, ours - exported
    # Every vLLM metric of the set is on the dashboard.
    read = {n.removesuffix(s) for n in ours for s in ("_bucket", "_sum", "_count") if n.endswith(s)} | ours
    assert set(VLLM_SET) <= read, set(VLLM_SET) - read


@pytest.mark.parametrize(
    "message, param",
    [
        ("repetition_penalty must be in (0, 100] (1: off), got 0", "repetition_penalty"),
        ("min_tokens must be in [0, max_tokens=4], got 9", "min_tokens"),
        ("logit_bias[5] must be in [-100, 100], got 200", "logit_bias"),
        ("seed must be a non-negative 63-bit integer, got -1", "seed"),
        ("text_input is required", None),
        ("the prompt is longer than the context window", None),
    ],
)
def test_a_refusal_of_the_model_names_its_parameter(message, param):
    error = generation_error(server_error(message))
    assert (error.status, error.param) == (400, param)
    assert error.body()["error"]["param"] == param


def test_a_responses_request_is_a_chat_request():
    body = chat_body(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "No lists."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
                {"role": "user", "content": "Again"},
            ],
            "max_output_tokens": 7,
            "temperature": 0,
            "stream": True,
            "store": False,
            "metadata": {"k": "v"},
            "tools": [],
        }
    )
    assert body == {
        "model": "m",
        "stream": True,
        "temperature": 0,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "No lists."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Again"},
        ],
        "max_completion_tokens": 7,
    }
    assert chat_body({"input": "Hi"})["messages"] == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"store": True}, "store"),
        ({"text": {"format": {"type": "json_object"}}}, "text"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_what_a_responses_request_cannot_have_is_refused_by_name(extra, param):
    with pytest.raises(OpenAIError) as info:
        chat_body({"input": "Hi", **extra})
    assert (info.value.status, info.value.param) == (400, param)
    assert param in info.value.message


def test_route_counts_are_prometheus_text():
    counts = RouteCounts()
    counts.finished[(counts.route("/tokenize"), 200)] += 2
    counts.finished[(counts.route("/nowhere"), 404)] += 1
    text = counts.exposition()
    assert 'tritonspec_openai_requests_total{route="/tokenize",status="200"} 2' in text
    assert 'tritonspec_openai_requests_total{route="other",status="404"} 1' in text
    assert 'tritonspec_openai_requests_in_flight{route="/v1/responses"} 0' in text
    assert counts.route("/v1/models/x") == "/v1/models/{model}"


class Recorded:
    """A metric that records the calls it gets (the writer's batching, not Triton, is tested)."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def increment(self, value: float) -> None:
        self.calls.append((self, "increment", value))

    def set(self, value: float) -> None:
        self.calls.append((self, "set", value))

    def observe(self, value: float) -> None:
        self.calls.append((self, "observe", value))


def test_the_metric_writer_writes_a_batch_s_counters_once_and_its_observations_after():
    calls: list = []
    counter, gauge, running, histogram = (Recorded(calls) for _ in range(4))
    writer = MetricWriter("test-metrics")
    writer.FLUSH_S = 1.0  # everything below arrives within one flush period, however busy the host
    for step in range(5):  # five decoding steps within one flush period
        writer.put(counter, "increment", 2)
        writer.put(histogram, "observe", 0.01 * step)
        writer.put(gauge, "set", step / 10)
    writer.put(running, "increment", 1)
    writer.put(running, "increment", -1)  # cancels out: not written
    writer.close()
    assert calls == [
        (counter, "increment", 10),
        (gauge, "set", 0.4),
        *[(histogram, "observe", 0.01 * step) for step in range(5)],
    ]


def test_the_metric_writer_writes_once_a_forward_has_started():
    """Each write is a round trip that holds the GIL (Triton's stub): it waits for the next
    forward pass, whose C code does not need the GIL, rather than landing between steps."""
    from backends.triton_models.outbox import Outbox

    calls: list = []
    counter = Recorded(calls)
    outbox = Outbox(lambda e: None)
    writer = MetricWriter("test-metrics")
    writer.FLUSH_S = 0.05
    writer.wait_for_step = lambda timeout_s: (outbox.wait_for_step(5.0), calls.append("forward"))
    writer.put(counter, "increment", 1)
    time.sleep(0.3)
    assert calls == []  # gathered, and still waiting for a forward
    outbox.step_started()
    writer.close()
    outbox.close()
    assert calls == ["forward", (counter, "increment", 1)]
