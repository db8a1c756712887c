import pytest

from backends.config import SpeculativeConfig
from backends.serving.adaptive import AdaptiveDraftLength
from backends.serving.orchestrator import draft_length
from backends.serving.proposer import DrafterInfo
from backends.serving.request import GenerationRequest


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
