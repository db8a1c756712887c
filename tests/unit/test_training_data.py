"""Training data made on the lean runtime (`backends/training/generation.py`, `data.py`): many
sequences at a time give exactly the target's own plain greedy decoding, one sequence and one
token a step, with the hidden states and argmax of every position; the cache resumes, grows
and adds layers without changing what it holds."""

from __future__ import annotations

import json
import random

import pytest
import torch

from backends.runtime.lean_lm import Row
from backends.runtime.model_store import load_tokenizer
from backends.training.data import prepare
from backends.training.generation import Sampling, TargetGenerator, load_lean_target
from backends.training.trainer import grouped_by_length
from tests.fixtures.training import tiny_prompts

LAYERS = (0, 2, -1)  # the 3-layer target's first and last decoder inputs and its final normed state


def plain_greedy(lm, prompt: list[int], max_new_tokens: int, stop: set[int]):
    """The runtime's plain greedy decoding, one sequence, one token a step; every position's
    states of LAYERS ([n, layers, H]) and argmax ([n]), the last token fed once more for them."""
    pool = lm.new_pool(capacity_tokens=len(prompt) + max_new_tokens + 16)
    pool.admit("s", len(prompt) + max_new_tokens)
    ids, feed, hidden, labels = list(prompt), list(prompt), [], []
    while True:
        out = lm.forward(pool, [Row("s", feed)], len(feed), LAYERS)
        hidden.append(torch.stack([out.hidden[0][i] for i in LAYERS], dim=1))
        labels.append(out.logits[0].argmax(-1))
        answered = len(ids) - len(prompt)
        if answered == max_new_tokens or (answered and ids[-1] in stop):
            return ids, torch.cat(hidden), torch.cat(labels)
        feed = [int(out.logits[0][-1].argmax())]
        ids += feed


@pytest.fixture(scope="module")
def prompt_ids(training_target_dir) -> list[list[int]]:
    tokenizer = load_tokenizer(training_target_dir)
    return [tokenizer(p)["input_ids"] for p in tiny_prompts(training_target_dir)[:9]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_generation_is_plain_greedy_decoding(dtype, training_target_dir, prompt_ids):
    """9 prompts, 4 in flight (admissions beside decoding rows, rows finishing at different
    steps, some at the stop token): each sequence, its states and its argmax are those of the
    sequence decoded alone."""
    lm = load_lean_target(training_target_dir, dtype)
    generator = TargetGenerator(lm, max_len=max(map(len, prompt_ids)) + 20, max_rows=4)
    answers = [g.token_ids[g.prompt_len :] for g in generator.generate(prompt_ids, 20, set())]
    # A stop token that ends some answers early and not others.
    stop = {next(t for t in answers[0][1:] if any(t not in a for a in answers))}
    got = {g.index: g for g in generator.generate(prompt_ids, 20, stop, LAYERS)}
    assert sorted(got) == list(range(len(prompt_ids)))
    assert any(g.token_ids[-1] in stop for g in got.values()) and any(
        len(g.token_ids) - g.prompt_len == 20 for g in got.values()
    )  # both ways of ending are exercised
    for i, prompt in enumerate(prompt_ids):
        ids, hidden, labels = plain_greedy(lm, prompt, 20, stop)
        g = got[i]
        assert g.token_ids == ids and g.prompt_len == len(prompt)
        assert g.hidden.shape == (len(ids), len(LAYERS), lm.hidden_size) and g.hidden.dtype == lm.dtype
        assert torch.equal(g.labels, labels)
        if lm.batch_invariant:  # the verifier's kernels: the same bits whatever shares the step
            assert torch.equal(g.hidden, hidden)
        else:
            torch.testing.assert_close(g.hidden, hidden)
    assert generator.pool.num_sequences == 0  # every finished sequence gave its blocks back


def test_recorded_states_are_the_targets_layers(training_target_dir, tmp_path):
    """The cached states are numbered as the verifier numbers them (transformers'
    hidden_states[i] entering layer i, -1 the final normed state), close to transformers' own
    float32 numbers, and the labels are the argmax after each position."""
    from tests.fixtures.helpers import load_hf_model

    data = prepare(training_target_dir, tmp_path, LAYERS, 6, 16, dtype="float32")
    model, _ = load_hf_model(str(training_target_dir))
    assert set(data.hidden) == set(LAYERS)
    for i in range(data.num_sequences):
        seq = data.token_ids[data.sequence(i)]
        with torch.inference_mode():
            out = model(input_ids=seq[None], output_hidden_states=True)
        assert torch.equal(data.labels[data.sequence(i)], out.logits[0].argmax(-1))
        for layer in LAYERS:
            states = data.hidden[layer][data.sequence(i)]
            assert states.shape == (len(seq), model.config.hidden_size)
            torch.testing.assert_close(states.float(), out.hidden_states[layer][0], atol=0.02, rtol=0.02)


def test_the_cache_grows_and_adds_layers_without_changing_what_it_holds(training_target_dir, tmp_path):
    first = prepare(training_target_dir, tmp_path, (0,), 5, 16)
    grown = prepare(training_target_dir, tmp_path, (0,), 8, 16)  # 3 more answers beside the merged file
    records = [json.loads(line) for line in (tmp_path / "generations.jsonl").open()]
    assert sorted(r["prompt"] for r in records) == list(range(8))  # the first 5 were not answered again
    n = len(first.token_ids)
    assert torch.equal(grown.token_ids[:n], first.token_ids) and torch.equal(grown.hidden[0][:n], first.hidden[0])
    wider = prepare(training_target_dir, tmp_path, (0, -1), 8, 16)  # a layer more: one prefill each
    fresh = prepare(training_target_dir, tmp_path / "fresh", (0, -1), 8, 16)
    for data in (grown, wider):
        assert torch.equal(data.token_ids, fresh.token_ids) and torch.equal(data.labels, fresh.labels)
        assert torch.equal(data.hidden[0], fresh.hidden[0])
    assert torch.equal(wider.hidden[-1], fresh.hidden[-1])  # the prefill rerun equals decoding's states
    assert not list((tmp_path / "parts").glob("*"))  # merged into states.safetensors


def test_a_data_dir_of_another_generator_is_refused(training_target_dir, tmp_path):
    (tmp_path / "generations.jsonl").write_text("")  # what the transformers-made data left
    with pytest.raises(ValueError, match="transformers in float32"):
        prepare(training_target_dir, tmp_path, (0,), 2, 4)
    prepare(training_target_dir, tmp_path / "bf16", (0,), 2, 4)
    with pytest.raises(ValueError, match="lean runtime in bfloat16"):
        prepare(training_target_dir, tmp_path / "bf16", (0,), 2, 4, dtype="float32")


def test_sampling_keeps_to_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2000))
    sampling = Sampling(1.0, 0.7, torch.Generator().manual_seed(0))
    from backends.training.generation import sample

    drawn = sample(logits, sampling)
    assert set(drawn.tolist()) == {0, 1}  # 0.5 + 0.3 reach 0.7: tokens 2 and 3 are cut
    assert 0.55 < (drawn == 0).float().mean() < 0.70  # 0.5 / 0.8 renormalized


def test_steps_group_windows_of_similar_length():
    spans = [(0, n) for n in (5, 90, 12, 64, 3, 70, 8, 33)]
    grouped = grouped_by_length(spans, per_batch=2, rng=random.Random(0), batches=2)
    assert sorted(grouped) == sorted(spans)
    steps = {tuple(grouped[i : i + 2]) for i in range(0, 8, 2)}
    assert steps == {((0, 90), (0, 64)), ((0, 12), (0, 5)), ((0, 70), (0, 33)), ((0, 8), (0, 3))}
    assert grouped[:4] in ([(0, 90), (0, 64), (0, 12), (0, 5)], [(0, 12), (0, 5), (0, 90), (0, 64)])
