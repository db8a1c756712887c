"""The medusa, mlp_speculator, mtp, dflash and dspark heads the trainer makes on a tiny target
(tests/fixtures/training.py, trained once per session) served: the target's greedy output."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.head_server import check_served_greedy
from tests.fixtures.servers import fixture_servers
from tests.fixtures.training import HEAD_METHODS, HEAD_STEPS


@pytest.fixture(scope="module")
def servers(trained_heads, training_target_dir, tmp_path_factory):
    """{method: its trained head served}, launched together."""
    specs = {
        method: dict(
            model=str(training_target_dir),
            speculative_config=json.dumps(
                {"method": method, "model": str(trained_heads[method][0]), "num_speculative_tokens": HEAD_STEPS}
            ),
        )
        for method in HEAD_METHODS
    }
    yield from fixture_servers(tmp_path_factory, specs)


@pytest.mark.parametrize("method", HEAD_METHODS)
def test_trained_heads_serve_losslessly(method, servers, training_target_dir):
    """Through the real server: greedy output is the target's own, with drafts accepted
    (greedy drafts: the tiny heads' distributions are too flat for sampled drafts to be
    accepted reliably in a few dozen tokens)."""
    check_served_greedy(servers[method], training_target_dir)
