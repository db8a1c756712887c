"""vLLM's SamplingParams keys in `sampling_parameters`: its complete default dict changes
nothing; what is not served is refused by name with what to do instead; allowed_token_ids and
min_p are served, as controls on the target's logits that verification samples from, so
speculative output stays what plain decoding gives."""

from __future__ import annotations

import json
import math

import pytest
import torch

from backends.serving.logits import process_logits
from backends.serving.rejection import apply_temperature_top_k_top_p, rejection_sample
from backends.serving.request import RequestError, SamplingParams, bind_token_ids, parse_request
from backends.serving.target import VerifyRequest
from tests.fixtures.vllm_defaults import VLLM_DEFAULTS

PROMPT = "def add(a, b):\n    return a + b\ndef add(a, b):"


def parse(sampling: dict, **tensors):
    return parse_request({"text_input": "hi", **tensors}, "", json.dumps(sampling))


def refusal(sampling: dict) -> str:
    with pytest.raises(RequestError) as err:
        parse(sampling)
    return str(err.value)


# -------------------------------------------------------------------------- the default dict


@pytest.mark.parametrize("version", VLLM_DEFAULTS)
def test_vllms_complete_default_dict_changes_nothing(version):
    defaults = VLLM_DEFAULTS[version]
    # Its only value that differs from this server's defaults is temperature 1.0 (vLLM samples).
    assert parse(defaults) == parse({"temperature": 1.0})
    assert parse({**defaults, "temperature": 0.0}) == parse({})
    assert parse({**defaults, "seed": 7}) == parse({"temperature": 1.0, "seed": 7})


def test_null_is_the_default_for_every_key():
    assert parse({"max_tokens": None, "temperature": None, "stop": None, "n": None, "logit_bias": None}) == parse({})


@pytest.mark.parametrize("kind", [0, 1, 2, "CUMULATIVE", "delta", "RequestOutputKind.FINAL_ONLY"])
def test_every_output_kind_is_neutral_the_stream_flag_decides(kind):
    assert parse({"output_kind": kind}) == parse({})


@pytest.mark.parametrize(
    "sampling,message",
    [
        ({"n": 2}, "n is only supported at its default 1, got 2: send separate requests"),
        ({"best_of": 3}, "best_of is only supported at its default 1, got 3: send separate requests"),
        ({"use_beam_search": True}, "use_beam_search is only supported at its default false, got True: beam search"),
        ({"length_penalty": 0.5}, "length_penalty is only supported at its default 1.0"),
        ({"prompt_logprobs": -3}, "prompt_logprobs must be -1 (the whole vocabulary) or in [0, 20]"),
        ({"prompt_logprob_start": 4}, "prompt_logprob_start is not supported, got 4: prompt logprobs start at"),
        ({"logprob_token_ids": [1, 2]}, "logprob_token_ids is not supported"),
        ({"truncate_prompt_tokens": 5}, "truncate_prompt_tokens is not supported, got 5: shorten the prompt"),
        ({"logits_processors": ["f"]}, "logits_processors is only supported at its default []"),
        ({"extra_args": {"x": 1}}, "extra_args is only supported at its default {}"),
        ({"thinking_token_budget": 100}, "thinking_token_budget is only supported at its default -1"),
        ({"lora_name": "sql"}, "lora_name is not supported, got 'sql': LoRA adapters are not served"),
        ({"detokenize": False}, "detokenize is only supported at its default true"),
        ({"output_kind": "PARTIAL"}, "output_kind must be one of CUMULATIVE, DELTA, FINAL_ONLY"),
        ({"output_kind": True}, "output_kind must be one of"),
        ({"stop": [""]}, "stop cannot contain an empty string"),
        ({"stop": ["end", ""]}, "stop cannot contain an empty string"),
        ({"stop": ""}, "stop cannot contain an empty string"),
        ({"min_p": 1.5}, "min_p must be in [0, 1] (0: off), got 1.5"),
        ({"min_p": -0.1}, "min_p must be in [0, 1]"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list of token ids"),
        ({"allowed_token_ids": 5}, "allowed_token_ids must be a non-empty list of token ids"),
        ({"allowed_token_ids": [1, "x"]}, "allowed_token_ids must be an integer"),
        ({"beam_width": 2}, "unknown key 'beam_width' in sampling_parameters"),
    ],
)
def test_what_is_not_served_is_refused_by_name(sampling, message):
    assert message in refusal(sampling)


def test_trt_llms_empty_stop_words_still_mean_none():
    """tensorrtllm_backend's examples send "stop_words": "" and "bad_words": ""."""
    assert parse({"stop_words": "", "bad_words": ""}) == parse({})
    assert parse({}, stop_words=[""]).stop == []


# -------------------------------------------------------------------------- allowed_token_ids, min_p


def test_allowed_token_ids_and_min_p_reach_the_verifier():
    req = parse({"allowed_token_ids": [9, 3, 9], "min_p": 0.1, "temperature": 0.8})
    assert req.sampling.allowed_token_ids == (3, 9) and req.sampling.min_p == pytest.approx(0.1)
    assert req.sampling.processes_logits
    assert SamplingParams.from_json(req.sampling.to_json()) == req.sampling
    greedy = parse({"min_p": 0.1})  # vLLM turns min_p off for greedy requests: the argmax is kept anyway
    assert greedy.sampling.min_p == 0.0 and not greedy.sampling.processes_logits
    with pytest.raises(RequestError, match="sampling parameter min_p must be a number in"):
        SamplingParams.from_json(json.dumps({**json.loads(req.sampling.to_json()), "min_p": 2}))


def test_allowed_token_ids_are_checked_against_the_vocabulary(tokenizer):
    with pytest.raises(RequestError, match=r"allowed_token_ids: token id 100 is outside the vocabulary \[0, 100\)"):
        bind_token_ids(parse({"allowed_token_ids": [5, 100]}), tokenizer, {0}, vocab_size=100)


def test_the_mask_and_min_p_follow_vllms_formulas():
    torch.manual_seed(0)
    logits = torch.randn(3, 40) * 3
    sampling = SamplingParams(temperature=0.7, min_p=0.05, allowed_token_ids=(1, 4, 9, 16, 25, 36))
    got = process_logits(logits, sampling, [], [[], [], []], [])
    for row, out in zip(logits, got):
        expected = torch.full_like(row, -math.inf)
        allowed = list(sampling.allowed_token_ids)
        expected[allowed] = row[allowed]
        # vLLM's MinPLogitsProcessor, on the temperature-scaled probabilities
        probs = torch.softmax(expected / sampling.temperature, -1)
        expected[probs < sampling.min_p * probs.max()] = -math.inf
        assert torch.equal(torch.isinf(out), torch.isinf(expected))
        torch.testing.assert_close(out[~torch.isinf(out)], row[~torch.isinf(expected)])
        assert 1 <= int((~torch.isinf(out)).sum()) < len(allowed)  # min_p dropped some allowed tokens


def test_drafts_are_verified_against_the_min_p_distribution():
    """Rejection sampling on the processed logits: a draft min_p drops is never accepted, and
    the emitted token follows softmax(logits / T) restricted to min_p's survivors."""
    torch.manual_seed(1)
    logits = torch.randn(2, 12) * 2  # [draft row, bonus row]
    sampling = SamplingParams(temperature=1.0, min_p=0.3)
    processed = process_logits(logits, sampling, [], [[], [0]], [])
    exact = apply_temperature_top_k_top_p(processed[:1], torch.tensor([1.0]))[0]
    dropped = int(torch.nonzero(torch.isinf(processed[0]))[0])
    generator = torch.Generator().manual_seed(3)
    draws = 4000
    counts = torch.zeros(12)
    for _ in range(draws):
        first = rejection_sample([dropped], processed, None, SamplingParams(temperature=1.0), generator)[0]
        counts[first] += 1
    assert counts[dropped] == 0
    total_variation = 0.5 * (counts / draws - exact).abs().sum().item()
    assert total_variation < 0.03, total_variation  # ~0.01 expected at 4000 draws; ignoring min_p: > 0.1
    assert 0.5 * (counts / draws - torch.softmax(logits[0], -1)).abs().sum().item() > 0.1


def test_greedy_with_allowed_token_ids_verified_with_drafts_equals_plain_decoding(runner, tokenizer):
    prompt = tokenizer(PROMPT)["input_ids"]

    def decode(seq_id: int, sampling: SamplingParams, drafts_from: list[int] | None, n: int = 20) -> list[int]:
        out, new = [], prompt
        while len(out) < n:
            k = min(3, n - len(out) - 1)
            drafts = [] if drafts_from is None else list(drafts_from[len(out) : len(out) + k])
            if drafts and len(out) % 2:
                drafts[-1] = (drafts[-1] + 1) % len(tokenizer)  # a wrong draft now and then
            out += runner.verify(VerifyRequest(seq_id, new, drafts, sampling, max_new_tokens=n)).token_ids
            new = []
        runner.release(seq_id)
        return out[:n]

    free = decode(2001, SamplingParams(), None)
    allowed = tuple(sorted(set(free[::2]) | set(range(10))))  # half of what it would write
    sampling = SamplingParams(allowed_token_ids=allowed)
    plain = decode(2002, sampling, None)
    assert plain != free and set(plain) <= set(allowed)
    assert decode(2003, sampling, plain) == plain
