"""Penalties, token controls and logprobs in process: what parsing accepts, the logits
processing against a plain per-position reference, and verification with drafts giving
exactly what plain decoding gives with the same settings."""

from __future__ import annotations

import json
import math

import pytest
import torch

from backends.serving.logits import process_logits, token_logprobs
from backends.serving.request import RequestError, SamplingParams, bad_words_token_ids, bind_token_ids, parse_request
from backends.serving.target import VerifyRequest
from tests.fixtures.helpers import load_hf_model

PROMPT = "def add(a, b):\n    return a + b\ndef add(a, b):"
CONTROLS = {
    "repetition_penalty": 1.3,
    "frequency_penalty": 0.7,
    "presence_penalty": 0.4,
    "min_tokens": 6,
    "logit_bias": {"40": 4.0, "41": -3.0},
    "bad_words": ["return"],
}


def parse(sampling: dict, **tensors):
    return parse_request({"text_input": "hi", **tensors}, "", json.dumps(sampling))


# -------------------------------------------------------------------------- parsing


def test_triton_openai_frontend_defaults_are_accepted():
    """What Triton's OpenAI frontend puts in sampling_parameters for a bare chat request
    (its schema's non-None defaults) changes nothing."""
    req = parse(
        {
            "frequency_penalty": 0,
            "n": 1,
            "presence_penalty": 0,
            "temperature": 0.7,
            "top_p": 1,
            "ignore_eos": False,
            "max_tokens": 8,
            "best_of": 1,
            "logprobs": None,
        }
    )
    assert not req.sampling.processes_logits and req.sampling.logprobs is None
    assert req.sampling.temperature == pytest.approx(0.7) and req.max_tokens == 8


@pytest.mark.parametrize(
    "neutral",
    [
        {"n": 1},
        {"best_of": "1"},
        {"min_p": 0},
        {"use_beam_search": False},
        {"skip_special_tokens": True},
        {"include_stop_str_in_output": False},
        {"repetition_penalty": 1},
        {"frequency_penalty": "0"},
        {"min_tokens": 0},
        {"logit_bias": {}},
        {"bad_words": []},
        {"stop_token_ids": []},
    ],
)
def test_values_that_change_nothing_are_accepted(neutral):
    assert not parse(neutral).sampling.processes_logits


@pytest.mark.parametrize(
    "sampling,message",
    [
        ({"n": 2}, "n is only supported at its default 1"),
        ({"best_of": 3}, "best_of is only supported at its default 1"),
        ({"min_p": 1.1}, "min_p must be in [0, 1]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 100]"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be in [0, max_tokens=10]"),
        ({"logit_bias": {"5": 101}}, "logit_bias[5] must be in [-100, 100]"),
        ({"logit_bias": [5]}, "logit_bias must be an object"),
        ({"logprobs": 21}, "logprobs must be in [0, 20]"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be token ids"),
    ],
)
def test_out_of_range_controls_are_refused_by_name(sampling, message):
    with pytest.raises(RequestError) as err:
        parse(sampling)
    assert message in str(err.value)


def test_controls_arrive_as_tensors_json_or_parameters_and_round_trip_to_the_verifier():
    req = parse(
        {"logprobs": 3, "stop_token_ids": [7], "logit_bias": {"9": 1.5}},
        repetition_penalty=1.2,
        min_length=2,
        return_logprobs=True,
        return_num_output_tokens=1,
    )
    assert req.sampling.repetition_penalty == pytest.approx(1.2) and req.sampling.min_tokens == 2
    assert req.stop_token_ids == [7] and req.returns == {"logprobs", "num_output_tokens"}
    assert SamplingParams.from_json(req.sampling.to_json()) == req.sampling


def test_bind_checks_ids_against_the_vocabulary_and_names_the_held_back_tokens(tokenizer):
    req = parse({"min_tokens": 3, "stop_token_ids": [5], "bad_words": ["return"]})
    bound = bind_token_ids(req, tokenizer, {0}, vocab_size=100)
    assert bound.sampling.min_tokens_stop_ids == (0, 5)
    assert bound.sampling.bad_words_ids and all(isinstance(t, int) for w in bound.sampling.bad_words_ids for t in w)
    with pytest.raises(RequestError, match=r"logit_bias: token id 100 is outside the vocabulary \[0, 100\)"):
        bind_token_ids(parse({"logit_bias": {"100": 1}}), tokenizer, {0}, vocab_size=100)
    ignored = bind_token_ids(parse({"min_tokens": 3, "ignore_eos": True}), tokenizer, {0}, vocab_size=100)
    assert ignored.sampling.min_tokens_stop_ids == ()


def test_bad_words_tokenize_alone_and_after_a_space_as_vllm_does(tokenizer):
    ids = bad_words_token_ids(["return", "  fox"], tokenizer)
    encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    assert ids[0] == encode("return")
    assert encode("fox") in ids
    for word in ("return", "fox"):  # the spaced form only as another sequence of the same length
        spaced = encode(" " + word)
        assert (spaced in ids) == (spaced[:1] != encode(word)[:1] and len(spaced) == len(encode(word)))


# -------------------------------------------------------------------------- processing


def reference_row(logits: torch.Tensor, sampling: SamplingParams, prompt: list[int], history: list[int]):
    """One position processed the obvious way, token by token (vLLM's formulas)."""
    row = logits.float().clone()
    for word in sampling.bad_words_ids:
        if list(word[:-1]) == history[len(history) - len(word) + 1 :] or len(word) == 1:
            row[word[-1]] = -math.inf
    if len(history) < sampling.min_tokens:
        for t in sampling.min_tokens_stop_ids:
            row[t] = -math.inf
    for t, bias in sampling.logit_bias:
        row[t] += bias
    for t in range(row.shape[0]):
        if t in prompt or t in history:
            row[t] = row[t] / sampling.repetition_penalty if row[t] > 0 else row[t] * sampling.repetition_penalty
        row[t] -= sampling.frequency_penalty * history.count(t) + sampling.presence_penalty * (t in history)
    return row


def controls(tokenizer, **overrides) -> SamplingParams:
    req = parse({**CONTROLS, **overrides})
    return bind_token_ids(req, tokenizer, {0}, vocab_size=len(tokenizer)).sampling


def test_each_row_is_processed_with_the_drafts_before_it(tokenizer):
    torch.manual_seed(0)
    sampling = controls(tokenizer)
    vocab = len(tokenizer)
    prompt, output, drafts = [3, 4, 5, 40], [40, 7, 7], [41, 7, 9]
    logits = torch.randn(len(drafts) + 1, vocab) * 3
    got = process_logits(logits, sampling, output, [drafts[:j] for j in range(len(drafts) + 1)], prompt)
    for j in range(len(drafts) + 1):
        expected = reference_row(logits[j], sampling, prompt, output + drafts[:j])
        torch.testing.assert_close(got[j], expected, rtol=1e-6, atol=1e-6)


def test_logprobs_are_the_raw_log_softmax_with_vllm_ranks():
    logits = torch.tensor([[2.0, 1.0, 3.0, 1.0], [0.0, 0.0, 0.0, 5.0]])
    out = token_logprobs(logits, [1, 3], num_top=2)
    expected = torch.log_softmax(logits, -1)
    assert out[0].token_id == 1 and out[0].logprob == pytest.approx(expected[0, 1].item())
    assert out[0].rank == 4  # tied with token 3: ties count as ahead
    assert [t for t, _ in out[0].top] == [2, 0] and out[1].rank == 1
    assert token_logprobs(logits, [1], num_top=0)[0].top == ()


# -------------------------------------------------------------------------- verification


def plain_decode(runner, seq_id: int, prompt: list[int], sampling: SamplingParams, n: int):
    """One token per verify step: the output and logprobs plain decoding gives."""
    out, logprobs = [], []
    new = prompt
    while len(out) < n:
        r = runner.verify(VerifyRequest(seq_id, new, [], sampling, max_new_tokens=n))
        out += r.token_ids
        logprobs += r.logprobs or []
        new = []
    runner.release(seq_id)
    return out, logprobs


def speculative_decode(
    runner, seq_id: int, prompt: list[int], sampling: SamplingParams, reference: list[int], k: int, corrupt_every: int
):
    """Drafts are the reference continuation, every `corrupt_every`-th one corrupted."""
    out, logprobs, accepted = [], [], 0
    new = prompt
    while len(out) < len(reference):
        drafts = list(reference[len(out) : len(out) + min(k, len(reference) - len(out) - 1)])
        if drafts and len(out) % corrupt_every == 0:
            drafts[-1] = (drafts[-1] + 1) % 50
        r = runner.verify(VerifyRequest(seq_id, new, drafts, sampling, max_new_tokens=len(reference)))
        out += r.token_ids
        logprobs += r.logprobs or []
        accepted += r.num_accepted
        new = []
    runner.release(seq_id)
    return out[: len(reference)], logprobs[: len(reference)], accepted


@pytest.mark.parametrize("extra", [{}, {"logprobs": 3}])
def test_greedy_with_controls_verified_with_drafts_equals_plain_decoding(runner, tokenizer, extra):
    sampling = controls(tokenizer, **extra)
    prompt = tokenizer(PROMPT)["input_ids"]
    plain, plain_logprobs = plain_decode(runner, 1001, prompt, sampling, 30)
    assert plain != plain_decode(runner, 1002, prompt, SamplingParams(), 30)[0]  # the controls matter
    spec, spec_logprobs, accepted = speculative_decode(runner, 1003, prompt, sampling, plain, k=4, corrupt_every=3)
    assert spec == plain and accepted > 10
    if "logprobs" in extra:
        assert [(p.token_id, p.rank) for p in spec_logprobs] == [(p.token_id, p.rank) for p in plain_logprobs]
        for s, p in zip(spec_logprobs, plain_logprobs):
            assert s.logprob == pytest.approx(p.logprob, abs=1e-5)
            assert [t for t, _ in s.top] == [t for t, _ in p.top] and len(s.top) == 3


def test_logprobs_are_the_targets_own_at_each_position(runner, tokenizer, target_dir):
    model, _ = load_hf_model(str(target_dir))
    prompt = tokenizer(PROMPT)["input_ids"]
    plain, _ = plain_decode(runner, 1004, prompt, SamplingParams(), 12)
    _, logprobs, _ = speculative_decode(runner, 1005, prompt, SamplingParams(logprobs=2), plain, k=4, corrupt_every=5)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + plain])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1)
    for i, p in enumerate(logprobs):
        assert p.logprob == pytest.approx(expected[i, plain[i]].item(), abs=1e-5)
        assert [t for t, _ in p.top] == expected[i].topk(2).indices.tolist()


def test_min_tokens_holds_eos_back_and_bad_words_never_appear(runner, tokenizer):
    prompt = tokenizer(PROMPT)["input_ids"]
    free, _ = plain_decode(runner, 1006, prompt, SamplingParams(), 20)
    banned = free[2]
    sampling = SamplingParams(bad_words_ids=((banned,),), min_tokens=20, min_tokens_stop_ids=(free[0],))
    out, _ = plain_decode(runner, 1007, prompt, sampling, 20)
    assert banned not in out and free[0] not in out
