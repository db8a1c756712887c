"""The heads the trainer makes on a tiny target (tests/fixtures/training.py, trained once per
session) served through the real server: lossless, and their drafts follow the target."""

from __future__ import annotations

import pytest

from tests.fixtures.head_server import check_sampled_distribution, check_served_greedy, start_head_server
from tests.fixtures.training import EAGLE_METHODS


@pytest.mark.parametrize("method", EAGLE_METHODS)
def test_trained_heads_serve_losslessly(method, trained_eagle_heads, training_target_dir, tmp_path):
    """Through the real server: greedy output is the target's own, and with probabilistic
    drafts the sampled tokens follow the target's distribution (tests/fixtures/head_server.py)."""
    server = start_head_server(tmp_path, training_target_dir, method, trained_eagle_heads[method][0])
    try:
        check_served_greedy(server, training_target_dir)
        check_sampled_distribution(server, training_target_dir, min_accepted=150)
    finally:
        server.stop()
