"""Rejection sampler: vLLM V1 greedy cases, losslessness in distribution, seeding, metrics."""

import math

import pytest
import torch

from backends.serving.rejection import (
    AcceptanceStats,
    apply_temperature_top_k_top_p,
    apply_top_k_top_p,
    rejection_sample,
    rejection_sample_batch,
)
from backends.serving.request import SamplingParams
from kernels import rejection as rk

VOCAB = 8


def peaked_logits(argmaxes: list[int], vocab_size: int = VOCAB) -> torch.Tensor:
    """One row per entry, its argmax at the given token."""
    logits = torch.zeros(len(argmaxes), vocab_size)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def kept_tokens(masked_logits: torch.Tensor) -> list[list[int]]:
    return [torch.isfinite(row).nonzero().flatten().tolist() for row in masked_logits]


# --- greedy (the cases of vLLM's rejection sampler tests) ---------------------------------------


def test_greedy_all_accepted_emits_bonus():
    assert rejection_sample([1, 2, 3], peaked_logits([1, 2, 3, 4])) == [1, 2, 3, 4]


def test_greedy_first_mismatch_emits_target_token_and_stops():
    assert rejection_sample([1, 5, 3], peaked_logits([1, 2, 3, 4])) == [1, 2]
    assert rejection_sample([6, 2, 3], peaked_logits([1, 2, 3, 4])) == [1]


def test_greedy_without_drafts_emits_one_token():
    assert rejection_sample([], peaked_logits([7])) == [7]


def test_greedy_ties_go_to_lowest_token_and_ignore_draft_probs_and_filters():
    logits = torch.zeros(2, VOCAB)  # every token ties: the argmax is token 0
    draft_probs = torch.full((1, VOCAB), 1 / VOCAB)
    assert rejection_sample([0], logits, draft_probs, SamplingParams(top_k=1, top_p=0.1)) == [0, 0]
    assert rejection_sample([3], logits, sampling=SamplingParams(temperature=1e-6)) == [0]
    assert rejection_sample([], logits[:1]) == [0]  # a plain step takes the same rule


def test_greedy_batch_of_different_draft_lengths():
    drafts = [[1, 2], [], [3, 4, 5], [6]]
    targets = [[1, 2, 7], [0], [3, 1, 5, 2], [5, 4]]
    out = rejection_sample_batch(
        torch.tensor(sum(drafts, [])),
        [len(d) for d in drafts],
        peaked_logits(sum(targets, [])),
        None,
        torch.zeros(len(drafts)),
    )
    assert out == [[1, 2, 7], [0], [3, 1], [5]]


def test_minus_one_draft_is_always_rejected():
    assert rejection_sample([1, -1, 3], peaked_logits([1, 2, 3, 4])) == [1, 2]
    # Random: p puts all its mass on token 0, yet a -1 draft is still rejected; the recovered
    # token comes from p with nothing removed (ngram style) or from max(p - q, 0).
    logits = torch.tensor([[30.0] + [0.0] * (VOCAB - 1)] * 2)
    gen = torch.Generator().manual_seed(0)
    assert rejection_sample([-1], logits, None, SamplingParams(temperature=1.0), gen) == [0]
    draft_probs = torch.full((1, VOCAB), 1 / VOCAB)
    assert rejection_sample([-1], logits, draft_probs, SamplingParams(temperature=1.0), gen) == [0]


def test_mixed_greedy_and_random_batch():
    # Random request 1 has p concentrated on its drafts: it accepts both, then its bonus is 6.
    logits = torch.cat([peaked_logits([1, 2, 3]), 30 * peaked_logits([4, 5, 6])])
    out = rejection_sample_batch(torch.tensor([1, 7, 4, 5]), [2, 2], logits, None, torch.tensor([0.0, 1.0]))
    assert out == [[1, 2], [4, 5, 6]]


def test_invalid_inputs_are_rejected():
    with pytest.raises(ValueError, match="target_logits"):
        rejection_sample([1, 2], peaked_logits([1, 2]))
    with pytest.raises(ValueError, match="target_logits"):
        rejection_sample([], peaked_logits([1, 2]))
    with pytest.raises(ValueError, match="draft token ids"):
        rejection_sample([VOCAB], peaked_logits([1, 2]))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        rejection_sample([0] * 129, torch.zeros(130, VOCAB))


# --- sampling parameters ------------------------------------------------------------------------


def test_top_k_keeps_ties_with_the_kth_logit():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0]] * 4)
    masked = apply_top_k_top_p(logits, torch.tensor([1, 3, 0, 5]), None)
    assert kept_tokens(masked) == [[1, 2], [1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]


def test_top_p_drops_the_low_tail_and_keeps_the_top_token():
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().repeat(4, 1)
    masked = apply_top_k_top_p(logits, None, torch.tensor([0.75, 0.5, 0.1, 1e-9]))
    # A tiny p rounds 1 - p to 1, which would drop everything: the top token is kept anyway.
    assert kept_tokens(masked) == [[1, 2, 3], [2, 3], [3], [3]]


def test_temperature_scales_and_greedy_rows_use_one():
    logits = torch.randn(2, VOCAB)
    probs = apply_temperature_top_k_top_p(logits, torch.tensor([2.0, 0.0]))
    expected = torch.stack([(logits[0] / 2).softmax(-1), logits[1].softmax(-1)])
    torch.testing.assert_close(probs, expected)


# --- losslessness: the first emitted token follows the target distribution -----------------------

NUM_TRIALS = 20_000
NUM_DRAFTS = 2
# A frequency's std is <= 1 / (2 sqrt(N)); the expected TV over 8 tokens is about 0.01.
TV_BOUND = 0.03


def first_token_distribution(
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    drafts: list[int] | None,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> torch.Tensor:
    """Frequencies of the first emitted token over NUM_TRIALS independent verifications.

    With ``draft_probs`` each trial draws its drafts from them (the premise of rejection
    sampling); without, every trial proposes the fixed ``drafts`` (ngram style).
    """
    num_drafts = target_logits.shape[0] - 1
    gen = torch.Generator().manual_seed(1)
    if draft_probs is None:
        draft_ids = torch.tensor(drafts, dtype=torch.int64).repeat(NUM_TRIALS)
    else:
        draft_ids = torch.stack(
            [torch.multinomial(q, NUM_TRIALS, replacement=True, generator=gen) for q in draft_probs], dim=1
        ).flatten()
    torch.manual_seed(2)
    out = rejection_sample_batch(
        draft_ids,
        [num_drafts] * NUM_TRIALS,
        target_logits.repeat(NUM_TRIALS, 1),
        None if draft_probs is None else draft_probs.repeat(NUM_TRIALS, 1),
        torch.full((NUM_TRIALS,), temperature),
        None if top_k is None else torch.full((NUM_TRIALS,), top_k),
        None if top_p is None else torch.full((NUM_TRIALS,), top_p),
    )
    first = torch.tensor([tokens[0] for tokens in out])
    return torch.bincount(first, minlength=VOCAB).float() / NUM_TRIALS


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def random_case(temperature: float, top_k: int | None, top_p: float | None):
    """Target logits [K+1, V], draft probabilities [K, V] far from the target, p of row 0."""
    gen = torch.Generator().manual_seed(0)
    target_logits = 1.5 * torch.randn(NUM_DRAFTS + 1, VOCAB, generator=gen)
    draft_probs = (1.5 * torch.randn(NUM_DRAFTS, VOCAB, generator=gen)).softmax(-1)
    p = apply_temperature_top_k_top_p(
        target_logits[:1],
        torch.tensor([temperature]),
        None if top_k is None else torch.tensor([top_k]),
        None if top_p is None else torch.tensor([top_p]),
    )[0]
    return target_logits, draft_probs, p


SAMPLING_CASES = [(1.0, None, None), (0.7, 3, None), (1.0, None, 0.8), (1.3, 5, 0.9)]


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING_CASES)
def test_first_token_follows_target_distribution(temperature, top_k, top_p):
    target_logits, draft_probs, p = random_case(temperature, top_k, top_p)
    freqs = first_token_distribution(target_logits, draft_probs, None, temperature, top_k, top_p)
    assert total_variation(freqs, p) < TV_BOUND


@pytest.mark.parametrize("drafts", [[3, 5], [-1, 0], []])
def test_first_token_follows_target_distribution_without_draft_probs(drafts):
    gen = torch.Generator().manual_seed(0)
    target_logits = torch.randn(len(drafts) + 1, VOCAB, generator=gen)
    freqs = first_token_distribution(target_logits, None, drafts, 1.0, None, None)
    assert total_variation(freqs, target_logits[0].softmax(-1)) < TV_BOUND


@pytest.mark.parametrize("temperature,top_k,top_p", [SAMPLING_CASES[0], SAMPLING_CASES[-1]])
def test_wrong_recovery_distribution_fails_the_same_bound(monkeypatch, temperature, top_k, top_p):
    """Recovering from p, not normalize(max(p - q, 0)), biases the output: the bound sees it."""
    target_logits, draft_probs, p = random_case(temperature, top_k, top_p)
    overlap = torch.minimum(p, draft_probs[0])
    expected_wrong = overlap + (1 - overlap.sum()) * p  # accepted drafts + recovery from p
    assert total_variation(expected_wrong, p) > 3 * TV_BOUND

    def recover_from_p(drafts, req_ids, target_probs, _draft_probs, noise, is_greedy):
        return correct(drafts, req_ids, target_probs, torch.zeros_like(target_probs), noise, is_greedy)

    correct = rk.sample_recovered_tokens_ref
    monkeypatch.setattr(rk, "sample_recovered_tokens_ref", recover_from_p)
    freqs = first_token_distribution(target_logits, draft_probs, None, temperature, top_k, top_p)
    assert total_variation(freqs, p) > TV_BOUND
    assert total_variation(freqs, expected_wrong) < TV_BOUND


# --- seeding ------------------------------------------------------------------------------------


def seeded_outputs(seed: int, global_seed: int) -> list[list[int]]:
    """Two seeded random requests, with 4 drafts and with none (bonus only), under a global seed."""
    gen = torch.Generator().manual_seed(100)
    logits = torch.randn(6, 50, generator=gen)
    draft_probs = torch.randn(4, 50, generator=gen).softmax(-1)
    torch.manual_seed(global_seed)
    generators = {0: torch.Generator().manual_seed(seed), 1: torch.Generator().manual_seed(seed + 1)}
    return rejection_sample_batch(
        torch.tensor([1, 2, 3, 4]), [4, 0], logits, draft_probs, torch.ones(2), generators=generators
    )


def test_seeded_requests_repeat_and_different_seeds_differ():
    runs = [seeded_outputs(7, global_seed) for global_seed in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert len({str(seeded_outputs(seed, global_seed=0)) for seed in range(10)}) > 1


def test_seeded_request_does_not_depend_on_the_rest_of_the_batch():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 30, generator=gen)  # requests of 2, 3 and 1 drafts
    draft_probs = torch.rand(6, 30, generator=gen).softmax(-1)
    drafts = torch.randint(0, 30, (6,), generator=gen)
    alone = rejection_sample(
        drafts[2:5].tolist(),
        logits[3:7],
        draft_probs[2:5],
        SamplingParams(temperature=0.9),
        torch.Generator().manual_seed(11),
    )
    batch = rejection_sample_batch(
        drafts,
        [2, 3, 1],
        logits,
        draft_probs,
        torch.tensor([1.0, 0.9, 0.0]),
        generators={1: torch.Generator().manual_seed(11)},
    )
    assert batch[1] == alone


# --- metrics ------------------------------------------------------------------------------------


def test_acceptance_stats():
    stats = AcceptanceStats()
    assert stats.acceptance_rate is None and stats.mean_acceptance_length is None
    for drafted, accepted in [(4, 2), (4, 4), (0, 0), (3, 0)]:
        stats.update(drafted, accepted)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 11, 6)
    assert stats.accepted_per_position == [2, 2, 1, 1]
    assert math.isclose(stats.acceptance_rate, 6 / 11)
    assert math.isclose(stats.mean_acceptance_length, 1 + 6 / 3)
    assert stats.to_dict() == {
        "num_drafts": 3,
        "num_draft_tokens": 11,
        "num_accepted_tokens": 6,
        "accepted_per_position": [2, 2, 1, 1],
        "acceptance_rate": 6 / 11,
        "mean_acceptance_length": 3.0,
        "per_position_acceptance_rate": [2 / 3, 2 / 3, 1 / 3, 1 / 3],
    }
    with pytest.raises(ValueError):
        stats.update(2, 3)


def test_synthetic_acceptance_follows_the_configured_rates():
    """vLLM's benchmarking mode: drafts accepted at the configured unconditional rates,
    whatever the target says; a rejection emits the target's token there, never the draft."""
    from backends.serving.rejection import synthetic_sample

    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(1))
    target = logits.argmax(-1).tolist()
    drafts = [(t + 1) % 20 for t in target[:4]]  # every draft differs from the target
    assert synthetic_sample(drafts, logits, [1.0] * 4) == drafts + [target[4]]
    assert synthetic_sample(drafts, logits, [0.0] * 4) == [target[0]]
    gen = torch.Generator().manual_seed(0)
    runs = [synthetic_sample(drafts, logits, [0.5, 0.25, 0.0, 0.0], generator=gen) for _ in range(4000)]
    mean_accepted = sum(len(r) - 1 for r in runs) / len(runs)
    assert abs(mean_accepted - 0.75) < 0.05  # rates are unconditional: 0.5 + 0.25
    sampled = [synthetic_sample(drafts[:1], logits, [0.0], SamplingParams(temperature=1.0), gen)[0] for _ in range(500)]
    assert drafts[0] not in sampled and len(set(sampled)) > 3
