import json

import pytest

from backends.serving.request import RequestError, parse_request


def test_defaults_follow_vllm():
    r = parse_request({"text_input": "hi"})
    assert r.max_tokens == 16 and r.sampling.greedy and not r.stream and not r.exclude_input_in_output
    assert r.num_draft_tokens is None and r.stop == []


def test_precedence_tensors_over_sampling_parameters_over_request_parameters():
    r = parse_request(
        {"text_input": "hi", "max_tokens": 5},
        parameters_json=json.dumps({"max_tokens": 7, "temperature": 0.5, "top_k": 3}),
        sampling_json=json.dumps({"max_tokens": "9", "temperature": "0.7"}),
    )
    assert (r.max_tokens, r.sampling.temperature, r.sampling.top_k) == (5, 0.7, 3)


def test_genai_perf_style_strings_and_names():
    r = parse_request(
        {"text_input": "hi", "stream": True}, sampling_json='{"max_tokens": "16", "seed": "3", "stop": "END"}'
    )
    assert (r.max_tokens, r.sampling.seed, r.stop, r.exclude_input_in_output) == (16, 3, ["END"], True)


def test_disabled_top_k_top_p_become_none():
    r = parse_request({"text_input": "hi", "top_k": 0, "top_p": 1.0})
    assert r.sampling.top_k is None and r.sampling.top_p is None
    assert parse_request({"text_input": "hi", "top_k": -1}).sampling.top_k is None


def test_http_generate_echoes_input_names_as_parameters():
    # Triton's /generate also lists the JSON keys that matched inputs as parameters.
    r = parse_request({"text_input": "hi"}, parameters_json='{"text_input": "hi", "max_tokens": 3}')
    assert r.max_tokens == 3


@pytest.mark.parametrize(
    "tensors,params,sampling,message",
    [
        ({}, "", "", "text_input is required"),
        ({"text_input": "  "}, "", "", "text_input is empty"),
        ({"text_input": "x", "max_tokens": 0}, "", "", "max_tokens must be at least 1"),
        ({"text_input": "x"}, "", '{"max_tokens": 2.5}', "max_tokens must be an integer"),
        ({"text_input": "x"}, "", '{"max_tokens": true}', "max_tokens must be an integer"),
        ({"text_input": "x"}, "", "[1, 2]", "sampling_parameters must be a JSON object"),
        ({"text_input": "x"}, "", "{bad", "sampling_parameters is not valid JSON"),
        ({"text_input": "x"}, '{"beam_width": 2}', "", "unknown key 'beam_width' in request parameters"),
        ({"text_input": "x"}, "", '{"n": 2}', "n is only supported at its default 1, got 2"),
        (
            {"text_input": "x"},
            "",
            '{"prompt_logprobs": 25}',
            "prompt_logprobs must be -1 (the whole vocabulary) or in [0, 20] (alternatives per prompt token), got 25",
        ),
        ({"text_input": "x", "temperature": -1.0}, "", "", "temperature must be >= 0"),
        ({"text_input": "x"}, "", '{"temperature": NaN}', "temperature must be a finite number, got nan"),
        ({"text_input": "x", "top_p": float("inf")}, "", "", "top_p must be a finite number"),
        ({"text_input": "x", "top_p": 0.0}, "", "", "top_p must be in (0, 1]"),
        ({"text_input": "x", "top_k": -5}, "", "", "top_k must be -1, 0"),
        ({"text_input": "x"}, "", '{"seed": -1}', "seed must be a non-negative"),
        ({"text_input": "x", "num_draft_tokens": -2}, "", "", "num_draft_tokens must be >= 0"),
        ({"text_input": "x", "stream": True, "exclude_input_in_output": False}, "", "", "not supported with stream"),
        ({"text_input": "x"}, "", '{"stop": 5}', "stop must be a string or a list"),
        ({"text_input": "x"}, "", '{"ignore_eos": "maybe"}', "ignore_eos must be a boolean"),
    ],
)
def test_bad_requests_name_the_problem(tensors, params, sampling, message):
    with pytest.raises(RequestError) as err:
        parse_request(tensors, params, sampling)
    assert message in str(err.value)
