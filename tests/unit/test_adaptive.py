import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch

from backends.config import SpeculativeConfig
from backends.serving.adaptive import (
    PLAIN,
    PLAIN_EVERY,
    DraftCost,
    DraftCut,
    DraftHistory,
    DraftPolicy,
    PositionAcceptance,
    RunningMean,
    Shape,
    StepCost,
)
from backends.serving.orchestrator import draft_length
from backends.serving.proposer import Draft, DrafterInfo
from backends.serving.request import GenerationRequest
from backends.serving.step_cost import StepCostCurve, step_shares

# The scripted-drafter simulator lives with the sweep that runs it over seeds.
SWEEP = Path(__file__).parents[2] / "scripts" / "policy_sweep.py"
_spec = importlib.util.spec_from_file_location("policy_sweep", SWEEP)
sys.modules["policy_sweep"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(sys.modules["policy_sweep"])
from policy_sweep import FAST_HEAD, HEAD, NGRAM, SLOW_HEAD, Drafter, run_policy, verify_s  # noqa: E402


def at_rates(*rates: float) -> PositionAcceptance:
    return PositionAcceptance(positions=[RunningMean(rate) for rate in rates])


def test_expected_tokens_multiply_the_rates_of_each_position():
    acceptance = at_rates(0.8, 0.5, 0.25)
    assert acceptance.expected_tokens(0) == pytest.approx(1.0)
    assert acceptance.expected_tokens(3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert acceptance.expected_tokens(4) == pytest.approx(1 + 0.8 + 0.4 + 0.1 + 0.025)  # untried: the last rate
    assert PositionAcceptance(prior=0.5).expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)


def test_starts_optimistic_then_follows_acceptance():
    policy = DraftPolicy(max_k=5)
    assert policy.next_shape(limit=100) == Shape(5)  # nothing measured: every k costs the same
    assert policy.next_shape(limit=3) == Shape(3)  # never past the room left
    for _ in range(10):  # everything accepted; verifying more tokens costs little
        policy.record(5, 5, 5, verify_s=0.040, draft_s=0.001)
        policy.record(0, 0, 0, verify_s=0.038, draft_s=0.0)
    assert policy.acceptance.rate(4) > 0.85
    assert policy.next_shape(limit=100) == Shape(5)


def test_pauses_when_drafts_are_rejected_and_probes_within_a_budget():
    """A probe after at least probe_every plain steps, and as many as keep its cost under 1%
    of the time: here a 1-draft step costs 13 ms more than a 50 ms plain one, so every 26th."""
    policy = DraftPolicy(max_k=4, probe_every=5)
    for _ in range(10):  # fp32-like costs: each verified token adds 25% to the step
        policy.record(4, 4, 0, verify_s=0.100, draft_s=0.002)
        policy.record(0, 0, 0, verify_s=0.050, draft_s=0.0)
    assert policy.acceptance.rate(0) < 0.15
    assert policy.step_time(Shape(1)) - policy.step_time(PLAIN) == pytest.approx(0.013)
    shapes = [policy.next_shape(limit=100) for _ in range(80)]
    assert [i + 1 for i, shape in enumerate(shapes) if shape.depth] == [26, 52, 78]
    assert set(shapes) == {PLAIN, Shape(1)}
    cheap = DraftPolicy(max_k=4, probe_every=5)
    for _ in range(120):  # a 1-draft step costs 1.2% more than a plain one: probes every 5 steps
        cheap.record(4, 4, 0, verify_s=0.052, draft_s=0.0003)
        cheap.record(0, 0, 0, verify_s=0.050, draft_s=0.0)
    shapes = [cheap.next_shape(limit=100) for _ in range(20)]
    assert [i + 1 for i, shape in enumerate(shapes) if shape.depth] == [5, 10, 15, 20]


def test_probes_bring_speculation_back():
    policy = DraftPolicy(max_k=4, probe_every=2)
    for _ in range(6):
        policy.record(4, 4, 0, verify_s=0.100, draft_s=0.002)
        policy.record(0, 0, 0, verify_s=0.050, draft_s=0.0)
    assert policy.next_shape(100) == PLAIN
    for _ in range(12):  # the text turned repetitive: probes get accepted
        policy.record(1, 1, 1, verify_s=0.055, draft_s=0.002)
    assert policy.next_shape(100).depth > 0


def test_acceptance_is_counted_per_position():
    """Drafts accepted at 0.5 per position, 3 a step: 0, 1, 2 and 3 accepted in the geometric
    proportions 4 : 2 : 1 : 1. Each position's rate is the 0.5 it is accepted at (the moving
    average of each step's own accepted / tried gives 0.33). A head whose later drafts are
    accepted less gets each position's own rate."""
    geometric, falling = PositionAcceptance(window=1000), PositionAcceptance(window=1000)
    for _ in range(200):
        for accepted in (0, 0, 0, 0, 1, 1, 2, 3):
            geometric.record(3, accepted)
        for accepted in (0, 0, 1, 1, 1, 1, 1, 1, 2, 3):  # 0.8 at the first, 0.25 at the second, 0.5 at the third
            falling.record(3, accepted)
    assert [geometric.rate(i) for i in range(3)] == pytest.approx([0.5, 0.5, 0.5], abs=0.03)
    assert [falling.rate(i) for i in range(3)] == pytest.approx([0.8, 0.25, 0.5], abs=0.03)


def test_the_draft_length_follows_each_positions_rate():
    """A head accepted at 0.9 at its first draft and 0.2 after: one rate pooled over the
    positions tried (0.54) would have it draft 2; each position's own rate makes a second
    draft not worth its 1.5 ms."""
    policy = DraftPolicy(max_k=3)
    for k in range(4):
        policy.record(k, k, 0, verify_s=0.008 + 0.0003 * k, draft_s=0.0005 + 0.0015 * k)
    policy.acceptance = at_rates(0.9, 0.2, 0.2)
    assert policy.next_shape(3) == Shape(1)
    policy.acceptance = PositionAcceptance(prior=0.54)
    assert policy.next_shape(3) == Shape(2)


def test_a_stale_dear_plain_step_does_not_keep_a_losing_head_drafting():
    """Seen through the server: one plain step measured at 16.7 ms (noise), then 1-draft steps
    at 10 ms + 1.8 ms drafting, never accepted. A step with more tokens never costs less, so
    plain steps cost at most 10 ms and the head stops drafting (it drafted every step)."""
    policy = DraftPolicy(max_k=3)
    policy.record(0, 0, 0, verify_s=0.0167, draft_s=None)
    for _ in range(12):
        policy.record(1, 1, 0, verify_s=0.010, draft_s=0.0018)
    assert policy.step_time(PLAIN) == pytest.approx(0.010)
    assert policy.next_shape(3) == PLAIN


def test_a_head_that_always_drafts_times_a_plain_step_and_pauses_where_drafts_cannot_pay():
    """Where a verified row costs 17% of a step (float32 FMAs on an AVX2 CPU), an EAGLE-3 head
    whose first draft is accepted 32% of the time cannot pay: 1.32 tokens for 1.17 steps of
    verification and 0.21 of drafting. A head drafts every step, so no plain step was timed,
    and priced as a 1-draft step it kept the head drafting (0.84x plain through the server)."""
    policy, rng, shapes = DraftPolicy(max_k=3), random.Random(0), []
    for _ in range(200):
        shape = policy.next_shape(3)
        k, accepted = shape.depth, 0
        while accepted < k and rng.random() < (0.32, 0.07, 0.0)[accepted]:
            accepted += 1
        policy.record(k, k, accepted, verify_s=0.0134 * (1 + 0.17 * k), draft_s=0.0028 if k else None)
        shapes.append(shape)
    assert shapes[0].depth and shapes[1] == PLAIN  # the second step is timed plain
    assert policy.step_time(PLAIN) == pytest.approx(0.0134)
    assert sum(shape.depth > 0 for shape in shapes[100:]) <= 10  # probes only


def test_a_new_sequence_starts_from_the_drafters_measured_costs():
    """A head whose drafts cannot pay at any acceptance the prior allows (3 ms + 4 ms a level
    against an 8 ms step): the first sequence finds out by drafting; the next one starts from
    the costs it measured and decodes plainly from its first step."""
    history = DraftHistory()
    first, shapes, _ = run_policy(Drafter((0.3,), **SLOW_HEAD), 100, DraftPolicy(max_k=4, history=history))
    assert shapes[0].depth
    second = DraftPolicy(max_k=4, history=history)
    assert second.step_time(Shape(2)) == first.step_time(Shape(2))
    _, shapes, speed = run_policy(Drafter((0.3,), **SLOW_HEAD), 100, second, seed=1)
    assert shapes[0] == PLAIN and speed >= 0.97 * PLAIN_RATE
    # and the history is what every sequence measures: the second one's steps are in it too
    assert DraftPolicy(max_k=4, history=history).verify.seconds == second.verify.seconds


def test_a_plain_step_is_timed_once_in_plain_every_steps_of_the_drafters_sequences():
    """An n-gram drafter that matches every step: the first sequence times a plain step (its
    second); after that, the drafter's sequences time one each time PLAIN_EVERY steps passed
    without one, not one a sequence (each costs a step's gain)."""
    history, shapes = DraftHistory(), []
    for _ in range(12):  # sequences of 50 steps
        policy = DraftPolicy(max_k=4, history=history)
        for _ in range(50):
            shape = policy.next_shape(4)
            policy.record(shape.depth, shape.depth, shape.depth, verify_s=verify_s(shape.depth), draft_s=0.0001)
            shapes.append(shape)
    plain = [i for i, shape in enumerate(shapes) if shape == PLAIN]
    assert plain[0] == 1 and len(plain) <= 1 + len(shapes) // PLAIN_EVERY
    assert max(b - a for a, b in zip(plain, plain[1:])) <= PLAIN_EVERY + 2


def test_a_sequences_first_draft_is_priced_at_the_drafters_acceptance_the_rest_at_its_own():
    """An n-gram drafter on requests that copy from their prompts (every draft accepted), where
    a verified token adds 2 ms to a 13 ms step: at the prior 0.6 a chain of 2 looks best, and
    a 20-token answer copied from the prompt had ended before k grew to 8. A new sequence's
    first draft is priced at what the drafter's sequences had accepted; from its first trial
    on, at its own: a request that copies nothing after ones that did drafts less."""
    history = DraftHistory()
    for k in range(9):
        history.record(k, 0.013 + 0.002 * k, k, 0.0002 if k else None, tree=False)
    blind = DraftPolicy(max_k=8)
    blind.verify.seconds = {k: 0.013 + 0.002 * k for k in range(9)}
    assert blind.next_shape(8) == Shape(2)
    for _ in range(20):
        history.record_trial(8, 8)
    policy = DraftPolicy(max_k=8, history=history)
    assert policy.next_shape(8) == Shape(8)
    policy.record(8, 8, 0, verify_s=0.029, draft_s=0.0002)  # this request copies nothing
    assert policy.acceptance.rate(0) == pytest.approx(0.4)  # the prior 0.6 as two trials, and a rejection
    assert policy.next_shape(8).depth < 8


def test_a_sequence_the_history_keeps_paused_stays_paused_on_a_rejected_probe():
    """A head the drafter's sequences accepted at 0.2, where a draft pays from 0.35 on: a new
    sequence starts paused, and its first probe, rejected, leaves it paused (from the prior
    0.6, the rejection read 0.4 and it drafted again)."""
    history = DraftHistory()
    for k in range(3):
        history.record(k, verify_s(k), k, 0.001 + 0.0015 * k if k else None, tree=False)
    for accepted in (0, 0, 0, 0, 1) * 6:
        history.record_trial(1, accepted)
    policy = DraftPolicy(max_k=2, history=history)
    shapes = [policy.next_shape(2)]
    while not shapes[-1].depth:
        policy.record(0, 0, 0, verify_s(0), None)
        shapes.append(policy.next_shape(2))
    assert shapes[0] == PLAIN and shapes[-1] == Shape(1)  # a probe
    policy.record(1, 1, 0, verify_s(1), 0.0025)
    assert policy.next_shape(2) == PLAIN


def test_one_slow_draft_call_fades():
    """A head always drafts: its first recorded call was cold (6.6 ms), the rest take 2 ms. The
    policy keeps drafting once the slow call has faded, as it pays at 0.5 acceptance."""
    policy = DraftPolicy(max_k=3)
    policy.record(3, 3, 2, verify_s=0.0074, draft_s=0.0066)
    for step in range(60):
        k = policy.next_shape(3).depth
        accepted = (1, 2, 0, 1)[step % 4] if k else 0
        policy.record(k, k, min(accepted, k), verify_s=0.0068 + 0.0002 * k, draft_s=0.002 if k else 0.0)
    assert policy.draft(3) == pytest.approx(0.002, rel=0.05)
    assert policy.next_shape(3).depth > 0


def test_a_call_that_caught_up_on_a_pause_is_not_timed():
    policy = DraftPolicy(max_k=3)
    policy.record(3, 3, 3, verify_s=0.009, draft_s=0.002)
    policy.record(1, 1, 1, verify_s=0.008, draft_s=None)  # 40 rows read after a pause: 9 ms
    assert policy.draft(3) == pytest.approx(0.002) and policy.draft.means[0] == 3


def test_draft_cost_is_a_call_plus_a_slope_once_two_lengths_are_seen():
    cost = DraftCost()
    assert cost(4) == 0.0  # nothing measured: drafting looks free
    cost.record(4, 0.0003)
    # one length: its share of that length's mean below it, the mean above
    assert (cost(1), cost(4), cost(6)) == pytest.approx((0.000075, 0.0003, 0.0003))
    for _ in range(20):  # a lookup: empty proposals cost the call, drafts 0.05 ms each
        cost.record(0, 0.0001)
        cost.record(4, 0.0003)
    assert cost(0) == pytest.approx(0.0001) and cost(2) == pytest.approx(0.0002)


def test_unseen_lengths_are_interpolated():
    policy = DraftPolicy(max_k=8)
    policy.record(0, 0, 0, verify_s=1.0, draft_s=0.0)
    policy.record(4, 4, 4, verify_s=2.0, draft_s=0.0)
    assert policy.step_time(Shape(2)) == pytest.approx(1.5)
    policy.record(2, 2, 2, verify_s=1.5, draft_s=0.0)
    assert policy.step_time(Shape(6)) == pytest.approx(2.5)  # extrapolated with the last slope


def test_batch_size_schedule_caps_k_under_load():
    config = SpeculativeConfig.from_json(
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 8, 1], [9, 64, 0]],
        }
    )
    info, req = DrafterInfo(config, ()), GenerationRequest(prompt="x")
    assert [draft_length(req, info, load, 10) for load in (1, 2, 3, 8, 9, 64)] == [4, 4, 1, 1, 0, 0]


def _measured_cut(per_node_s: float, nodes: int = 16) -> DraftCut:
    """A DraftCut whose verify steps cost 10 ms plus `per_node_s` a node (0 to `nodes` measured)."""
    cut = DraftCut()
    for m in range(nodes + 1):
        cut.verify.record(m, 0.010 + per_node_s * m)
    return cut


def test_draft_cut_keeps_the_nodes_that_pay_for_their_verification():
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
    noisy.verify.record(4, 0.005)
    assert noisy.cut([0.9, 0.8, 0.0, 0.0], 0.001) == 2


def test_draft_cut_measures_a_second_size_before_trusting_one():
    cut = DraftCut()
    assert cut.cut([0.9] * 8, 0.001) == 8  # nothing measured: every size costs the same
    cut.verify.record(8, 0.020)
    assert cut.cut([0.9] * 8, 0.001) == 4  # one size measured and chosen again: half of it
    cut.verify.record(4, 0.012)
    assert cut.cut([0.9] * 8, 0.001) == 8  # 8 nodes for 20 ms beat 4 for 12
    cut.verify.record(8, 0.060)
    cut.verify.record(8, 0.060)
    assert cut.cut([0.9] * 8, 0.001) == 4  # 8 nodes now cost ~40 ms: 4 for 12 is better


def test_a_chain_cut_keeps_its_first_drafts():
    draft = Draft([10, 11, 12, 13], scores=[0.8, 0.5, 0.1, 0.01])
    best = draft.best(2)
    assert (best.token_ids, best.parents, best.scores) == ([10, 11], None, [0.8, 0.5])
    assert draft.best(9).token_ids == [10, 11, 12, 13]


def test_drafts_the_cut_dropped_count_as_rejected_and_as_drafted():
    """A chain of 4 cut to 2 that were both accepted: its third position was tried and
    failed (the step declined it), and the call drafted 4, which is what it cost."""
    cut, whole = DraftPolicy(max_k=4), DraftPolicy(max_k=4)
    for _ in range(6):
        cut.record(4, 2, 2, verify_s=0.010, draft_s=0.004, num_cut=2)
        whole.record(4, 2, 2, verify_s=0.010, draft_s=0.004)
    assert cut.acceptance.rate(2) < 0.3 < whole.acceptance.rate(2)  # whole: never tried, the prior
    assert cut.acceptance.rate(0) == whole.acceptance.rate(0) > 0.85
    assert cut.draft(4) == pytest.approx(0.004) and whole.draft(2) == pytest.approx(0.004)


def test_a_drafter_whose_drafts_are_all_cut_is_paused():
    """Every draft cut (scored too low to verify): each step paid for the drafter and gained
    nothing, so the policy stops drafting, as for drafts that are all rejected."""
    policy = DraftPolicy(max_k=3)
    for _ in range(20):
        shape = policy.next_shape(3)
        if shape.depth:
            policy.record(shape.depth, 0, 0, verify_s=0.010, draft_s=0.003, num_cut=shape.depth)
        else:
            policy.record(0, 0, 0, verify_s=0.010, draft_s=None)
    assert policy.next_shape(3) == PLAIN


def test_a_draft_cut_keeps_the_best_scored_nodes_closed_under_parents():
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
    policy, cost = DraftPolicy(max_k=4), StepCost()
    for _ in range(3):
        for k in range(5):
            tokens = [k + 1] + [5] * 7
            step_s = _batch_step_s(tokens)
            share = step_shares(step_s, tokens, token_cost_s=0.0023)[0]
            verify_s = step_s + 0.003 if weighed_by == "wall time" else cost(share, step_s + 0.003, load=8)
            policy.record(k, k, 0, verify_s=verify_s, draft_s=0.0001)
    policy.acceptance = PositionAcceptance(prior=0.6)
    assert policy.next_shape(limit=4).depth == (4 if weighed_by == "wall time" else 1)


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
    policy, cost = DraftPolicy(max_k=2), StepCost()
    for _ in range(3):
        for k in range(3):
            tokens = [k + 1] + [2] * 7
            step_s = MEASURED_CURVE.time(sum(tokens)) + 0.00025 * (len(tokens) - 1)  # and a row's own part
            rows, total = len(tokens), sum(tokens)
            token_cost = MEASURED_CURVE.token_cost(*((1, 5) if priced_by == "one row's cost" else (rows, total)))
            share = step_shares(step_s, tokens, token_cost)[0]
            policy.record(k, k, 0, verify_s=cost(share, step_s, load=8), draft_s=0.0001)
    policy.acceptance = PositionAcceptance(prior=0.35)
    assert policy.next_shape(limit=2).depth == (1 if priced_by == "one row's cost" else 0)


# ---------------------------------------------------------------------------- scripted runs
# The cost model driven step by step with scripted costs (SmolLM2-135M bf16 on the 2-core CPU:
# a 1-token step 8 ms, 0.3 ms a verified draft) and scripted acceptance (a seeded draw per
# position): scripts/policy_sweep.py's simulator, which sweeps it over seeds.

PLAIN_RATE = 1 / verify_s(0)


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.3, 0.5, 0.7, 0.9])
@pytest.mark.parametrize("costs", [NGRAM, FAST_HEAD, HEAD, SLOW_HEAD], ids=["ngram", "fast head", "head", "slow head"])
def test_never_slower_than_plain_decoding_by_more_than_3_percent(rate, costs):
    """Over 400 steps, whatever the acceptance and the drafter's cost, the sequence decodes at
    least 0.97x as fast as plain steps would; and where a fixed k would be 1.2x as fast as
    plain, it gets most of that (what exploring and probing cost; a dear drafter's acceptance
    is learnt only as fast as trying it stays cheap)."""
    drafter = Drafter((rate,), **costs)
    _, _, speed = run_policy(drafter, 400)
    best_fixed = max(
        sum(drafter.rate(0) ** i for i in range(k + 1)) / (verify_s(k) + costs["call_s"] + costs["level_s"] * k)
        for k in range(1, 5)
    )
    assert speed >= 0.97 * PLAIN_RATE
    if best_fixed >= 1.2 * PLAIN_RATE:
        assert speed >= 0.9 * best_fixed


def test_stops_drafting_when_it_cannot_pay_and_resumes_when_acceptance_rises():
    """A head accepted at 0.6 drafts; when its acceptance falls to 0.05 the sequence stops
    drafting (only probes, ever rarer, call it); when acceptance rises to 0.9 a probe finds it
    and the sequence drafts its longest chain again."""
    policy, shapes, _ = run_policy(Drafter((0.6,), **HEAD), 100)
    assert all(shape.depth for shape in shapes[-50:])
    policy, shapes, speed = run_policy(Drafter((0.05,), **HEAD), 400, policy, seed=1)
    # probes only: a 1-draft step costs 2.8 ms more than a plain one, 1% of 35 plain steps (a
    # probe that happens to be accepted may draft a step or two after it)
    probes = [i for i in range(50, 400) if shapes[i].depth and not shapes[i - 1].depth]
    assert len(probes) <= 350 / 35 and sum(shape.depth > 0 for shape in shapes[50:]) <= 350 / 35 + 3
    assert shapes[-1] == PLAIN and speed >= 0.97 * PLAIN_RATE
    policy, shapes, _ = run_policy(Drafter((0.9,), **HEAD), 300, policy, seed=2)
    resumed = next(i for i, shape in enumerate(shapes) if shape.depth and shapes[i + 1].depth)
    assert resumed <= 130 and shapes[-50:] == [Shape(4)] * 50


def test_chooses_a_tree_only_when_the_tree_pays():
    """The same chain acceptance (0.5 a position): siblings that rescue 60% of the rejected
    levels with cheap tree levels make the tree pay, and it is drafted; siblings that rescue
    5% do not pay for the tree's 16 nodes and dearer levels, and the chain is drafted."""
    _, paying, _ = run_policy(Drafter((0.5,), **HEAD, sibling=0.6), 300)
    assert sum(shape.tree for shape in paying[-100:]) >= 95
    useless = Drafter((0.5,), **HEAD, sibling=0.05, tree_level_s=0.003)
    policy, shapes, speed = run_policy(useless, 300)
    assert sum(shape.tree for shape in shapes[-100:]) == 0
    assert speed >= 0.95 * run_policy(Drafter((0.5,), **HEAD), 300)[2]  # near the chain alone
