"""The launcher: repository patching, a clean stop, and a bad drafter config that fails
only its own model."""
from __future__ import annotations

from pathlib import Path

import pytest

from client.api.triton import GenerationError, grpc_generate
from client.cli.launcher import get_parameter, set_parameter
from tests.conftest import start_server


def test_set_and_get_parameter_round_trip():
    text = 'name: "m"\nparameters: { key: "model" value: { string_value: "a" } }\n'
    text = set_parameter(text, "model", "/tmp/x")
    text = set_parameter(text, "speculative_config", '{"method": "ngram", "k": "a\\\\b"}')
    assert get_parameter(text, "model") == "/tmp/x"
    assert get_parameter(text, "speculative_config") == '{"method": "ngram", "k": "a\\\\b"}'
    assert text.count('key: "model"') == 1


def _our_stubs(prefix: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if prefix.encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def test_bad_speculative_config_fails_only_the_drafter(tiny_model_dir, tmp_path):
    server = start_server(tmp_path, str(tiny_model_dir), '{"method": "ngram", "num_speculative_tokens": 0}',
                          require_all_models=False)
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
        assert _our_stubs(prefix)
    finally:
        server.stop()
    assert not _our_stubs(prefix), "stub processes outlived the server"
    assert not list(Path("/dev/shm").glob(f"{prefix}*")), "shared-memory regions left behind"
