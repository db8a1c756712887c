"""EAGLE-1 and EAGLE-3 heads (tiny synthetic checkpoints) through the real server: the verifier
returns the hidden states the head names, the orchestrator carries them to the drafter, and
the output is the target's own."""

from __future__ import annotations

import pytest

from tests.fixtures.helpers import served_greedy_results_once
from tests.fixtures.synthetic_checkpoints import write_eagle1, write_eagle3

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The", "for i in range(10):\n    print(i"]
WRITERS = {"eagle": write_eagle1, "eagle3": write_eagle3}


@pytest.fixture(scope="module")
def target_dir(tiny3_model_dir):
    """Three layers: eagle3's default aux layers are distinct."""
    return tiny3_model_dir


@pytest.mark.parametrize("method", WRITERS)
def test_served_greedy_equals_target_greedy(method, target_dir, tmp_path):
    head = tmp_path / method
    WRITERS[method](head, target_dir)
    config = {"method": method, "model": str(head), "num_speculative_tokens": 3}
    results = served_greedy_results_once(tmp_path, target_dir, config, PROMPTS, 24)
    assert sum(r.total_draft_tokens for r in results) > 0
