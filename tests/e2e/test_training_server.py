"""The heads the trainer makes on a tiny target (tests/fixtures/training.py, trained once per
session) served through the real server: lossless, and their drafts follow the target."""

from __future__ import annotations

import pytest

from tests.fixtures.head_server import check_sampled_distribution, check_served_greedy, head_server_spec
from tests.fixtures.servers import fixture_servers
from tests.fixtures.training import EAGLE_METHODS


@pytest.fixture(scope="module")
def servers(trained_eagle_heads, training_target_dir, tmp_path_factory):
    """{method: its trained head served}, launched together."""
    specs = {m: head_server_spec(training_target_dir, m, trained_eagle_heads[m][0]) for m in EAGLE_METHODS}
    yield from fixture_servers(tmp_path_factory, specs)


@pytest.mark.parametrize("method", EAGLE_METHODS)
def test_trained_heads_serve_losslessly(method, servers, training_target_dir):
    """Through the real server: greedy output is the target's own, and with probabilistic
    drafts the sampled tokens follow the target's distribution (tests/fixtures/head_server.py)."""
    check_served_greedy(servers[method], training_target_dir)
    check_sampled_distribution(servers[method], training_target_dir, min_accepted=150)
