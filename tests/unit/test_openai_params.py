"""The OpenAI front end's parameters in process: response_format and vLLM's structured-output
extras become the constraint the model reads, vLLM's served extras (min_p, allowed_token_ids)
reach it, and every other parameter is accepted at a value that changes nothing or refused
by name (param set), never ignored."""

from __future__ import annotations

import json

import pytest

from backends.serving.request import parse_request
from backends.structured.spec import StructuredOutputs
from client.api.openai_frontend import choice_inputs
from client.api.openai_http import OpenAIError
from client.api.openai_params import sampling_inputs

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def model_request(body: dict, kind: str = "chat"):
    """What the `speculative` model reads from the inputs the front end sends for `body`."""
    inputs = sampling_inputs(body, 16, kind)
    sampling = inputs.pop("sampling_parameters", {})
    tensors = {"text_input": "hi", **{k: v for k, v in inputs.items() if k not in ("stop_words", "bad_words")}}
    return parse_request(tensors, "", json.dumps(sampling))


def refused(body: dict, kind: str = "chat") -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        sampling_inputs(body, 16, kind)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    "body,expected",
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputs("json_object", "")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "w", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputs("json", json.dumps(SCHEMA, separators=(",", ":"))),
        ),
        ({"guided_regex": "[0-9]{3}"}, StructuredOutputs("regex", "[0-9]{3}")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutputs("choice", '["yes","no"]')),
        ({"guided_grammar": "root ::= [a-z]+"}, StructuredOutputs("grammar", "root ::= [a-z]+")),
        (
            {"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"},
            StructuredOutputs("json", json.dumps(SCHEMA, separators=(",", ":")), " ?"),
        ),
        ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputs("choice", '["a","b"]')),
    ],
)
def test_response_format_and_vllms_extras_become_the_models_constraint(body, kind, expected):
    assert model_request(body, kind).structured == expected


def test_a_structural_tag_response_format_is_passed_on_whole():
    fmt = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    got = model_request({"response_format": fmt}).structured
    assert got.kind == "structural_tag" and json.loads(got.spec) == fmt


@pytest.mark.parametrize(
    "body,param,message",
    [
        ({"response_format": {"type": "xml"}}, "response_format", "must have type text, json_object, json_schema"),
        ({"response_format": "json"}, "response_format", "must have type text"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs 'json_schema'"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "response_format",
            "send response_format or structured_outputs, not both",
        ),
        ({"use_beam_search": True}, "use_beam_search", "beam search is not served"),
        ({"prompt_logprobs": -2}, "prompt_logprobs", "'prompt_logprobs' must be an integer in [-1, "),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available when 'stream' is true"),
        ({"prompt_logprobs": -1, "stream": True}, "prompt_logprobs", "not available when 'stream' is true"),
        ({"truncate_prompt_tokens": 10}, "truncate_prompt_tokens", "shorten the prompt"),
        ({"length_penalty": 2.0}, "length_penalty", "beam search"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output", "ends before the stop string"),
        ({"tool_choice": "required"}, "tool_choice", "tool calling is not supported"),
        ({"modalities": ["text", "audio"]}, "modalities", "only text is served"),
        ({"priority": 5}, "priority", "first come, first served"),
        ({"echo": True}, "echo", "'echo' is not supported in chat completions"),
        ({"frobnicate": 1}, "frobnicate", "unsupported parameter 'frobnicate'"),
        ({"min_p": 2}, "min_p", "'min_p' must be in [0, 1]"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "must be a non-empty list of token ids"),
    ],
)
def test_what_is_not_served_is_refused_by_name(body, param, message):
    error = refused(body)
    assert error.param == param and message in error.message, error.message


def test_neutral_values_and_bookkeeping_change_nothing():
    neutral = {
        "use_beam_search": False,
        "prompt_logprobs": None,
        "length_penalty": 1.0,
        "skip_special_tokens": True,
        "add_generation_prompt": True,
        "tool_choice": "none",
        "parallel_tool_calls": True,
        "modalities": ["text"],
        "user": "u-1",
        "metadata": {"team": "x"},
        "store": False,
        "service_tier": "auto",
        "echo": False,
        "min_p": 0,
        "response_format": {"type": "text"},
    }
    assert sampling_inputs(neutral, 16, "chat") == sampling_inputs({}, 16, "chat")
    assert sampling_inputs({"echo": True, "suffix": None}, 16, "completion") == sampling_inputs({}, 16, "completion")


def test_min_p_and_allowed_token_ids_reach_the_model():
    req = model_request({"min_p": 0.2, "temperature": 0.9, "allowed_token_ids": [4, 2]})
    assert req.sampling.min_p == pytest.approx(0.2) and req.sampling.allowed_token_ids == (2, 4)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_prompt_logprobs_reach_the_model(kind):
    assert model_request({"prompt_logprobs": 3}, kind).sampling.prompt_logprobs == 3
    assert model_request({"prompt_logprobs": 0, "stream": True}, kind).sampling.prompt_logprobs == 0  # as vLLM
    assert model_request({}, kind).sampling.prompt_logprobs is None


def test_n_choices_carry_the_requests_n_once_per_prompt():
    """vllm:request_params_n observes n once per prompt: its first choice says n, the others 0."""
    inputs = {"max_tokens": 4, "random_seed": 7, "sampling_parameters": {"min_p": 0.1}}
    choices = [choice_inputs(inputs, j, 3) for j in range(3)]
    assert [c["sampling_parameters"]["params_n"] for c in choices] == [3, 0, 0]
    assert [c["random_seed"] for c in choices] == [7, 8, 9] and all(c["sampling_parameters"]["min_p"] for c in choices)
    assert choice_inputs(inputs, 0, 1) == inputs  # n = 1: the inputs as they are (the model's default is 1)
    requests = [parse_request({"text_input": "hi"}, "", json.dumps(c["sampling_parameters"])) for c in choices]
    assert [r.params_n for r in requests] == [3, 0, 0] and parse_request({"text_input": "hi"}).params_n == 1
