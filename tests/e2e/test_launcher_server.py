"""The launcher with a real tritonserver: a clean stop, a bad drafter config that fails
only its own model, and `--threads` reaching every model."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.api.triton import grpc_generate
from client.cli.launcher import pids_with_cmdline
from tests.fixtures.helpers import hf_greedy
from tests.fixtures.servers import fixture_servers


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    """A server whose drafter config is bad and one on `--threads 1`, launched together; each
    test stops its own."""
    specs = {
        "bad-drafter": dict(
            model=str(tiny_model_dir),
            speculative_config='{"method": "ngram", "num_speculative_tokens": 0}',
            require_all_models=False,
            graceful_stop=True,
        ),
        "one-thread": dict(model=str(tiny_model_dir), threads=1, dtype="bfloat16"),
    }
    yield from fixture_servers(tmp_path_factory, specs)


def test_bad_speculative_config_fails_only_the_drafter(servers, tiny_model_dir):
    server = servers["bad-drafter"]
    try:
        states = server.model_states()
        assert states["verifier"][0] == "READY" and states["speculative"][0] == "READY"
        state, reason = states["drafter"]
        assert state == "UNAVAILABLE"
        assert "num_speculative_tokens: input should be greater than 0, got 0" in reason
        assert "num_speculative_tokens: input should be greater than 0" in server.log_tail(400)
        # Every request keeps being served, plainly: the orchestrator read the same bad config
        # at load and runs without a drafter (its log says why).
        expected = hf_greedy(str(tiny_model_dir), "The quick", 4)
        assert (
            tuple(grpc_generate(server.grpc_url, "The quick", max_tokens=4, num_draft_tokens=0).output_ids) == expected
        )
        plain = grpc_generate(server.grpc_url, "The quick", max_tokens=4)
        assert tuple(plain.output_ids) == expected and plain.total_draft_tokens == 0
        assert "serving plain decoding" in server.log_tail(400)
        assert server.is_ready()
        prefix = server.shm_prefix
        assert pids_with_cmdline(prefix)
    finally:
        server.stop()
    assert not pids_with_cmdline(prefix), "stub processes outlived the server"
    assert not list(Path("/dev/shm").glob(f"{prefix}*")), "shared-memory regions left behind"


def test_every_model_computes_on_the_threads_asked(servers):
    """`--threads 1` (TRITONSPEC_THREADS in the server's environment): every model process logs
    the choice and why, and its forwards run on one thread."""
    server = servers["one-thread"]
    try:
        generated = grpc_generate(server.grpc_url, "The quick", max_tokens=4, num_draft_tokens=0)
        assert len(generated.output_ids) == 4
        log = server.log_tail(2000)
    finally:
        server.stop()
    assert "1 thread: TRITONSPEC_THREADS=1 (affinity " in log
    assert "runs this process's forwards on 1 threads" in log
    assert "forwards on 2 thread" not in log  # a team of one never grows
