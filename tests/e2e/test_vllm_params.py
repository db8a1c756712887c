"""vLLM's sampling keys through the real server (the tiny model, float32, ngram drafting):
its complete default SamplingParams dict gives the output of a request that sends nothing,
allowed_token_ids keeps speculative output equal to plain decoding, and what is not served
is refused by name, over gRPC and through `tritonspec openai` with the official SDK (where
it used to be ignored with HTTP 200)."""

from __future__ import annotations

import openai
import pytest

from client.api.triton import GenerationError, grpc_generate
from tests.e2e.test_openai_server import PROMPT, openai_api
from tests.fixtures.servers import free_ports
from tests.fixtures.vllm_defaults import VLLM_DEFAULTS

PROMPTS = [
    "def add(a, b):\n    return a + b\ndef add(a, b):",
    "The quick brown fox jumps over the lazy dog. The quick brown",
]


@pytest.mark.parametrize("version", VLLM_DEFAULTS)
def test_vllms_default_dict_gives_the_output_of_sending_nothing(tiny_server, version):
    defaults = VLLM_DEFAULTS[version]
    for prompt in PROMPTS:
        nothing = grpc_generate(tiny_server.grpc_url, prompt, stream=False)
        greedy = grpc_generate(
            tiny_server.grpc_url, prompt, stream=False, sampling_parameters={**defaults, "temperature": 0}
        )
        assert greedy.output_ids == nothing.output_ids and greedy.text == nothing.text
        # As sent, the dict samples at temperature 1 (vLLM's default): with a seed, exactly
        # what temperature 1 and that seed give alone.
        sampled = grpc_generate(tiny_server.grpc_url, prompt, stream=True, sampling_parameters={**defaults, "seed": 11})
        alone = grpc_generate(
            tiny_server.grpc_url, prompt, stream=True, sampling_parameters={"temperature": 1.0, "seed": 11}
        )
        assert sampled.output_ids == alone.output_ids


def test_allowed_token_ids_speculative_equals_plain(tiny_server):
    accepted = 0
    for prompt in PROMPTS:
        free = grpc_generate(tiny_server.grpc_url, prompt, max_tokens=24, num_draft_tokens=0)
        allowed = sorted(set(free.output_ids[::2]) | set(range(20)))
        params = {"allowed_token_ids": allowed}
        plain = grpc_generate(
            tiny_server.grpc_url, prompt, max_tokens=24, num_draft_tokens=0, sampling_parameters=params
        )
        spec = grpc_generate(
            tiny_server.grpc_url, prompt, max_tokens=24, num_draft_tokens=4, sampling_parameters=params
        )
        assert plain.output_ids != free.output_ids and set(plain.output_ids) <= set(allowed)
        assert spec.output_ids == plain.output_ids
        accepted += spec.total_accepted_draft_tokens
    assert accepted > 0  # drafts were verified under the mask


@pytest.mark.parametrize(
    "params,message",
    [
        ({"n": 2}, "n is only supported at its default 1, got 2: send separate requests"),
        ({"use_beam_search": True}, "use_beam_search is only supported at its default false"),
        ({"prompt_logprobs": 1}, "prompt_logprobs is not supported"),
        ({"best_of": 2}, "best_of is only supported at its default 1"),
        ({"stop": [""]}, "stop cannot contain an empty string"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids: token id 1000000 is outside the vocabulary"),
    ],
)
def test_what_is_not_served_is_refused_by_name_over_grpc(tiny_server, params, message):
    with pytest.raises(GenerationError) as err:
        grpc_generate(tiny_server.grpc_url, PROMPT, stream=False, sampling_parameters=params)
    assert message in str(err.value)


# ------------------------------------------------------------------ the OpenAI front end


@pytest.fixture(scope="module")
def client(tiny_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai-params")
    with openai_api(free_ports(1)[0], tiny_server.grpc_url, tmp / "openai.log") as front:
        yield openai.OpenAI(base_url=f"{front.base}/v1", api_key="unused", max_retries=0)


def test_unsupported_openai_parameters_are_refused_by_name(client):
    for extra, param in [
        ({"use_beam_search": True}, "use_beam_search"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
        ({"no_such_parameter": 1}, "no_such_parameter"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),  # the model's range, named in `param`
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="speculative", prompt=PROMPT, max_tokens=4, extra_body=extra)
        assert info.value.body["param"] == param, (extra, info.value.body)


def test_served_vllm_extras_and_neutral_values_pass(client, tiny_server):
    neutral = {"use_beam_search": False, "prompt_logprobs": None, "skip_special_tokens": True, "min_p": 0.0}
    got = client.completions.create(model="speculative", prompt=PROMPT, max_tokens=8, temperature=0, extra_body=neutral)
    plain = grpc_generate(tiny_server.grpc_url, PROMPT, max_tokens=8, stream=False, exclude_input_in_output=True)
    assert got.choices[0].text == plain.text
    allowed = list(range(60))
    masked = client.completions.create(
        model="speculative", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"allowed_token_ids": allowed}
    )
    ref = grpc_generate(
        tiny_server.grpc_url,
        PROMPT,
        max_tokens=8,
        stream=False,
        exclude_input_in_output=True,
        sampling_parameters={"allowed_token_ids": allowed},
    )
    assert masked.choices[0].text == ref.text and set(ref.output_ids) <= set(allowed)
