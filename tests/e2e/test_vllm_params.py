"""vLLM's sampling keys through the real server (the tiny model, float32, ngram drafting):
its complete default SamplingParams dict gives the output of a request that sends nothing,
allowed_token_ids keeps speculative output equal to plain decoding, and what is not served
is refused by name, over gRPC and through `tritonspec openai` with the official SDK (where
it used to be ignored with HTTP 200)."""

from __future__ import annotations

import openai
import pytest
import torch

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
        ({"prompt_logprobs": -2}, "prompt_logprobs must be -1 (the whole vocabulary) or in [0, 20]"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be at most 20 (max allowed), got -1: the whole vocabulary"),
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
        ({"prompt_logprobs": 21}, "prompt_logprobs"),  # over the model's limit, named in `param`
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


# ------------------------------------------------------------------ prompt_logprobs

# Over 128 tokens: the server prefills it in two chunks (prefill_chunk_tokens), so the token
# after the first chunk is scored by that chunk's last position.
LONG_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 14)


def check_prompt_logprobs(entries: list, prompt_ids: list[int], reference, top: int) -> None:
    """vLLM's shape: null for the first token, then {token id: {logprob, rank, decoded_token}}
    with the prompt token and the `top` most likely, values those of the target's own forward."""
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for t, entry in enumerate(entries[1:], start=1):
        row = reference[t - 1]
        token = entry[str(prompt_ids[t])]
        assert token["logprob"] == pytest.approx(row[prompt_ids[t]].item(), abs=1e-4)
        assert token["rank"] == int((row >= row[prompt_ids[t]]).sum())
        best = sorted((v["rank"], int(i)) for i, v in entry.items() if v["rank"] <= top)
        assert [i for _, i in best] == row.topk(top).indices.tolist() and len(entry) in (top, top + 1)


@pytest.fixture(scope="module")
def long_reference(tiny_model_dir):
    from transformers import AutoTokenizer

    from tests.fixtures.helpers import load_hf_model

    ids = AutoTokenizer.from_pretrained(tiny_model_dir)(LONG_PROMPT)["input_ids"]
    model, _ = load_hf_model(str(tiny_model_dir))
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    assert len(ids) > 128
    return ids, logprobs


@pytest.mark.parametrize("server_name", ["tiny_server", "bls_server"])
@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_over_grpc_are_the_targets_and_leave_the_output_as_it_was(
    request, server_name, stream, long_reference
):
    """In the orchestrator's process (ngram) and across the wire from the verifier model
    (EAGLE): on the first response, every prompt token's logprob and rank and the 2 most likely."""
    server = request.getfixturevalue(server_name)
    ids, reference = long_reference
    plain = grpc_generate(server.grpc_url, LONG_PROMPT, stream=stream, max_tokens=12)
    scored = grpc_generate(
        server.grpc_url, LONG_PROMPT, stream=stream, max_tokens=12, sampling_parameters={"prompt_logprobs": 2}
    )
    assert scored.output_ids == plain.output_ids and plain.prompt_logprobs is None
    check_prompt_logprobs(scored.prompt_logprobs, ids, reference, top=2)


def test_prompt_logprobs_on_the_openai_completions_choice(client, long_reference):
    ids, reference = long_reference
    out = client.completions.create(
        model="speculative", prompt=LONG_PROMPT, max_tokens=4, temperature=0, n=2, extra_body={"prompt_logprobs": 1}
    )
    for choice in out.choices:  # each choice of the prompt carries them, as vLLM's
        check_prompt_logprobs(choice.model_extra["prompt_logprobs"], ids, reference, top=1)
    plain = client.completions.create(model="speculative", prompt=LONG_PROMPT, max_tokens=4, temperature=0)
    assert "prompt_logprobs" not in plain.choices[0].model_extra and plain.choices[0].text == out.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="speculative", prompt=PROMPT, max_tokens=4, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert info.value.body["param"] == "prompt_logprobs"


def test_prompt_logprobs_on_http_generate_as_logprobs_are(tiny_server, long_reference):
    """Triton's /generate: the prompt_logprobs output, JSON text as the logprobs output is."""
    import json
    import urllib.request

    ids, reference = long_reference
    sampling = json.dumps({"prompt_logprobs": 1, "logprobs": 1})
    body = {"text_input": LONG_PROMPT, "max_tokens": 4, "sampling_parameters": sampling, "return_logprobs": True}
    url = f"http://{tiny_server.http_url}/v2/models/speculative/generate"
    with urllib.request.urlopen(urllib.request.Request(url, data=json.dumps(body).encode()), timeout=60) as response:
        answer = json.loads(response.read())
    check_prompt_logprobs(json.loads(answer["prompt_logprobs"]), ids, reference, top=1)
    assert len(json.loads(answer["logprobs"])) == 4
