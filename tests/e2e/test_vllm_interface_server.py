"""What today's vLLM-backend clients send, through the real server (the tiny model in float32,
ngram drafting): the r24.12+ return_* flags over gRPC with tritonclient, the exact requests of
Triton's own OpenAI-compatible frontend, penalties and token controls that leave speculative
output equal to plain decoding (greedy) or distributed as the target's (sampled), logprobs
equal to plain decoding's, and vLLM's latency and token metrics on /metrics."""

from __future__ import annotations

import json
import queue
import time

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from client.api.triton import grpc_generate
from tests.fixtures.helpers import (
    coarse_total_variation,
    load_hf_model,
    metric_values,
    seeded_results,
    wait_for_no_active_sequences,
)
from tests.fixtures.sampling import SAMPLES, TEMPERATURE, TOP_K

PROMPTS = [
    "def add(a, b):\n    return a + b\ndef add(a, b):",
    "for i in range(10):\n    print(i, i * i)\nfor i in",
    "The quick brown fox jumps over the lazy dog. The quick brown",
]
# Every control at once; bad_words / min_tokens / stop_token_ids by token id need the tokenizer.
PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.6, "presence_penalty": 0.3}


def stream_infer(url: str, tensors: dict[str, np.ndarray]) -> list:
    """One request over a gRPC stream with exactly these tensors; every response's outputs."""
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    inputs = []
    for name, value in tensors.items():
        tensor = grpcclient.InferInput(
            name, list(value.shape), "BYTES" if value.dtype == np.object_ else {np.dtype(bool): "BOOL"}[value.dtype]
        )
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    client.async_stream_infer("speculative", inputs, enable_empty_final_response=True)
    out = []
    try:
        while True:
            result, error = responses.get(timeout=120)
            assert error is None, error
            params = result.get_response().parameters
            if result.get_response().outputs:
                out.append({o.name: result.as_numpy(o.name) for o in result.get_response().outputs})
            if params["triton_final_response"].bool_param:
                return out
    finally:
        client.stop_stream()
        client.close()


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def flag(value: bool) -> np.ndarray:
    return np.array([value], dtype=bool)


# ------------------------------------------------------------------ the vLLM backend's flags


@pytest.mark.parametrize("stream", [True, False])
def test_vllm_backend_return_flags_over_grpc(tiny_server, stream):
    """Each flag puts its output on every response, with the vLLM backend's meaning."""
    prompt = PROMPTS[0]
    plain = grpc_generate(tiny_server.grpc_url, prompt, max_tokens=20, stream=False)
    responses = stream_infer(
        tiny_server.grpc_url,
        {
            "text_input": text(prompt),
            "stream": flag(stream),
            "exclude_input_in_output": flag(True),
            "sampling_parameters": text(json.dumps({"max_tokens": "20", "logprobs": "2"})),
            **{
                f"return_{name}": flag(True)
                for name in ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens")
            },
        },
    )
    assert len(responses) > 1 if stream else len(responses) == 1
    reasons = [r["finish_reason"][0].decode() for r in responses]
    assert reasons[-1] == plain.finish_reason and set(reasons[:-1]) <= {"None"}
    assert {int(r["num_input_tokens"][0]) for r in responses} == {plain.num_input_tokens}
    per_response = [int(r["num_output_tokens"][0]) for r in responses]
    assert sum(per_response) == plain.num_output_tokens  # what Triton's OpenAI frontend adds up
    logprobs = [json.loads(r["logprobs"][0]) for r in responses]
    assert [len(entries) for entries in logprobs] == per_response
    chosen = [next(iter(entry.items())) for entries in logprobs for entry in entries]
    assert [int(token) for token, _ in chosen] == plain.output_ids
    assert all(
        len(entry) in (2, 3) and all({"logprob", "rank", "decoded_token"} == set(v) for v in entry.values())
        for entries in logprobs
        for entry in entries
    )
    cumulative = [float(r["cumulative_logprob"][0]) for r in responses]
    assert cumulative[-1] == pytest.approx(sum(v["logprob"] for _, v in chosen), abs=1e-3)
    assert cumulative == sorted(cumulative, reverse=True)  # each response adds logprobs <= 0


def test_logprobs_output_is_null_without_logprobs_in_the_sampling_parameters(tiny_server):
    (response,) = stream_infer(
        tiny_server.grpc_url,
        {
            "text_input": text("The quick"),
            "stream": flag(False),
            "return_logprobs": flag(True),
            "sampling_parameters": text('{"max_tokens": 3}'),
        },
    )
    assert response["logprobs"][0] == b"null" and "cumulative_logprob" not in response


# ------------------------------------------------------------------ Triton's OpenAI frontend


def frontend_request(prompt: str, body: dict, stream: bool, echo: bool | None = None) -> dict[str, np.ndarray]:
    """What server/python/openai (engine/utils/triton.py, _create_vllm_generate_request) sends a
    vLLM-backend model, as it runs with `--backend vllm`: the OpenAI body minus its non-sampling
    fields as sampling_parameters (pydantic's non-None defaults included), and these tensors."""
    excludes = {
        "model",
        "stream",
        "messages",
        "prompt",
        "echo",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "best_of",
        "user",
    }
    sampling = {k: v for k, v in body.items() if k not in excludes and v is not None}
    sampling["max_tokens"] = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    return {
        "text_input": text(prompt),
        "stream": flag(stream),
        "exclude_input_in_output": flag(not echo),
        "sampling_parameters": text(json.dumps(sampling)),
        "return_num_input_tokens": flag(True),
        "return_num_output_tokens": flag(True),
        "return_logprobs": flag(False),
    }


# The schema defaults a bare request carries: completions (temperature 1) and chat (0.7).
COMPLETION_DEFAULTS = {
    "frequency_penalty": 0,
    "ignore_eos": False,
    "n": 1,
    "presence_penalty": 0,
    "temperature": 1,
    "top_p": 1,
}
CHAT_DEFAULTS = {**COMPLETION_DEFAULTS, "temperature": 0.7, "logprobs": False}


@pytest.mark.parametrize("defaults", [COMPLETION_DEFAULTS, CHAT_DEFAULTS], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_triton_openai_frontend_requests(tiny_server, defaults, stream):
    """Its exact tensors are accepted; the responses read as it reads them: one final
    response when not streaming, one string in text_output, UINT32 token counts whose
    per-response sum is the usage."""
    prompt = PROMPTS[1]
    body = {**defaults, "temperature": 0, "seed": 3, "max_tokens": 12, "stop": ["print(4"]}
    responses = stream_infer(tiny_server.grpc_url, frontend_request(prompt, body, stream))
    ref = grpc_generate(
        tiny_server.grpc_url,
        prompt,
        stream=False,
        exclude_input_in_output=True,
        max_tokens=12,
        temperature=0.0,
        stop_words=["print(4"],
    )
    if not stream:
        assert len(responses) == 1
    assert all(r["text_output"].size == 1 for r in responses)
    assert all(
        r["num_input_tokens"].dtype == np.uint32 and r["num_output_tokens"].dtype == np.uint32 for r in responses
    )
    assert "".join(r["text_output"][0].decode() for r in responses) == ref.text
    assert sum(int(r["num_output_tokens"][0]) for r in responses) == ref.num_output_tokens
    assert int(responses[0]["num_input_tokens"][0]) == ref.num_input_tokens


def test_triton_openai_frontend_echo_and_penalties(tiny_server):
    prompt = PROMPTS[2]
    body = {
        **COMPLETION_DEFAULTS,
        "temperature": 0,
        "max_tokens": 8,
        "frequency_penalty": 0.5,
        "min_tokens": 2,
        "logit_bias": {"5": 2},
    }
    (response,) = stream_infer(tiny_server.grpc_url, frontend_request(prompt, body, stream=False, echo=True))
    ref = grpc_generate(
        tiny_server.grpc_url,
        prompt,
        stream=False,
        max_tokens=8,
        temperature=0.0,
        frequency_penalty=0.5,
        min_tokens=2,
        sampling_parameters={"logit_bias": {"5": 2}},
    )
    assert response["text_output"][0].decode() == ref.text and ref.text.startswith(prompt)


# ------------------------------------------------------------------ lossless with controls


@pytest.fixture(scope="module")
def controls(tiny_server, tiny_model_dir) -> dict:
    """Penalties plus logit_bias, bad_words, min_tokens and stop_token_ids chosen from what
    the model would otherwise write, so that each of them changes the output."""
    free = grpc_generate(tiny_server.grpc_url, PROMPTS[0], max_tokens=24, stream=False).output_ids
    _, tokenizer = load_hf_model(str(tiny_model_dir))
    word = tokenizer.decode([free[3]]).strip() or "return"
    return {
        **PENALTIES,
        "min_tokens": 4,
        "bad_words": [word],
        "sampling_parameters": {"logit_bias": {str(free[1]): -5.0, str(free[6]): 3.0}, "stop_token_ids": [free[20]]},
    }


def test_greedy_with_penalties_and_controls_speculative_equals_plain(tiny_server, controls):
    accepted = 0
    for prompt in PROMPTS:
        free = grpc_generate(tiny_server.grpc_url, prompt, max_tokens=32, num_draft_tokens=0)
        plain = grpc_generate(tiny_server.grpc_url, prompt, max_tokens=32, num_draft_tokens=0, **controls)
        spec = grpc_generate(tiny_server.grpc_url, prompt, max_tokens=32, num_draft_tokens=4, **controls)
        assert plain.output_ids != free.output_ids  # the controls change the output
        assert spec.output_ids == plain.output_ids and spec.finish_reason == plain.finish_reason
        accepted += spec.total_accepted_draft_tokens
    assert accepted > 0  # drafts were verified under the controls, not skipped


def test_logprobs_speculative_equal_plain(tiny_server):
    for prompt in PROMPTS:
        kw = dict(max_tokens=24, stream=False, sampling_parameters={"logprobs": 3}, return_logprobs=True, **PENALTIES)
        plain = grpc_generate(tiny_server.grpc_url, prompt, num_draft_tokens=0, **kw)
        spec = grpc_generate(tiny_server.grpc_url, prompt, num_draft_tokens=4, **kw)
        assert spec.output_ids == plain.output_ids and spec.total_draft_tokens > 0
        assert len(spec.logprobs) == len(plain.logprobs) == len(plain.output_ids)
        for s, p in zip(spec.logprobs, plain.logprobs):
            assert list(s) == list(p)  # the same chosen token and alternatives, in order
            for token in p:
                assert s[token]["rank"] == p[token]["rank"]
                assert s[token]["decoded_token"] == p[token]["decoded_token"]
                # the batch-invariant target: a (k+1)-token forward gives a 1-token step's bits
                assert s[token]["logprob"] == p[token]["logprob"]


def penalized_marginals(model_dir: str, text_prompt: str, params: dict) -> list[dict[int, float]]:
    """The target's exact distribution of the first two sampled tokens with penalties
    (vLLM's formulas, written out here), temperature and top-k."""
    model, tokenizer = load_hf_model(model_dir)
    prompt = tokenizer(text_prompt)["input_ids"]

    def dist(output: list[int]) -> dict[int, float]:
        with torch.inference_mode():
            raw = model(input_ids=torch.tensor([prompt + output])).logits[0, -1]
        logits = raw.float().clone()  # outside inference mode: a tensor that may be changed
        for t in set(prompt + output):
            penalty = params["repetition_penalty"]
            logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
        for t in set(output):
            logits[t] -= params["frequency_penalty"] * output.count(t) + params["presence_penalty"]
        top = (logits / TEMPERATURE).topk(TOP_K)
        return dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))

    first = dist([])
    second: dict[int, float] = {}
    for token, p in first.items():
        for nxt, q in dist([token]).items():
            second[nxt] = second.get(nxt, 0.0) + p * q
    return [first, second]


def test_sampled_tokens_with_penalties_follow_the_target_distribution(tiny_server, tiny_model_dir):
    params = {"repetition_penalty": 1.6, "frequency_penalty": 1.5, "presence_penalty": 1.0}
    exact = penalized_marginals(str(tiny_model_dir), PROMPTS[1], params)
    assert max(exact[0].values()) < 0.8

    # The ngram draft for this prompt is the first token 20% of the time, so both accepted
    # and rejected drafts are verified under the penalties. 300 samples keep the test short:
    # the coarse TV's p99.99 is then 0.12; ignoring the penalties would be off by 0.37 / 0.46.
    samples = seeded_results(
        tiny_server,
        PROMPTS[1],
        SAMPLES // 2,
        max_tokens=2,
        temperature=TEMPERATURE,
        top_k=TOP_K,
        stream=False,
        num_draft_tokens=3,
        **params,
    )
    for position in range(2):
        tv = coarse_total_variation([s.output_ids[position] for s in samples], exact[position])
        assert tv < 0.125, (position, tv)
    assert not any(wait_for_no_active_sequences(tiny_server).values())


# ------------------------------------------------------------------ metrics


def test_latency_and_token_metrics_as_vllm_names_them(tiny_server):
    labels = 'model="speculative",version="1"'

    def value(name: str) -> float:
        return metric_values(tiny_server, name).get(labels, 0.0)

    names = (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:inter_token_latency_seconds_count",
    )

    def settled() -> dict[str, float]:
        """The counters once two reads 0.3 s apart agree: requests of earlier tests (on this
        shared server) finished, and their metrics written (the writer batches for 50 ms)."""
        wait_for_no_active_sequences(tiny_server)
        last = None
        while (now := {n: value(n) for n in names}) != last:
            last = now
            time.sleep(0.3)
        return now

    before = settled()
    r = grpc_generate(tiny_server.grpc_url, PROMPTS[0], max_tokens=16, ignore_eos=True)
    deadline = time.monotonic() + 10  # metrics are written from a thread of their own
    while value("vllm:e2e_request_latency_seconds_count") == before["vllm:e2e_request_latency_seconds_count"]:
        assert time.monotonic() < deadline, "the request never reached /metrics"
        time.sleep(0.1)
    after = settled()
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == r.num_input_tokens
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == r.num_output_tokens
    assert after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"] == 1
    assert after["vllm:e2e_request_latency_seconds_count"] - before["vllm:e2e_request_latency_seconds_count"] == 1
    assert after["vllm:inter_token_latency_seconds_count"] > before["vllm:inter_token_latency_seconds_count"]
    assert value("vllm:num_requests_running") == 0 and value("vllm:num_requests_waiting") == 0


def test_a_repeated_prompt_is_served_from_the_prefix_cache(tiny_server):
    """The second request with the same prompt finds its whole blocks cached (vLLM's prefix
    cache counters on the verifier) and answers exactly as the first, speculative or plain."""
    labels = 'model="verifier",version="1"'

    def value(name: str) -> float:
        return metric_values(tiny_server, name).get(labels, 0.0)

    prompt = "Prefix caching keeps the blocks of a prompt it has seen: " + "one two three four five six. " * 6
    hits = value("vllm:prefix_cache_hits_total")
    first = grpc_generate(tiny_server.grpc_url, prompt, max_tokens=12, ignore_eos=True, num_draft_tokens=0)
    assert value("vllm:prefix_cache_hits_total") == hits  # never seen: nothing to reuse
    queries = value("vllm:prefix_cache_queries_total")
    second = grpc_generate(tiny_server.grpc_url, prompt, max_tokens=12, ignore_eos=True)
    assert second.output_ids == first.output_ids
    assert value("vllm:prefix_cache_queries_total") - queries >= first.num_input_tokens - 1
    assert value("vllm:prefix_cache_hits_total") - hits == (first.num_input_tokens - 1) // 16 * 16 > 0


def test_http_generate_with_stream_true_answers_with_the_route_to_use(tiny_server):
    """Triton fixes the HTTP status with the first response, and the model sees the same
    request on /generate and /generate_stream: the answer is Triton's error body with status
    200 (docs/model-repository.md); client.api.triton raises it (tests/unit/test_client_frontends.py)."""
    import urllib.request

    body = json.dumps({"text_input": "The quick", "max_tokens": 4, "stream": True}).encode()
    url = f"http://{tiny_server.http_url}/v2/models/speculative/generate"
    with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=60) as response:
        answer = json.loads(response.read())
    assert response.status == 200 and "use generate stream" in answer["error"]
