"""The medusa, mlp_speculator, mtp, dflash and dspark heads the trainer makes on a tiny target
(tests/fixtures/training.py, trained once per session) served: the target's greedy output."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.head_server import check_served_greedy
from tests.fixtures.servers import start_server
from tests.fixtures.training import HEAD_METHODS, HEAD_STEPS


@pytest.mark.parametrize("method", HEAD_METHODS)
def test_trained_heads_serve_losslessly(method, trained_heads, training_target_dir, tmp_path):
    """Through the real server: greedy output is the target's own, with drafts accepted
    (greedy drafts: the tiny heads' distributions are too flat for sampled drafts to be
    accepted reliably in a few dozen tokens)."""
    config = {"method": method, "model": str(trained_heads[method][0]), "num_speculative_tokens": HEAD_STEPS}
    server = start_server(tmp_path, str(training_target_dir), json.dumps(config))
    try:
        check_served_greedy(server, training_target_dir)
    finally:
        server.stop()
