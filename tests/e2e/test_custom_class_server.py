"""custom_class through the real server: the worked example (client/examples/bigram_proposer.py)
gives the target's greedy output with drafts accepted, and a class that cannot be loaded
fails the drafter's load only."""

from __future__ import annotations

import json

from client.api.triton import grpc_generate
from tests.fixtures.helpers import hf_greedy, served_greedy_results_once
from tests.fixtures.servers import start_server

EXAMPLE = "client.examples.bigram_proposer.BigramProposer"
PROMPTS = [
    "def add(a, b):\n    return a + b\ndef add(a, b):",
    "for i in range(10):\n    print(i",
    "The quick brown fox jumps over the lazy dog. The",
]


def test_served_example_equals_target_greedy(tiny_model_dir, tmp_path):
    config = {"model": EXAMPLE, "num_speculative_tokens": 4}
    results = served_greedy_results_once(tmp_path, tiny_model_dir, config, PROMPTS, 32)
    assert sum(r.total_accepted_draft_tokens for r in results) > 0


def test_a_bad_class_fails_the_drafter_load_only(tiny_model_dir, tmp_path):
    config = json.dumps({"model": "client.examples.bigram_proposer.Missing", "num_speculative_tokens": 4})
    server = start_server(tmp_path, str(tiny_model_dir), config, require_all_models=False)
    try:
        state, reason = server.model_states()["drafter"]
        assert state == "UNAVAILABLE" and "has no attribute 'Missing'" in reason
        result = grpc_generate(server.grpc_url, PROMPTS[0], max_tokens=8, num_draft_tokens=0)
        assert tuple(result.output_ids) == hf_greedy(str(tiny_model_dir), PROMPTS[0], 8)
    finally:
        server.stop()
