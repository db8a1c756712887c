"""Verification of many sequences in one forward pass equals verifying them one by one."""

from __future__ import annotations

import random
import time

import pytest
import torch
from transformers import AutoTokenizer

from backends.serving.request import SamplingParams
from backends.serving.step_cost import StepCostCurve, measure_step_cost
from backends.serving.target import SequenceError, TargetRunner, VerifyRequest

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):",
    "Speculative decoding drafts tokens",
    "café",
]


@pytest.fixture(scope="module", params=["lean", "hf"])
def runners(tiny_model_dir, request):
    """Both engines: the lean runtime's paged pool and transformers' DynamicCache."""
    return tuple(TargetRunner(tiny_model_dir, dtype="float32", runtime=request.param) for _ in range(2))


def test_batched_steps_equal_single_steps(runners, tiny_model_dir):
    alone, together = runners
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rng = random.Random(0)
    prompts = {seq_id: tokenizer(p)["input_ids"] for seq_id, p in enumerate(PROMPTS, start=1)}
    sampling = {seq_id: SamplingParams(temperature=1.0, seed=seq_id) if seq_id % 2 else None for seq_id in prompts}
    outputs = {seq_id: [] for seq_id in prompts}
    for step in range(8):
        batch = []
        for seq_id, prompt in prompts.items():
            # Drafts: some continue the sequence's own output (often accepted), some random.
            k = rng.randint(0, 4)
            history = outputs[seq_id]
            drafts = history[-k:] if step % 2 and len(history) >= k else [rng.randrange(50) for _ in range(k)]
            batch.append(
                VerifyRequest(seq_id, prompt if step == 0 else [], drafts, sampling[seq_id] if step == 0 else None)
            )
        one_by_one = [alone.verify(r) for r in batch]
        batched = together.verify_batch(batch)
        for req, a, b in zip(batch, one_by_one, batched):
            assert a.token_ids == b.token_ids, (step, req.seq_id)
            outputs[req.seq_id] += a.token_ids
    for seq_id in prompts:
        assert alone.sequences[seq_id].token_ids == together.sequences[seq_id].token_ids
        assert (
            alone.cached_tokens(seq_id) == together.cached_tokens(seq_id) == len(alone.sequences[seq_id].token_ids) - 1
        )
        alone.release(seq_id)
        together.release(seq_id)


def test_batched_hidden_states_match_the_single_path(runners, tiny_model_dir):
    alone, together = runners
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for runner in runners:
        for seq_id, prompt in ((11, PROMPTS[0]), (12, PROMPTS[2])):
            runner.verify(VerifyRequest(seq_id, tokenizer(prompt)["input_ids"], []))
    reqs = [VerifyRequest(11, [], [5, 6], hidden_layer_ids=(0, 1)), VerifyRequest(12, [], [7], hidden_layer_ids=(1,))]
    single = [alone.verify(r) for r in reqs]
    batched = together.verify_batch(reqs)
    for a, b in zip(single, batched):
        assert a.hidden_states.shape == b.hidden_states.shape
        torch.testing.assert_close(a.hidden_states, b.hidden_states, rtol=1e-4, atol=1e-4)
    for runner in runners:
        runner.release(11)
        runner.release(12)


def test_a_bad_request_fails_alone(runners, tiny_model_dir):
    runner = runners[1]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    runner.verify(VerifyRequest(21, tokenizer(PROMPTS[0])["input_ids"], []))
    runner.verify(VerifyRequest(22, tokenizer(PROMPTS[1])["input_ids"], []))
    results = runner.verify_batch(
        [
            VerifyRequest(21, [], [1]),
            VerifyRequest(99, [], [1]),  # unknown sequence
            VerifyRequest(22, [], [1] * 600),  # past the context window
            VerifyRequest(23, tokenizer(PROMPTS[2])["input_ids"], []),  # a new prompt in the same call
        ]
    )
    assert isinstance(results[1], SequenceError) and "unknown" in str(results[1])
    assert isinstance(results[2], SequenceError) and "context window" in str(results[2])
    assert len(results[0].token_ids) >= 1 and len(results[3].token_ids) == 1
    for seq_id in (21, 22, 23):
        runner.release(seq_id)


def test_long_steps_are_measured_fewer_times(tiny_model_dir, monkeypatch):
    """At start-up each size is stepped 4 times (one to warm up), but a size whose steps are
    long is not repeated past the budget: its one or two steps are its time."""
    runner = TargetRunner(tiny_model_dir, dtype="float32", runtime="lean")
    forward, steps = runner.engine.forward, []

    def slowed(rows, *args, **kwargs):  # 16 tokens: 0.2 s a step, 64: 0.3 s
        n = len(rows[0].token_ids)
        steps.append(n)
        time.sleep({16: 0.2, 64: 0.3}.get(n, 0.0))
        return forward(rows, *args, **kwargs)

    monkeypatch.setattr(runner.engine, "forward", slowed)
    curve = measure_step_cost(runner.engine, context=8, sizes=(1, 16, 64))
    assert [steps.count(n) for n in (1, 16, 64)] == [4, 2, 1]
    assert curve.seconds[1] == pytest.approx(0.2, abs=0.05) and curve.seconds[2] == pytest.approx(0.3, abs=0.05)
    assert runner.engine.pool.num_sequences == 0


def test_each_row_is_charged_its_own_tokens(tiny_model_dir):
    """A batched step's time is shared so that a row's share grows with its own tokens (at
    what a token adds to a step of that size, by the curve measured at start-up), and the
    shares add up to the step; the start-up measurement hands its scratch sequence's blocks back."""
    runner = TargetRunner(tiny_model_dir, dtype="float32", runtime="lean")
    assert runner.step_cost.tokens == (1, 2, 4, 8, 16, 32, 64)
    assert all(s > 0 for s in runner.step_cost.seconds)
    assert runner.engine.pool.num_sequences == 0 and runner.engine.reserved_tokens == 0
    # a known curve, so the shares below are checked whatever was measured: 0.01 ms a token
    runner.step_cost = StepCostCurve((1, 2), (0.0, 1e-5))
    for seq_id in (1, 2):
        runner.verify(VerifyRequest(seq_id, list(range(10, 30)), []))
    short, long = runner.verify_batch([VerifyRequest(1, [], []), VerifyRequest(2, [], [7, 8, 9, 10])])
    # the 5-token row's extra 4 tokens at that cost (a step of 6 tokens takes far more than 6 x 0.01 ms)
    assert long.forward_s - short.forward_s == pytest.approx(4 * 1e-5, rel=1e-6)
