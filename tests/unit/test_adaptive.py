import pytest
import torch

from backends.config import SpeculativeConfig
from backends.serving.adaptive import AdaptiveDraftLength, DraftCost, StepCost, TreeCut
from backends.serving.orchestrator import draft_length
from backends.serving.proposer import Draft, DrafterInfo
from backends.serving.request import GenerationRequest
from backends.serving.step_cost import StepCostCurve, step_shares


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


def test_acceptance_is_pooled_over_positions_not_averaged_per_step():
    """Drafts accepted at 0.5 per position, 3 a step: 0, 1, 2 and 3 accepted in the geometric
    proportions 4 : 2 : 1 : 1. Averaging each step's accepted / trials gives 0.33; pooling the
    trials gives the 0.5 the drafts are accepted at."""
    policy = AdaptiveDraftLength(max_k=3, decay=0.99)
    for _ in range(200):
        for accepted in (0, 0, 0, 0, 1, 1, 2, 3):
            policy.record(3, 3, accepted, verify_s=0.010, draft_s=0.001)
    assert policy.alpha == pytest.approx(0.5, abs=0.03)


def test_one_slow_draft_call_fades():
    """A head always drafts: its first recorded call was cold (6.6 ms), the rest take 2 ms. The
    policy keeps drafting once the slow call has faded, as it pays at 0.5 acceptance."""
    policy = AdaptiveDraftLength(max_k=3)
    policy.record(3, 3, 2, verify_s=0.0074, draft_s=0.0066)
    for step in range(60):
        k = policy.next_k(3)
        accepted = (1, 2, 0, 1)[step % 4] if k else 0
        policy.record(k, k, min(accepted, k), verify_s=0.0068 + 0.0002 * k, draft_s=0.002 if k else 0.0)
    assert policy.draft(3) == pytest.approx(0.002, rel=0.05)
    assert policy.next_k(3) > 0


def test_draft_cost_is_a_call_plus_a_slope_once_two_lengths_are_seen():
    cost = DraftCost()
    assert cost(4) == 0.0  # nothing measured: drafting looks free
    cost.record(4, 0.0003)
    assert cost(1) == cost(4) == pytest.approx(0.0003)  # one length: its mean at every length
    for _ in range(20):  # a lookup: empty proposals cost the call, drafts 0.05 ms each
        cost.record(0, 0.0001)
        cost.record(4, 0.0003)
    assert cost(0) == pytest.approx(0.0001) and cost(2) == pytest.approx(0.0002)


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


def _measured_cut(per_node_s: float, nodes: int = 16) -> TreeCut:
    """A TreeCut whose verify steps cost 10 ms plus `per_node_s` a node (0 to `nodes` measured)."""
    cut = TreeCut()
    for m in range(nodes + 1):
        cut.record(m, 0.010 + per_node_s * m)
    return cut


def test_tree_cut_keeps_the_nodes_that_pay_for_their_verification():
    scores = [0.9, 0.8, 0.5, 0.3, 0.1, 0.05, 0.0, 0.0]
    # Nodes nearly free to verify: every node that can be accepted, never one scored 0.
    assert _measured_cut(0.00001).cut(scores, draft_s=0.001) == 6
    # A node costs 2 ms of a 10 ms step: the gain of a node must beat what it adds (~0.2 a token).
    assert _measured_cut(0.002).cut(scores, draft_s=0.001) == 3
    # So costly that no draft pays: a plain step.
    assert _measured_cut(0.050).cut(scores, draft_s=0.001) == 0
    assert _measured_cut(0.002).cut([], draft_s=0.001) == 0
    # Noisy measurements where more nodes cost less still never buy a node scored 0.
    noisy = _measured_cut(0.001)
    noisy.record(4, 0.005)
    assert noisy.cut([0.9, 0.8, 0.0, 0.0], 0.001) == 2


def test_tree_cut_measures_a_second_size_before_trusting_one():
    cut = TreeCut()
    assert cut.cut([0.9] * 8, 0.001) == 8  # nothing measured: every size costs the same
    cut.record(8, 0.020)
    assert cut.cut([0.9] * 8, 0.001) == 4  # one size measured and chosen again: half of it
    cut.record(4, 0.012)
    assert cut.cut([0.9] * 8, 0.001) == 8  # 8 nodes for 20 ms beat 4 for 12
    cut.record(8, 0.060)
    cut.record(8, 0.060)
    assert cut.cut([0.9] * 8, 0.001) == 4  # 8 nodes now cost ~40 ms: 4 for 12 is better


def test_a_tree_cut_keeps_the_best_scored_nodes_closed_under_parents():
    #        root
    #      /      \
    #     0 (.6)   1 (.3)
    #    / \        \
    #   2 (.5) 3 (.05) 4 (.2)
    #   |
    #   5 (.4)
    draft = Draft([10, 11, 12, 13, 14, 15], None, [-1, -1, 0, 0, 1, 2], [0.6, 0.3, 0.5, 0.05, 0.2, 0.4])
    best = draft.best(4)
    assert best.token_ids == [10, 11, 12, 15] and best.parents == [-1, -1, 0, 2]
    assert best.scores == [0.6, 0.3, 0.5, 0.4]
    assert draft.best(0).token_ids == [] and draft.best(6).token_ids == [10, 11, 12, 14, 13, 15]  # by level, score
    probs = torch.eye(20)[[10, 11, 12, 13, 14, 15]]
    assert torch.equal(Draft(draft.token_ids, probs, draft.parents, draft.scores).best(2).probs, probs[[0, 2]])


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
