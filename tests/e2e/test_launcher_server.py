"""The launcher with a real tritonserver: a clean stop, and a bad drafter config that fails
only its own model."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.api.triton import GenerationError, grpc_generate
from client.cli.launcher import pids_with_cmdline
from tests.fixtures.servers import start_server


def test_bad_speculative_config_fails_only_the_drafter(tiny_model_dir, tmp_path):
    server = start_server(
        tmp_path, str(tiny_model_dir), '{"method": "ngram", "num_speculative_tokens": 0}', require_all_models=False
    )
    try:
        states = server.model_states()
        assert states["verifier"][0] == "READY" and states["speculative"][0] == "READY"
        state, reason = states["drafter"]
        assert state == "UNAVAILABLE"
        assert "num_speculative_tokens: input should be greater than 0, got 0" in reason
        assert "num_speculative_tokens: input should be greater than 0" in server.log_tail(400)
        # Plain decoding keeps serving; speculation names the missing drafter.
        assert grpc_generate(server.grpc_url, "The quick", max_tokens=4, num_draft_tokens=0).num_output_tokens == 4
        with pytest.raises(GenerationError, match="drafter"):
            grpc_generate(server.grpc_url, "The quick", max_tokens=4)
        assert server.is_ready()
        prefix = server.shm_prefix
        assert pids_with_cmdline(prefix)
    finally:
        server.stop()
    assert not pids_with_cmdline(prefix), "stub processes outlived the server"
    assert not list(Path("/dev/shm").glob(f"{prefix}*")), "shared-memory regions left behind"
