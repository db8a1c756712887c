import pytest

from backends.config import SpeculativeConfig
from backends.serving.adaptive import AdaptiveDraftLength, StepCost
from backends.serving.orchestrator import draft_length
from backends.serving.proposer import DrafterInfo
from backends.serving.request import GenerationRequest
from backends.serving.target import StepCostCurve, step_shares


def test_expected_tokens_formula():
    policy = AdaptiveDraftLength(max_k=4, alpha=0.5)
    assert policy.expected_tokens(0) == pytest.approx(1.0)
    assert policy.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)


def test_starts_optimistic_then_follows_acceptance():
    policy = AdaptiveDraftLength(max_k=5)
    assert policy.next_k(limit=100) == 5  # nothing measured: every k costs the same
    assert policy.next_k(limit=3) == 3  # never past the room left
    for _ in range(10):  # everything accepted; verifying more tokens costs little
        policy.record(5, 5, 5, verify_s=0.040, draft_s=0.001)
        policy.record(0, 0, 0, verify_s=0.038, draft_s=0.0)
    assert policy.alpha > 0.9
    assert policy.next_k(limit=100) == 5


def test_pauses_when_drafts_are_rejected_and_cost_real_time():
    policy = AdaptiveDraftLength(max_k=4, probe_every=5)
    for _ in range(10):  # fp32-like costs: each verified token adds 25% to the step
        policy.record(4, 4, 0, verify_s=0.100, draft_s=0.002)
        policy.record(0, 0, 0, verify_s=0.050, draft_s=0.0)
    assert policy.alpha < 0.05
    ks = [policy.next_k(limit=100) for _ in range(10)]
    assert ks.count(0) == 8 and ks.count(1) == 2  # paused, probing every 5th step


def test_probes_bring_speculation_back():
    policy = AdaptiveDraftLength(max_k=4, probe_every=2)
    for _ in range(6):
        policy.record(4, 4, 0, verify_s=0.100, draft_s=0.002)
        policy.record(0, 0, 0, verify_s=0.050, draft_s=0.0)
    assert policy.next_k(100) == 0
    for _ in range(12):  # the text turned repetitive: probes get accepted
        policy.record(1, 1, 1, verify_s=0.055, draft_s=0.002)
    assert policy.next_k(100) > 0


def test_unseen_lengths_are_interpolated():
    policy = AdaptiveDraftLength(max_k=8)
    policy.record(0, 0, 0, verify_s=1.0, draft_s=0.0)
    policy.record(4, 4, 4, verify_s=2.0, draft_s=0.0)
    assert policy.step_time(2) == pytest.approx(1.5)
    policy.record(2, 2, 2, verify_s=1.5, draft_s=0.0)
    assert policy.step_time(6) == pytest.approx(2.5)  # extrapolated with the last slope


def test_batch_size_schedule_caps_k_under_load():
    config = SpeculativeConfig.from_json(
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 8, 1], [9, 64, 0]],
        }
    )
    info, req = DrafterInfo(config, ()), GenerationRequest(prompt="x")
    assert [draft_length(req, info, load, 10, None) for load in (1, 2, 3, 8, 9, 64)] == [4, 4, 1, 1, 0, 0]


def test_tree_size_tries_each_size_then_keeps_the_fastest():
    from backends.serving.adaptive import TreeSize

    policy = TreeSize(max_nodes=16, probe_every=1000)
    assert policy.sizes == [0, 4, 8, 16]
    tried = []
    for _ in range(4):  # every size once, the largest first
        size = policy.next_size()
        tried.append(size)
        # Bigger trees emit more per step but cost more: 8 nodes is the best tokens/s here.
        policy.record(size, {0: 2, 4: 3, 8: 4, 16: 4.2}[size], {0: 0.02, 4: 0.022, 8: 0.024, 16: 0.04}[size])
    assert tried == [16, 8, 4, 0]
    assert [policy.next_size() for _ in range(3)] == [8, 8, 8]
    # Under load a tree costs every sequence in the batch: at most max_nodes / load nodes.
    assert policy.next_size(load=3) == 4
    assert policy.next_size(load=64) == 0


def test_tree_size_probes_the_others_and_follows_a_change():
    from backends.serving.adaptive import TreeSize

    policy = TreeSize(max_nodes=8, probe_every=4)
    for size in policy.sizes:
        policy.record(size, 1 + size / 8, 0.02)  # big trees pay
    picks = [policy.next_size() for _ in range(8)]
    assert set(picks) - {8}  # probes visit other sizes now and then
    for _ in range(10):
        policy.record(8, 1.0, 0.03)  # the text changed: the big tree no longer pays
        policy.record(0, 1.8, 0.02)
    picks = [policy.next_size() for _ in range(3)]
    assert picks.count(0) >= 2


def test_step_shares_charge_each_row_its_tokens_and_sum_to_the_step():
    shares = step_shares(0.050, [1, 5, 1], token_cost_s=0.002)
    assert sum(shares) == pytest.approx(0.050)
    assert shares[1] - shares[0] == pytest.approx(4 * 0.002) and shares[0] == shares[2]
    assert step_shares(0.030, [1, 1, 1], 0.0) == pytest.approx([0.010] * 3)  # no cost known: even
    # a cost above what the step took: shares in proportion to tokens, never negative
    assert step_shares(0.006, [1, 5], token_cost_s=0.010) == pytest.approx([0.001, 0.005])


def test_step_cost_is_the_wall_time_alone_and_a_share_under_load():
    cost = StepCost()
    assert cost(forward_s=0.015, wall_s=0.018, load=1) == pytest.approx(0.018)
    # under load the wall time is the batch's: only the share and a part of the hops count
    assert cost(forward_s=0.004, wall_s=0.040, load=8) == pytest.approx(0.004 + 0.003 / 8)


def _batch_step_s(tokens: list[int]) -> float:
    """A SmolLM2-135M bf16 step on the 2-core CPU (tritonspec verify-cost): 12.2 ms, 0.18 ms
    a row, 2.3 ms a token."""
    return 0.0122 + 0.00018 * len(tokens) + 0.0023 * sum(tokens)


@pytest.mark.parametrize("weighed_by", ["wall time", "share"])
def test_under_load_the_draft_length_follows_the_share_of_the_step(weighed_by):
    """Eight sequences share each step and seven draft 4 tokens. Weighed by the call's wall
    time, a longer draft looks free (the batch's step hardly changes with one row) and the
    policy drafts its maximum; weighed by its share (StepCost), at 0.6 acceptance, a sequence
    drafts at most 1 token: at this load a second draft token costs more than it brings."""
    policy, cost = AdaptiveDraftLength(max_k=4), StepCost()
    for _ in range(3):
        for k in range(5):
            tokens = [k + 1] + [5] * 7
            step_s = _batch_step_s(tokens)
            share = step_shares(step_s, tokens, token_cost_s=0.0023)[0]
            verify_s = step_s + 0.003 if weighed_by == "wall time" else cost(share, step_s + 0.003, load=8)
            policy.record(k, k, 0, verify_s=verify_s, draft_s=0.0001)
    policy.alpha = 0.6
    assert policy.next_k(limit=4) == (4 if weighed_by == "wall time" else 1)


# SmolLM2-135M bf16 on a 2-core AVX-512 BF16 CPU, one row of 1..64 new tokens (measure_step_cost)
MEASURED_CURVE = StepCostCurve((1, 2, 4, 8, 16, 32, 64), (0.0080, 0.0083, 0.0089, 0.0100, 0.0155, 0.0250, 0.0480))


def test_step_cost_curve_interpolates_and_extends_its_last_slope():
    curve = MEASURED_CURVE
    assert curve.time(8) == pytest.approx(0.0100)
    assert curve.time(12) == pytest.approx((0.0100 + 0.0155) / 2)
    assert curve.time(96) == pytest.approx(0.0480 + 32 * (0.0480 - 0.0250) / 32)
    # a draft token in a lone sequence's step costs the flat start, in 8 rows the steep part
    assert curve.token_cost(rows=1, total=5) == pytest.approx((curve.time(5) - 0.0080) / 4)
    assert curve.token_cost(rows=8, total=16) == pytest.approx((0.0155 - 0.0100) / 8)
    assert curve.token_cost(rows=8, total=8) == pytest.approx(curve.time(9) - 0.0100)  # the next token's
    assert curve.token_cost(rows=8, total=16) > 2 * curve.token_cost(rows=1, total=5)


@pytest.mark.parametrize("priced_by", ["one row's cost", "the curve"])
def test_under_load_a_draft_token_is_priced_at_the_batch_size(priced_by):
    """Eight sequences share each step and seven draft 1 token. Priced at what a draft token
    adds to a lone sequence's step (the flat start of the curve), a sequence accepting 35% of
    its drafts still drafts; at what it adds to this batch's step, it does not: here a draft
    token costs ~0.7 ms, more than it brings at 35%."""
    policy, cost = AdaptiveDraftLength(max_k=2), StepCost()
    for _ in range(3):
        for k in range(3):
            tokens = [k + 1] + [2] * 7
            step_s = MEASURED_CURVE.time(sum(tokens)) + 0.00025 * (len(tokens) - 1)  # and a row's own part
            rows, total = len(tokens), sum(tokens)
            token_cost = MEASURED_CURVE.token_cost(*((1, 5) if priced_by == "one row's cost" else (rows, total)))
            share = step_shares(step_s, tokens, token_cost)[0]
            policy.record(k, k, 0, verify_s=cost(share, step_s, load=8), draft_s=0.0001)
    policy.alpha = 0.35
    assert policy.next_k(limit=2) == (1 if priced_by == "one row's cost" else 0)
