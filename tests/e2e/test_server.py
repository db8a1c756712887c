"""End to end through a real tritonserver: the tiny model, float32, ngram drafting."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import tritonclient.http as httpclient

from client.api.triton import GenerationError, grpc_generate, http_generate
from tests.fixtures.helpers import active_sequences, hf_greedy, metric_values, wait_for_no_active_sequences
from tests.fixtures.prompts import TINY_PROMPTS
from tests.fixtures.servers import NON_ASCII_NOTE

PROMPTS = TINY_PROMPTS


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_ngram_equals_target_greedy(tiny_server, tiny_model_dir, prompt):
    expected = hf_greedy(str(tiny_model_dir), prompt, 48)
    streamed = grpc_generate(tiny_server.grpc_url, prompt, max_tokens=48)
    assert tuple(streamed.output_ids) == expected
    whole = http_generate(tiny_server.http_url, prompt, max_tokens=48)
    assert tuple(whole.output_ids) == expected
    assert whole.num_responses == 1
    assert whole.text.startswith(prompt)  # /generate prepends the prompt, as vLLM does
    assert whole.text[len(prompt) :] == streamed.text
    sse = http_generate(tiny_server.http_url, prompt, stream=True, max_tokens=48)
    assert tuple(sse.output_ids) == expected and sse.text == streamed.text
    assert streamed.num_output_tokens == len(expected)


def test_a_config_pbtxt_with_non_ascii_text_loads(tiny_server, tiny_model_dir):
    """The Triton stub runs Python isolated, reading text as ASCII unless the models set
    UTF-8 up (common.utf8_text): each model reads config.pbtxt files as text at load, and
    this server's carry a parameter outside ASCII."""
    client = httpclient.InferenceServerClient(tiny_server.http_url)
    for model in ("speculative", "verifier", "drafter"):
        assert client.get_model_config(model)["parameters"]["note"]["string_value"] == NON_ASCII_NOTE
    r = grpc_generate(tiny_server.grpc_url, PROMPTS[0], max_tokens=8)
    assert tuple(r.output_ids) == hf_greedy(str(tiny_model_dir), PROMPTS[0], 8)


def test_drafts_are_accepted_on_repetitive_text(tiny_server, tiny_model_dir):
    results = [grpc_generate(tiny_server.grpc_url, p, max_tokens=48) for p in PROMPTS[:3]]
    assert sum(r.total_accepted_draft_tokens for r in results) > 0
    for r in results:
        assert r.total_accepted_draft_tokens <= r.total_draft_tokens
        if r.total_draft_tokens:
            assert r.acceptance_rate == pytest.approx(r.total_accepted_draft_tokens / r.total_draft_tokens)
        if r.perf_metrics["num_drafts"]:
            assert r.perf_metrics["mean_acceptance_length"] == pytest.approx(
                1 + r.total_accepted_draft_tokens / r.perf_metrics["num_drafts"]
            )


def test_plain_decoding_is_the_same_path(tiny_server, tiny_model_dir):
    prompt = PROMPTS[1]
    plain = grpc_generate(tiny_server.grpc_url, prompt, max_tokens=40, num_draft_tokens=0)
    assert plain.total_draft_tokens == 0
    assert tuple(plain.output_ids) == hf_greedy(str(tiny_model_dir), prompt, 40)
    assert plain.perf_metrics["num_steps"] == len(plain.output_ids)


def test_fewer_draft_tokens_per_request(tiny_server, tiny_model_dir):
    prompt = PROMPTS[2]
    r = grpc_generate(tiny_server.grpc_url, prompt, max_tokens=40, num_draft_tokens=1)
    assert tuple(r.output_ids) == hf_greedy(str(tiny_model_dir), prompt, 40)
    assert len(r.perf_metrics["accepted_per_position"]) <= 1


def test_concurrent_streams_each_get_their_own_output(tiny_server, tiny_model_dir):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(8)]
    alone = {p: grpc_generate(tiny_server.grpc_url, p, max_tokens=40).output_ids for p in prompts}
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: grpc_generate(tiny_server.grpc_url, p, max_tokens=40), prompts))
    for prompt, result in zip(prompts, together):
        assert result.output_ids == alone[prompt]
    assert not any(wait_for_no_active_sequences(tiny_server).values())


def test_stop_words_cut_the_text(tiny_server, tiny_model_dir):
    prompt = PROMPTS[0]
    full = grpc_generate(tiny_server.grpc_url, prompt, max_tokens=48).text
    stop = full[10:14]
    assert stop.strip()
    for stream in (True, False):
        r = grpc_generate(
            tiny_server.grpc_url, prompt, stream=stream, max_tokens=48, stop_words=[stop], exclude_input_in_output=True
        )
        assert r.text == full[: full.index(stop)]
        assert r.finish_reason == "stop"


def test_max_tokens_and_finish_reason(tiny_server):
    r = grpc_generate(tiny_server.grpc_url, PROMPTS[1], max_tokens=5, ignore_eos=True)
    assert len(r.output_ids) == 5 and r.finish_reason == "length"


def test_sampling_parameters_json_with_string_numbers(tiny_server, tiny_model_dir):
    prompt = PROMPTS[3]
    r = grpc_generate(tiny_server.grpc_url, prompt, sampling_parameters={"max_tokens": "12", "temperature": "0"})
    assert tuple(r.output_ids) == hf_greedy(str(tiny_model_dir), prompt, 12)
    r = http_generate(tiny_server.http_url, prompt, parameters={"max_tokens": 12, "temperature": 0})
    assert tuple(r.output_ids) == hf_greedy(str(tiny_model_dir), prompt, 12)


def test_stream_interval_sends_fewer_fuller_responses(tiny_server, tiny_model_dir):
    prompt, n, interval = PROMPTS[3], 40, 4
    expected = hf_greedy(str(tiny_model_dir), prompt, n)
    every = grpc_generate(tiny_server.grpc_url, prompt, max_tokens=n, num_draft_tokens=0)
    fuller = grpc_generate(tiny_server.grpc_url, prompt, max_tokens=n, num_draft_tokens=0, stream_interval=interval)
    assert tuple(every.output_ids) == tuple(fuller.output_ids) == expected and fuller.text == every.text
    assert every.num_responses >= n  # a token a step, each sent as it came
    # the first response and the last may be short, every other one has `interval` tokens or more
    assert fuller.num_responses <= 2 + (n - 1) // interval
    sse = http_generate(tiny_server.http_url, prompt, stream=True, max_tokens=n, stream_interval=interval)
    assert tuple(sse.output_ids) == expected and sse.num_responses <= 2 + (n - 1) // interval


BAD_REQUESTS = [
    ({"prompt": ""}, "text_input is empty"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens must be at least 1"),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens must be at least 1"),
    ({"prompt": "hi", "max_tokens": 100000}, "above the model's limit"),
    ({"prompt": "hi", "sampling_parameters": "{not json"}, "sampling_parameters is not valid JSON"),
    (
        {"prompt": "hi", "sampling_parameters": {"max_tokens": 4, "best_of": 2}},
        "best_of is only supported at its default 1",
    ),
    (
        {"prompt": "hi", "sampling_parameters": {"max_tokens": 4, "use_beam_search": True}},
        "use_beam_search is only supported at its default false",
    ),
    ({"prompt": "hi", "sampling_parameters": {"frequency_penalty": 3}}, "frequency_penalty must be in [-2, 2]"),
    ({"prompt": "hi", "sampling_parameters": {"logit_bias": {"99999": 1}}}, "logit_bias: token id 99999 is outside"),
    ({"prompt": "hi", "sampling_parameters": {"temperature": "hot"}}, "temperature must be a number"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"prompt": "The quick brown fox " * 200}, "context window"),
    ({"prompt": "hi", "num_draft_tokens": 99}, "num_draft_tokens=99 must be in [0, 4]"),
    ({"prompt": "hi", "stream_interval": 0}, "stream_interval must be a whole number of tokens in [1, "),
]


@pytest.mark.parametrize("case,message", BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_bad_input_is_refused_and_nothing_leaks(tiny_server, case, message):
    case = dict(case)
    prompt = case.pop("prompt")
    sampling = case.pop("sampling_parameters", None)
    if isinstance(sampling, str):  # send malformed JSON as is
        with pytest.raises(GenerationError, match=message.replace("(", r"\(").replace(")", r"\)")):
            _raw_sampling_request(tiny_server, prompt, sampling)
    else:
        with pytest.raises(GenerationError) as err:
            grpc_generate(tiny_server.grpc_url, prompt, sampling_parameters=sampling, **case)
        assert message in str(err.value)
    assert tiny_server.is_ready()
    assert not any(wait_for_no_active_sequences(tiny_server).values())
    assert grpc_generate(tiny_server.grpc_url, "The quick", max_tokens=3).num_output_tokens == 3


def _raw_sampling_request(server, prompt: str, sampling: str):
    import urllib.error
    import urllib.request

    body = json.dumps({"text_input": prompt, "sampling_parameters": sampling}).encode()
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/speculative/generate", data=body)
    try:
        urllib.request.urlopen(request, timeout=30).read()
    except urllib.error.HTTPError as e:
        raise GenerationError(json.loads(e.read()).get("error", "")) from None


def test_cancelled_stream_releases_its_sequence(tiny_server):
    r = grpc_generate(tiny_server.grpc_url, PROMPTS[0], max_tokens=400, ignore_eos=True, cancel_after_responses=2)
    assert r.finish_reason == "" and len(r.output_ids) < 400
    assert not any(wait_for_no_active_sequences(tiny_server).values())
    assert tiny_server.is_ready()
    assert grpc_generate(tiny_server.grpc_url, "The quick", max_tokens=3).num_output_tokens == 3


def test_metrics_report_both_stateful_models(tiny_server):
    assert set(active_sequences(tiny_server)) >= {"verifier", "drafter"}


def test_acceptance_counters_on_metrics_add_up(tiny_server):
    def counters():
        labels = 'method="ngram",model="speculative"'
        return {
            name: metric_values(tiny_server, f"tritonspec_spec_decode_{name}").get(labels, 0.0)
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        }

    before = counters()
    r = grpc_generate(tiny_server.grpc_url, PROMPTS[1], max_tokens=40)
    after = counters()
    assert after["num_draft_tokens"] - before["num_draft_tokens"] == r.total_draft_tokens > 0
    assert after["num_accepted_tokens"] - before["num_accepted_tokens"] == r.total_accepted_draft_tokens
    assert after["num_drafts"] - before["num_drafts"] == r.perf_metrics["num_drafts"]
    per_pos = metric_values(tiny_server, "tritonspec_spec_decode_num_accepted_tokens_per_pos")
    assert any('position="0"' in labels for labels in per_pos)
