"""One bad step never fails the others in its verifier batch (issue 17, items 1 and 3).

Each test runs the same good sequences through two runners: `alone` verifies each step on
its own, `together` verifies them in one batch beside a culprit. The good sequences'
results, and their next steps, must be exactly the lone ones; the culprit gets its own
SequenceError and its sequence is ended."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from backends.runtime.engine import LeanEngine
from backends.serving.request import SamplingParams
from backends.serving.target import SequenceError, TargetRunner, VerifyRequest

PROMPTS = {1: "The quick brown fox", 2: "def add(a, b):\n    return a + b\n"}
CULPRIT = 9


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(params=["lean", "hf"])
def runners(tiny_model_dir, tokenizer, request):
    """Two runners (on each engine) holding the same two running sequences (1 greedy, 2 seeded sampling)."""
    pair = tuple(TargetRunner(tiny_model_dir, dtype="float32", runtime=request.param) for _ in range(2))
    for runner in pair:
        for seq_id, prompt in PROMPTS.items():
            sampling = SamplingParams(temperature=0.8, seed=7) if seq_id == 2 else None
            runner.verify(VerifyRequest(seq_id, tokenizer(prompt)["input_ids"], [], sampling))
    return pair


def good_steps(runner: TargetRunner, round_: int) -> list[VerifyRequest]:
    """Greedy drafts continuing sequence 1; sampled drafts with probabilities for sequence 2."""
    vocab = runner.logits_size
    probs = torch.softmax(torch.randn(3, vocab, generator=torch.Generator().manual_seed(round_)), dim=-1)
    return [VerifyRequest(1, [], [5, 6, 7]), VerifyRequest(2, [], [8, 9, 10], draft_probs=probs)]


def start_culprit(runner: TargetRunner, tokenizer) -> None:
    runner.verify(VerifyRequest(CULPRIT, tokenizer("for i in range(10):")["input_ids"], []))


def check_isolated(alone: TargetRunner, together: TargetRunner, culprit: VerifyRequest, message: str) -> None:
    good = good_steps(alone, 0)
    expected = [alone.verify(r) for r in good]
    results = together.verify_batch([good[0], culprit, good[1]])
    assert isinstance(results[1], SequenceError), results[1]
    assert message in str(results[1]), str(results[1])
    assert CULPRIT not in together.sequences  # a failed step ends its sequence
    for want, got in zip(expected, (results[0], results[2])):
        assert got.token_ids == want.token_ids and got.num_accepted == want.num_accepted
    # The survivors' caches and generators are intact: the next steps agree too.
    nxt = good_steps(alone, 1)
    assert [r.token_ids for r in together.verify_batch(nxt)] == [alone.verify(r).token_ids for r in nxt]
    for seq_id in PROMPTS:
        assert together.sequences[seq_id].token_ids == alone.sequences[seq_id].token_ids


def bad_cases(vocab: int, layers: int) -> dict[str, tuple[dict, str]]:
    uniform = torch.full((2, vocab), 1.0 / vocab)
    return {
        "draft id past the vocabulary": ({"draft_token_ids": [vocab]}, f"draft id {vocab} is outside the vocabulary"),
        "negative draft id": ({"draft_token_ids": [3, -1]}, "draft id -1 is outside the vocabulary"),
        "huge draft id": ({"draft_token_ids": [2**62]}, "is outside the vocabulary"),
        "token id past the vocabulary": ({"new_token_ids": [vocab + 7]}, f"token id {vocab + 7} is outside"),
        "draft_probs with too few rows": (
            {"draft_token_ids": [3, 4, 5], "draft_probs": uniform},
            f"draft_probs must have shape [3, {vocab}]",
        ),
        "draft_probs over another vocabulary": (
            {"draft_token_ids": [3, 4], "draft_probs": uniform[:, :-1]},
            f"draft_probs must have shape [2, {vocab}]",
        ),
        "NaN draft_probs": (
            {"draft_token_ids": [3, 4], "draft_probs": uniform * float("nan")},
            "draft_probs must be finite, non-negative",
        ),
        "negative draft_probs": (
            {"draft_token_ids": [3, 4], "draft_probs": -uniform},
            "draft_probs must be finite, non-negative",
        ),
        "hidden layer past the last": ({"hidden_layer_ids": (layers + 1,)}, f"hidden layer id {layers + 1} is not"),
        "hidden layer below -1": ({"hidden_layer_ids": (-2,)}, "hidden layer id -2 is not"),
        "too many drafts": ({"draft_token_ids": [3] * 129}, "129 drafts; at most 128"),
    }


@pytest.mark.parametrize("case", list(bad_cases(1, 1)))
def test_a_bad_step_fails_alone(runners, tokenizer, case):
    alone, together = runners
    start_culprit(together, tokenizer)
    fields, message = bad_cases(together.logits_size, together.num_layers)[case]
    culprit = VerifyRequest(CULPRIT, fields.pop("new_token_ids", []), fields.pop("draft_token_ids", [3]), **fields)
    check_isolated(alone, together, culprit, message)


def test_bad_first_steps_are_refused_before_any_state(runners, tokenizer):
    _, together = runners
    prompt = tokenizer("for i in")["input_ids"]
    held = together.reserved_tokens
    for req, message in (
        (VerifyRequest(CULPRIT, prompt, [], max_new_tokens="10"), "max_new_tokens"),
        (VerifyRequest(CULPRIT, prompt + [10**9], []), "outside the vocabulary"),
    ):
        result = together.verify_batch([req])[0]
        assert isinstance(result, SequenceError) and message in str(result)
        assert CULPRIT not in together.sequences and together.reserved_tokens == held


def test_a_failing_batched_forward_is_retried_step_by_step(runners, tokenizer, monkeypatch):
    """A forward that still fails (what validation cannot foresee) fails only the step that
    makes it fail: the batch is retried one step at a time."""
    alone, together = runners
    start_culprit(together, tokenizer)
    poison = together.logits_size - 1
    calls = []
    if isinstance(together.engine, LeanEngine):  # the runtime's forward, under the engine
        forward = together.engine.lm.forward

        def poisoned(pool, rows, *args, **kwargs):
            calls.append(len(rows))
            if any(poison in list(row.token_ids) for row in rows):
                raise RuntimeError("poisoned token in the batch")
            return forward(pool, rows, *args, **kwargs)

        monkeypatch.setattr(together.engine.lm, "forward", poisoned)
    else:  # transformers' forward, under the engine's padded batch
        forward = together.engine.model.forward

        def poisoned(*args, input_ids=None, **kwargs):
            calls.append(input_ids.shape[0])
            if (input_ids == poison).any():
                raise RuntimeError("poisoned token in the batch")
            return forward(*args, input_ids=input_ids, **kwargs)

        monkeypatch.setattr(together.engine.model, "forward", poisoned)
    check_isolated(
        alone,
        together,
        VerifyRequest(CULPRIT, [], [poison]),
        "verification failed: RuntimeError: poisoned token in the batch",
    )
    assert calls[:4] == [3, 1, 1, 1]  # the batch of three, then each step alone


def test_a_failing_accept_fails_only_its_row(runners, tokenizer, monkeypatch):
    """After a batched forward each row is accepted and committed on its own: a row that
    fails there fails alone, and the rows before it are not applied twice."""
    alone, together = runners
    start_culprit(together, tokenizer)
    accept = together._accept

    def failing(step, logits, forward_s):
        if step.req.seq_id == CULPRIT:
            raise ValueError("cannot accept this row")
        return accept(step, logits, forward_s)

    monkeypatch.setattr(together, "_accept", failing)
    check_isolated(alone, together, VerifyRequest(CULPRIT, [], [3, 4]), "ValueError: cannot accept this row")


def test_idle_time_counts_from_the_end_of_a_step(tiny_model_dir, tokenizer, monkeypatch):
    """A step longer than the idle timeout (a long prefill) does not make its sequence idle,
    nor does a step of its that is in hand (queued or running)."""
    runner = TargetRunner(tiny_model_dir, dtype="float32")
    now = [0.0]
    runner.clock = lambda: now[0]
    forward = runner.engine.forward

    def slow(*args, **kwargs):
        now[0] += 100.0  # every forward takes 100 s of the clock
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner.engine, "forward", slow)
    runner.verify(VerifyRequest(1, tokenizer("The quick brown fox")["input_ids"], []))
    assert runner.release_idle(60.0) == []  # idle since its step ended: 0 s
    now[0] += 61.0
    assert runner.release_idle(60.0, keep={1}) == []  # its next step is in this batch
    assert runner.verify(VerifyRequest(1, [], [5])).token_ids
    now[0] += 59.0
    assert runner.release_idle(60.0) == []
    now[0] += 2.0
    assert runner.release_idle(60.0) == [1] and not runner.sequences


def test_the_idle_clock_stands_still_while_a_batch_runs():
    """What the Triton models measure idleness on: a request queued behind a 70 s batch
    (the batchers dispatch as soon as the instance is free) gains no idle time."""
    from backends.serving.idle import IdleClock

    now = [100.0]
    clock = IdleClock(lambda: now[0])
    now[0] += 5.0
    assert clock() == 5.0
    clock.busy()
    now[0] += 70.0  # a long batch (a prefill) runs
    assert clock() == 5.0
    clock.idle()
    now[0] += 2.0
    assert clock() == 7.0
