"""custom_class through the real server: the worked example (client/examples/bigram_proposer.py)
gives the target's greedy output with drafts accepted (also under a grammar), and a class that cannot be loaded
fails the drafter's load only."""

from __future__ import annotations

import json

import pytest

from client.api.triton import grpc_generate
from tests.fixtures.helpers import hf_greedy, served_greedy_results
from tests.fixtures.servers import fixture_servers
from tests.fixtures.structured import check_served_constrained

EXAMPLE = "client.examples.bigram_proposer.BigramProposer"
PROMPTS = [
    "def add(a, b):\n    return a + b\ndef add(a, b):",
    "for i in range(10):\n    print(i",
    "The quick brown fox jumps over the lazy dog. The",
]


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    """The worked example served, and a class that cannot be loaded: launched together."""
    configs = {"example": EXAMPLE, "missing": "client.examples.bigram_proposer.Missing"}
    specs = {
        name: dict(
            model=str(tiny_model_dir),
            speculative_config=json.dumps({"model": path, "num_speculative_tokens": 4}),
            require_all_models=name == "example",
        )
        for name, path in configs.items()
    }
    yield from fixture_servers(tmp_path_factory, specs)


def test_served_example_equals_target_greedy(servers, tiny_model_dir):
    results = served_greedy_results(servers["example"], tiny_model_dir, PROMPTS, 32)
    assert sum(r.total_accepted_draft_tokens for r in results) > 0


def test_served_example_under_a_grammar_equals_target_constrained_greedy(servers, tiny_model_dir):
    check_served_constrained(servers["example"], tiny_model_dir)


def test_a_bad_class_fails_the_drafter_load_only(servers, tiny_model_dir):
    server = servers["missing"]
    state, reason = server.model_states()["drafter"]
    assert state == "UNAVAILABLE" and "has no attribute 'Missing'" in reason
    result = grpc_generate(server.grpc_url, PROMPTS[0], max_tokens=8, num_draft_tokens=0)
    assert tuple(result.output_ids) == hf_greedy(str(tiny_model_dir), PROMPTS[0], 8)
