"""A drafter that hangs or fails costs a request its speed, never its output: the call is
abandoned after `drafter_timeout_s` (or its error taken) and that request decodes plainly."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from client.api.triton import grpc_generate
from client.cli.chaos_proposer import SLOW_S
from client.cli.launcher import pids_with_cmdline
from client.cli.soak import CHAOS_SPECULATIVE_CONFIG
from tests.fixtures.helpers import hf_greedy, metric_values, wait_for_no_active_sequences
from tests.fixtures.servers import start_servers, stop_servers

PROMPT = "def add(a, b):\n    return a + b\ndef add(a, b):"


@pytest.fixture(scope="module")
def chaos_trigger(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("chaos") / "trigger"


@pytest.fixture(scope="module")
def servers(tiny_model_dir, chaos_trigger, tmp_path_factory):
    """The chaos drafter's server (its stubs read the fault trigger file named in their
    environment) and one drafting ngram in the drafter model, launched together; each test
    stops its own."""
    specs = {
        "chaos": dict(
            model=str(tiny_model_dir),
            speculative_config=json.dumps(CHAOS_SPECULATIVE_CONFIG),
            per_model={"speculative": {"drafter_timeout_s": "1"}},
        ),
        # ngram drafting in the drafter model (not in the orchestrator's process), so steps call it
        "drafter-model": dict(
            model=str(tiny_model_dir),
            per_model={"speculative": {"drafter_timeout_s": "5", "drafter_in_process": "false"}},
        ),
    }
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITONSPEC_CHAOS_TRIGGER", str(chaos_trigger))  # read at launch: the stubs inherit it
        servers = start_servers(tmp_path_factory, specs)
    yield servers
    stop_servers(servers)


def test_a_hung_or_failing_drafter_falls_back_to_plain_decoding(servers, chaos_trigger, tiny_model_dir):
    server, trigger = servers["chaos"], chaos_trigger
    try:
        expected = hf_greedy(str(tiny_model_dir), PROMPT, 24)
        for fault, reason in (("slow", "did not answer within 1 s"), ("raise", "an injected drafter fault")):
            trigger.write_text(fault)
            result = grpc_generate(server.grpc_url, PROMPT, max_tokens=24)
            assert tuple(result.output_ids) == expected
            assert reason in result.perf_metrics.get("fallback", ""), result.perf_metrics
            time.sleep(SLOW_S)  # the abandoned slow call still holds the drafter this long
        healthy = grpc_generate(server.grpc_url, PROMPT, max_tokens=24)  # the next request speculates again
        assert tuple(healthy.output_ids) == expected and "fallback" not in healthy.perf_metrics
        assert healthy.total_draft_tokens > 0
        fallbacks = metric_values(server, "tritonspec_spec_decode_drafter_fallbacks")
        assert sum(fallbacks.values()) == 2, fallbacks
        assert not any(wait_for_no_active_sequences(server).values())
    finally:
        server.stop()


def test_a_drafter_stub_killed_mid_stream_costs_no_output(servers, tiny_model_dir):
    """SIGKILL the drafter's stub process while a stream runs: that stream (and later
    requests) finish with exactly the target's output, the server stays up, no verifier
    state is left behind."""
    server = servers["drafter-model"]
    try:
        expected = hf_greedy(str(tiny_model_dir), PROMPT, 160)
        results, killed = [], []

        def on_response(_):
            if not killed:  # the stream is under way: kill the drafter now
                killed.extend(pids_with_cmdline(server.shm_prefix, "drafter_0_0"))
                for pid in killed:
                    os.kill(pid, signal.SIGKILL)

        stream = threading.Thread(
            target=lambda: results.append(
                grpc_generate(server.grpc_url, PROMPT, max_tokens=160, stream=True, on_response=on_response)
            )
        )
        stream.start()
        stream.join(timeout=120)
        assert killed, "no drafter stub found to kill"
        assert results and tuple(results[0].output_ids) == expected
        assert "Stub process 'drafter_0_0' is not healthy" in results[0].perf_metrics.get("fallback", "")
        after = grpc_generate(server.grpc_url, PROMPT, max_tokens=24)
        assert tuple(after.output_ids) == expected[:24]
        assert server.is_ready()
        active = wait_for_no_active_sequences(server)
        assert not active.get("verifier"), active
    finally:
        server.stop()
