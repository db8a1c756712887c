"""The client side of issue 21 in process: the OpenAI layer's parameters and logprobs,
errors that mean "Triton is down" (503, not 400), `tritonspec generate` against nothing,
and `tritonspec perf` reporting the spread of unstable windows instead of failing."""

from __future__ import annotations

import pytest

from client.api.openai_frontend import OpenAIError, generation_error, openai_logprobs, sampling_inputs
from client.api.openai_http import nesting_depth, parse_json_object
from client.api.openai_params import chat_messages, completion_prompts
from client.api.triton import GenerationError, ServerUnavailableError, server_error
from client.cli.perf import format_sweep, summarize_export

# Two tokens' entries as the `speculative` model returns them (chosen first, then ranked).
ENTRIES = [
    {
        "7": {"logprob": -0.5, "rank": 1, "decoded_token": " a"},
        "9": {"logprob": -1.5, "rank": 2, "decoded_token": " b"},
    },
    {"3": {"logprob": -2.0, "rank": 2, "decoded_token": "é"}, "4": {"logprob": -0.2, "rank": 1, "decoded_token": "x"}},
]


def test_penalties_logit_bias_and_logprobs_reach_the_model():
    inputs = sampling_inputs(
        {
            "frequency_penalty": 0.5,
            "presence_penalty": 0,
            "logit_bias": {"12": -100},
            "logprobs": 3,
            "min_tokens": 2,
            "repetition_penalty": 1.1,
            "stop_token_ids": [5],
            "bad_words": ["x"],
        },
        16,
        "completion",
    )
    assert inputs["frequency_penalty"] == 0.5 and "presence_penalty" not in inputs  # 0 changes nothing
    assert inputs["sampling_parameters"] == {"logit_bias": {"12": -100}, "stop_token_ids": [5], "logprobs": 3}
    assert inputs["return_logprobs"] and inputs["min_tokens"] == 2 and inputs["bad_words"] == ["x"]
    chat = sampling_inputs({"logprobs": True, "top_logprobs": 4}, 16, "chat")
    assert chat["sampling_parameters"] == {"logprobs": 4}
    assert "sampling_parameters" not in sampling_inputs({"logprobs": False}, 16, "chat")


@pytest.mark.parametrize(
    "body,kind,message",
    [
        ({"temperature": 2.1}, "completion", "'temperature' must be in [0, 2]"),
        ({"top_p": 1.5}, "completion", "'top_p' must be in [0, 1]"),
        ({"presence_penalty": -3}, "chat", "'presence_penalty' must be in [-2, 2]"),
        ({"logprobs": 6}, "completion", "'logprobs' must be in [0, 5]"),
        ({"top_logprobs": 21, "logprobs": True}, "chat", "'top_logprobs' must be in [0, 20]"),
        ({"top_logprobs": 2}, "chat", "'top_logprobs' needs 'logprobs': true"),
        ({"logit_bias": {"1": 101}}, "chat", "'logit_bias' values must be numbers in [-100, 100]"),
    ],
)
def test_openai_ranges_are_kept(body, kind, message):
    with pytest.raises(OpenAIError) as err:
        sampling_inputs(body, 16, kind)
    assert err.value.status == 400 and message in err.value.message


@pytest.mark.parametrize(
    "body,kind,param",
    [
        ({"max_tokens": 2**32 + 3}, "completion", "max_tokens"),  # int32 made it 3
        ({"max_completion_tokens": 2**31}, "chat", "max_completion_tokens"),
        ({"max_tokens": 0}, "completion", "max_tokens"),
        ({"top_k": 2**32 + 1}, "completion", "top_k"),  # int32 made it 1
        ({"top_k": 2**40}, "chat", "top_k"),  # int32 made it 0: off
        ({"top_k": -2}, "completion", "top_k"),
        ({"min_tokens": 2**31}, "completion", "min_tokens"),
        ({"seed": 2**64}, "completion", "seed"),  # uint64 cannot hold it
        ({"seed": -1}, "chat", "seed"),
        ({"stop": [""]}, "completion", "stop"),  # vLLM: "stop cannot contain an empty string"
        ({"stop": ""}, "chat", "stop"),
        ({"stop": ["fox", 3]}, "chat", "stop"),
    ],
)
def test_integers_the_tensors_cannot_hold_and_empty_stops_are_refused_by_name(body, kind, param):
    with pytest.raises(OpenAIError) as err:
        sampling_inputs(body, 16, kind)
    assert err.value.status == 400 and err.value.param == param


def test_the_largest_values_the_tensors_hold_pass_as_they_are():
    inputs = sampling_inputs({"max_tokens": 2**31 - 1, "top_k": -1, "seed": 2**63 - 1, "stop": "x"}, 16, "completion")
    assert (inputs["max_tokens"], inputs["top_k"], inputs["random_seed"]) == (2**31 - 1, -1, 2**63 - 1)
    assert inputs["stop_words"] == ["x"]


@pytest.mark.parametrize("depth", [33, 100_000])
def test_a_body_nested_too_deep_is_a_400_naming_it(depth):
    data = b'{"messages": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    with pytest.raises(OpenAIError) as err:
        parse_json_object(data)
    assert err.value.status == 400 and "nests more than 32 levels" in err.value.message
    assert nesting_depth(parse_json_object(b'{"a": [[{"b": []}]]}')) == 5
    assert parse_json_object(b'{"messages": ' + b"[" * 31 + b"]" * 31 + b"}")


def test_too_long_prompts_and_messages_are_refused_before_rendering():
    with pytest.raises(OpenAIError) as err:
        completion_prompts({"prompt": ["ok", "x" * 101]}, max_chars=100)
    assert err.value.code == "context_length_exceeded" and err.value.message.startswith("prompt[1] is 101 characters")
    messages = {"messages": [{"role": "user", "content": "x" * 60}, {"role": "user", "content": "y" * 60}]}
    assert len(chat_messages(messages, max_chars=120)) == 2
    with pytest.raises(OpenAIError) as err:
        chat_messages(messages, max_chars=100)  # each fits, together they do not
    assert err.value.param == "messages" and err.value.message.startswith("the messages' content is 120 characters")


def test_the_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    from client.cli.main import build_parser, door_policy

    args = ["openai", "--max-concurrent-requests", "8", "--max-body-bytes", "1000"]
    monkeypatch.delenv("TRITONSPEC_API_KEY", raising=False)
    policy = door_policy(build_parser().parse_args(args))
    assert (policy.api_key, policy.max_concurrent_requests, policy.max_body_bytes) == (None, 8, 1000)
    monkeypatch.setenv("TRITONSPEC_API_KEY", "from-env")
    assert door_policy(build_parser().parse_args(args)).api_key == "from-env"
    assert door_policy(build_parser().parse_args([*args, "--api-key", "flag"])).api_key == "flag"
    with pytest.raises(ValueError, match="at least 1"):
        door_policy(build_parser().parse_args(["openai", "--max-concurrent-requests", "0"]))


def test_logprobs_in_openai_shapes():
    chat = openai_logprobs("chat", ENTRIES, 1)["content"]
    assert [(t["token"], t["logprob"]) for t in chat] == [(" a", -0.5), ("é", -2.0)]
    assert chat[1]["bytes"] == list("é".encode()) and chat[1]["top_logprobs"][0]["token"] == "x"
    completion = openai_logprobs("completion", ENTRIES, 2, offset=10)
    assert completion["tokens"] == [" a", "é"] and completion["token_logprobs"] == [-0.5, -2.0]
    assert completion["text_offset"] == [10, 12] and completion["top_logprobs"][1] == {"x": -0.2, "é": -2.0}


@pytest.mark.parametrize(
    "message",
    [
        "The stream is no longer in valid state, the error detail is reported through provided callback.",
        "[StatusCode.UNAVAILABLE] failed to connect to all addresses",
        "generation failed: Model verifier - Error when running inference: Server not ready",
    ],
)
def test_a_triton_that_is_down_or_restarting_is_503_not_400(message):
    error = server_error(message)
    assert isinstance(error, ServerUnavailableError)
    assert generation_error(error).status == 503


def test_a_rejected_request_stays_400():
    error = server_error("top_p must be in (0, 1], got 1.5")
    assert type(error) is GenerationError and generation_error(error).status == 400


def test_generate_says_the_server_cannot_be_reached(capsys):
    from client.cli.main import main

    for protocol in ("grpc", "http"):
        assert main(["generate", "--url", "127.0.0.1:1", "--protocol", protocol, "hello"]) == 1
        err = capsys.readouterr().err
        assert "the server cannot be reached at 127.0.0.1:1" in err and "Traceback" not in err


def request(sent_s: float, responses: list[tuple[float, int]]) -> dict:
    """One request of a profile export: its send time and (time, tokens) per response."""
    return {
        "timestamp": int(sent_s * 1e9),
        "response_timestamps": [int(t * 1e9) for t, _ in responses],
        "response_outputs": [{"output_ids": list(range(n))} for _, n in responses],
    }


def export(rates: list[float], per_window: int = 4) -> dict:
    """One stream, a request a second answered half a second later, each window's requests
    carrying its rate's tokens; a last request starts the drain."""
    requests = [
        request(i, [(i + 0.5, int(rate))]) for i, rate in enumerate(r for r in rates for _ in range(per_window))
    ]
    end = len(requests)
    return {"experiments": [{"requests": [*requests, request(end, [(end + 0.5, 10)])]}]}


def test_perf_reports_the_spread_of_unstable_windows_instead_of_failing():
    steady = summarize_export(export([100, 102, 99]))
    assert steady["stable"] and steady["spread"] < 0.05
    noisy = summarize_export(export([100, 40, 100]))
    assert not noisy["stable"] and noisy["spread"] == pytest.approx(0.6)
    assert noisy["window_tokens_per_s"] == pytest.approx([100, 40, 100])
    assert noisy["output_tokens_per_s"] == pytest.approx(80)
    table = format_sweep({"modes": {"plain": {"1": steady}, "speculative": {"1": noisy}}})
    assert "unstable" in table and "speculative c=1: windows 100.0, 40.0, 100.0" in table


def test_perf_measures_throughput_while_every_stream_runs_not_the_drain():
    """Two streams of 1-second requests streaming 10 tokens; the last one sent runs 10 s alone
    (the drain): the run's figure drops with it, the steady one does not."""
    streamed = [(0.05 + 0.1 * j, 1) for j in range(10)]
    requests = [request(i, [(i + t, n) for t, n in streamed]) for i in range(6) for _ in range(2)]
    requests.append(request(6, [(6 + t, 1) for t in range(1, 11)]))
    summary = summarize_export({"experiments": [{"requests": requests}]})
    assert summary["output_tokens_per_s"] == pytest.approx(20)
    assert summary["run_tokens_per_s"] == pytest.approx((12 * 10 + 10) / 16)


def test_an_error_body_with_status_200_is_raised_not_returned_empty(monkeypatch):
    """Triton answers /generate with "stream": true by status 200 and an error body."""
    import io
    import urllib.request

    from client.api.triton import http_generate

    body = b'{"error": "generate expects model to produce exactly 1 response, use generate stream"}'
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: io.BytesIO(body))
    with pytest.raises(GenerationError, match="use generate stream"):
        http_generate("127.0.0.1:1", "hi")


def test_bench_names_the_engine_the_verifier_logged(tmp_path):
    from client.cli.bench import engine_from_log

    log = tmp_path / "server.log"
    log.write_text(
        "I1201 starting\nINFO tritonspec.target: target runs on the lean runtime, batch-invariant on: "
        "KV pool of 65536 tokens (1.41 GB)\n"
    )
    assert engine_from_log(log) == "lean runtime, batch-invariant on"
    log.write_text("INFO target runs through transformers (runtime=hf, device cpu), not batch-invariant\n")
    assert engine_from_log(log) == "transformers (runtime=hf, device cpu), not batch-invariant"
    log.write_text("nothing\n")
    assert engine_from_log(log).startswith("unknown")


def test_bench_reports_tree_nodes_per_step_and_runs_tree_variants_as_their_method():
    from backends.config import SpeculativeConfig
    from client.api.triton import Generation
    from client.cli.bench import METHOD_CONFIGS, base_method, compare, format_report

    def run(drafts: int, nodes: int, accepted: int) -> Generation:
        metrics = {
            "num_steps": drafts + 1,
            "num_drafts": drafts,
            "num_draft_tokens": nodes,
            "num_accepted_tokens": accepted,
            "accepted_per_position": [accepted],
            "draft_ms": 1.0,
            "verify_ms": 10.0,
            "overhead_ms": 1.0,
            "total_ms": 12.0,
        }
        return Generation(output_ids=[1, 2], num_output_tokens=2, seconds=0.1, perf_metrics=metrics)

    runs = {"code": {"plain": [run(0, 0, 0)], "speculative": [run(4, 40, 6), run(2, 12, 2)]}}
    result = compare(runs)["code"]["speculative"]
    assert result["nodes_per_step"] == 52 / 6 and result["mean_acceptance_length"] == 1 + 8 / 6
    text = format_report(
        {
            "prompt_set": 2,
            "max_tokens": 8,
            "repeats": 1,
            "model": "m",
            "dtype": "bfloat16",
            "methods": {"x": compare(runs)},
        }
    )
    assert "nodes" in text.splitlines()[1] and " 8.7 " in text.splitlines()[2]
    assert base_method("eagle3+tree") == "eagle3" and base_method("suffix") == "suffix"
    trees = [name for name in METHOD_CONFIGS if name.endswith("+tree")]
    assert {base_method(n) for n in trees} == {"suffix", "draft_model", "medusa", "eagle", "eagle3", "mtp"}
    assert all(base_method(n) in METHOD_CONFIGS for n in trees)  # each beside its chain
    SpeculativeConfig.from_json(METHOD_CONFIGS["suffix+tree"])  # the variants are valid configs


def test_bench_reports_time_to_first_token_and_decode_speed_after_it():
    from client.api.triton import Generation
    from client.cli.bench import summarize

    metrics = {
        "num_steps": 4,
        "num_drafts": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "accepted_per_position": [],
        "draft_ms": 0.0,
        "verify_ms": 1.0,
        "overhead_ms": 1.0,
        "total_ms": 2.0,
    }
    runs = [
        Generation(num_output_tokens=5, seconds=1.0, first_token_s=0.6, perf_metrics=metrics),
        Generation(num_output_tokens=9, seconds=2.0, first_token_s=0.4, perf_metrics=metrics),
        Generation(num_output_tokens=3, seconds=3.0, first_token_s=2.0, perf_metrics=metrics),
    ]
    summary = summarize(runs)
    assert summary["ttft_ms"] == 600.0  # the median
    assert summary["decode_tokens_per_s"] == (4 + 8 + 2) / (0.4 + 1.6 + 1.0)


def test_the_long_prompt_set_has_its_four_shapes_at_their_sizes():
    from client.cli.bench import load_prompts

    version, prompts = load_prompts(prompt_set="long")
    assert version.startswith("long") and set(prompts) == {"rag-2k", "rag-8k", "code-edit", "chat-30"}
    assert all(len(texts) == 2 for texts in prompts.values())
    # Characters, not tokens (no tokenizer here): ~3-4 per token in this Markdown.
    assert all(5_000 < len(t) < 9_000 for t in prompts["rag-2k"])
    assert all(20_000 < len(t) < 34_000 for t in prompts["rag-8k"])
    assert all(t.count("<|im_start|>user") == 31 for t in prompts["chat-30"])
    with pytest.raises(ValueError, match="unknown prompt categories"):
        load_prompts(["rag"], prompt_set="long")


def test_bench_runs_a_profiles_drafter_settings_for_its_method_and_tree():
    from client.cli.bench import METHOD_CONFIGS, method_config
    from client.cli.common import PROFILES

    qwen = PROFILES["qwen-coder"]["speculative_config"]
    assert method_config("draft_model", qwen) == qwen
    tree = method_config("draft_model+tree", qwen)  # the profile's quantized drafter, drafting trees
    assert tree["quantization"] == qwen["quantization"] == "int4" and tree["model"] == qwen["model"]
    assert tree["speculative_token_tree"] == METHOD_CONFIGS["draft_model+tree"]["speculative_token_tree"]
    eagle3 = method_config("eagle3+tree", PROFILES["smollm2-eagle3"]["speculative_config"])
    # the tree's own depth, not the profile's chain k; the profile's int8 head
    assert eagle3 == {**METHOD_CONFIGS["eagle3+tree"], "quantization": "int8"}
    assert method_config("ngram", qwen) == METHOD_CONFIGS["ngram"]  # another method: its own settings


def test_bench_spec_overrides_go_into_every_methods_config(capsys):
    from client.cli.main import build_parser
    from client.cli.measure_commands import _bench_config

    args = build_parser().parse_args(
        ["bench", "--num-speculative-tokens", "32", "--spec-overrides", '{"suffix_decoding_max_tree_depth": 64}']
    )
    config = _bench_config(args, "suffix", None)
    assert config == {"method": "suffix", "num_speculative_tokens": 32, "suffix_decoding_max_tree_depth": 64}
    for bad, why in (("[64]", "expected a JSON object"), ("{depth", "not JSON")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "--spec-overrides", bad])
        assert why in capsys.readouterr().err


def test_verify_cost_runs_at_a_block_sized_context_and_names_what_does_not_fit(tiny_model_dir):
    """A context of whole KV blocks used to fail on its repeats (prefix caching kept the
    prompt's blocks); arguments that cannot run say which."""
    from client.cli.bench import verify_batch_cost

    cost = verify_batch_cost(tiny_model_dir, "float32", 2, 3, context=32, repeats=2, runtime="lean")
    assert cost["one_ms"] > 0 and cost["batch_ms"] > 0 and cost["plain_ms"] > 0
    with pytest.raises(ValueError, match="--batch >= 1"):
        verify_batch_cost(tiny_model_dir, "float32", 0, 3)
    with pytest.raises(ValueError, match="do not fit the model's window"):
        verify_batch_cost(tiny_model_dir, "float32", 1, 3, context=10**6)
