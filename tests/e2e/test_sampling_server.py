"""Sampled decoding through the real server: seeds reproduce, and with ngram drafting the
emitted tokens follow the target's own (temperature / top-k) distribution exactly."""

from __future__ import annotations

import pytest

from client.api.triton import grpc_generate
from tests.fixtures.helpers import coarse_total_variation, seeded_results
from tests.fixtures.sampling import PROMPT, SAMPLES, TEMPERATURE, TOP_K, exact_marginals


def test_seeded_requests_reproduce(tiny_server):
    runs = [
        grpc_generate(
            tiny_server.grpc_url, PROMPT, max_tokens=24, temperature=1.0, random_seed=seed, ignore_eos=True
        ).output_ids
        for seed in (7, 7, 8)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("mode", ["ngram", "plain"])
def test_sampled_tokens_follow_the_target_distribution(tiny_server, tiny_model_dir, mode):
    exact = exact_marginals(str(tiny_model_dir))
    # The test only means something if no single token dominates.
    assert max(exact[0].values()) < 0.8
    plain = {} if mode == "ngram" else {"num_draft_tokens": 0}
    results = seeded_results(tiny_server, PROMPT, SAMPLES, max_tokens=2, temperature=TEMPERATURE, top_k=TOP_K, **plain)
    for position in range(2):
        tv = coarse_total_variation([r.output_ids[position] for r in results], exact[position])
        assert tv < 0.09, (mode, position, tv)


def test_ngram_drafts_are_exercised_by_the_distribution_test(tiny_server):
    r = grpc_generate(
        tiny_server.grpc_url, PROMPT, max_tokens=2, temperature=TEMPERATURE, top_k=TOP_K, random_seed=1, ignore_eos=True
    )
    assert r.total_draft_tokens >= 1  # the first step already verifies drafts
