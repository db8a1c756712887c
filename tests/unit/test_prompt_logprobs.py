"""vLLM's prompt_logprobs in process: the target scores each prompt token (from the second)
in its own prefill, with the values and ranks of the log-softmax of its full-prompt forward
(transformers' reference), the same in one step, in prefill chunks and after a preemption, on
both engines; the output tokens do not change; and what parsing refuses, by name."""

from __future__ import annotations

import json

import pytest
import torch

from backends.serving.request import RequestError, SamplingParams, bind_token_ids, parse_request
from backends.serving.target import TargetRunner, VerifyRequest
from tests.fixtures.helpers import load_hf_model

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
TOP = 3


@pytest.fixture(scope="module", params=["lean", "hf"])
def engine_runner(tiny_model_dir, request) -> TargetRunner:
    return TargetRunner(tiny_model_dir, dtype="float32", runtime=request.param)


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer(PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def reference(target_dir, prompt) -> torch.Tensor:
    """log_softmax of the target's own logits over the whole prompt, [len(prompt), V]."""
    model, _ = load_hf_model(str(target_dir))
    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), -1)


def scored(
    runner: TargetRunner,
    seq_id: int,
    prompt: list[int],
    sampling: SamplingParams,
    chunk: int = 0,
    drafts=(),
    parents: list[int] | None = None,
):
    """The prompt logprobs of a sequence prefilled whole (chunk 0) or in chunks, and its first tokens."""
    chunk = chunk or len(prompt)
    out, emitted = [], []
    for start in range(0, len(prompt), chunk):
        last = start + chunk >= len(prompt)
        result = runner.verify(
            VerifyRequest(
                seq_id,
                prompt[start : start + chunk],
                list(drafts) if last else [],
                sampling if start == 0 else None,
                max_new_tokens=8,
                prefill_only=not last,
                draft_parents=parents if last else None,
            )
        )
        out += result.prompt_logprobs or []
        emitted = result.token_ids
    runner.release(seq_id)
    return out, emitted


def test_prompt_logprobs_are_the_targets_log_softmax_over_the_prompt(engine_runner, prompt, reference):
    entries, _ = scored(engine_runner, 1, prompt, SamplingParams(prompt_logprobs=TOP))
    assert [p.token_id for p in entries] == prompt[1:]  # none for the first token, as vLLM
    for t, p in enumerate(entries, start=1):
        row = reference[t - 1]  # token t is scored by the position before it
        assert p.logprob == pytest.approx(row[prompt[t]].item(), abs=1e-5)
        assert p.rank == int((row >= row[prompt[t]]).sum())
        values, ids = row.topk(TOP)
        assert [i for i, _ in p.top] == ids.tolist()
        assert [v for _, v in p.top] == pytest.approx(values.tolist(), abs=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_chunked_prefill_gives_the_same_numbers(engine_runner, prompt, chunk):
    """A chunk's last position scores the next chunk's first token: kept until it comes."""
    sampling = SamplingParams(prompt_logprobs=TOP)
    whole, first = scored(engine_runner, 2, prompt, sampling)
    chunked, first_chunked = scored(engine_runner, 3, prompt, sampling, chunk=chunk)
    assert [(p.token_id, p.rank) for p in chunked] == [(p.token_id, p.rank) for p in whole]
    for a, b in zip(chunked, whole):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [i for i, _ in a.top] == [i for i, _ in b.top]
    assert first_chunked == first


@pytest.mark.parametrize("parents", [None, [-1, -1, 0]], ids=["chain", "tree"])
def test_the_output_and_drafts_are_unchanged_and_the_whole_vocabulary_can_be_asked(
    engine_runner, prompt, reference, parents
):
    """Prompt logprobs come from rows ahead of the verified ones: the tokens emitted (drafts,
    a chain or a tree, accepted or not) are those of a request without them. N = the
    vocabulary (what -1 asks for) ranks every token."""
    drafts = [prompt[1], prompt[2], prompt[3]]
    plain, tokens = scored(engine_runner, 4, prompt, SamplingParams(), drafts=drafts, parents=parents)
    assert plain == []
    vocab = engine_runner.vocab_size
    sampling = SamplingParams(prompt_logprobs=vocab)
    entries, with_logprobs = scored(engine_runner, 5, prompt, sampling, drafts=drafts, parents=parents)
    assert with_logprobs == tokens
    assert len(entries) == len(prompt) - 1 and all(len(p.top) == vocab for p in entries)
    full = torch.tensor([v for _, v in entries[0].top])
    assert torch.logsumexp(full, 0).item() == pytest.approx(0.0, abs=1e-4)
    assert full.tolist() == pytest.approx(reference[0].sort(descending=True).values.tolist(), abs=1e-5)


def test_a_prompt_after_the_same_prompt_is_scored_whole_not_from_the_prefix_cache(tiny_model_dir, prompt):
    """The prefix cache would skip the rows of a cached prompt: a sequence that asks for
    prompt logprobs computes every one (vLLM skips the prefix cache for it too)."""
    runner = TargetRunner(tiny_model_dir, dtype="float32", runtime="lean")
    runner.verify(VerifyRequest(6, prompt, [], SamplingParams(), max_new_tokens=4))  # cached now
    entries, _ = scored(runner, 7, prompt, SamplingParams(prompt_logprobs=0))
    assert [p.token_id for p in entries] == prompt[1:] and all(p.top == () for p in entries)


def test_a_preempted_prefill_scores_each_token_once(tiny_model_dir, prompt):
    """Preempted between chunks, the sequence recomputes its cache from the start: tokens
    already scored are not scored again, the rest the same as without preemption."""
    runner = TargetRunner(tiny_model_dir, dtype="float32", runtime="lean")
    sampling = SamplingParams(prompt_logprobs=1)
    reference, _ = scored(runner, 8, prompt, sampling, chunk=6)
    out = []
    for start in range(0, len(prompt), 6):
        if start == 12:
            runner.scheduler.preempt(9)
        last = start + 6 >= len(prompt)
        req = VerifyRequest(9, prompt[start : start + 6], [], sampling if start == 0 else None, prefill_only=not last)
        while (result := runner.verify(req)).waiting:
            pass
        out += result.prompt_logprobs or []
    assert [(p.token_id, p.rank, p.top[0][0]) for p in out] == [(p.token_id, p.rank, p.top[0][0]) for p in reference]
    assert [p.logprob for p in out] == pytest.approx([p.logprob for p in reference], abs=1e-5)


# -------------------------------------------------------------------------- parsing


def parse(sampling: dict):
    return parse_request({"text_input": "hi"}, "", json.dumps(sampling))


@pytest.mark.parametrize(
    "value,message",
    [
        (-2, "prompt_logprobs must be -1 (the whole vocabulary) or in [0, 20] (alternatives per prompt token), got -2"),
        (21, "prompt_logprobs must be -1 (the whole vocabulary) or in [0, 20]"),
        ("many", "prompt_logprobs must be an integer"),
        (1.5, "prompt_logprobs must be an integer"),
    ],
)
def test_bad_prompt_logprobs_are_refused_by_name(value, message):
    with pytest.raises(RequestError, match=None) as err:
        parse({"prompt_logprobs": value})
    assert message in str(err.value)


def test_minus_one_is_the_whole_vocabulary_within_vllms_limit(tokenizer):
    """As vLLM at its default max_logprobs (20): -1 counts as the vocabulary size."""
    req = parse({"prompt_logprobs": -1})
    with pytest.raises(RequestError) as err:
        bind_token_ids(req, tokenizer, {0}, vocab_size=384)
    assert "prompt_logprobs must be at most 20 (max allowed), got -1: the whole vocabulary of 384 tokens" in str(
        err.value
    )
    assert bind_token_ids(req, tokenizer, {0}, vocab_size=16).sampling.prompt_logprobs == 16
    assert bind_token_ids(parse({"prompt_logprobs": 5}), tokenizer, {0}, 384).sampling.prompt_logprobs == 5
    assert parse({"prompt_logprobs": None}).sampling.prompt_logprobs is None
    sent = parse({"prompt_logprobs": 0}).sampling
    assert SamplingParams.from_json(sent.to_json()).prompt_logprobs == 0  # it reaches the verifier
