"""A drafter that hangs or fails costs a request its speed, never its output: the call is
abandoned after `drafter_timeout_s` (or its error taken) and that request decodes plainly."""

from __future__ import annotations

import json
import time

from client.api.triton import grpc_generate
from client.cli.chaos_proposer import SLOW_S
from client.cli.soak import CHAOS_SPECULATIVE_CONFIG
from tests.fixtures.helpers import hf_greedy, metric_values, wait_for_no_active_sequences
from tests.fixtures.servers import start_server

PROMPT = "def add(a, b):\n    return a + b\ndef add(a, b):"


def test_a_hung_or_failing_drafter_falls_back_to_plain_decoding(tiny_model_dir, tmp_path, monkeypatch):
    trigger = tmp_path / "chaos-trigger"
    monkeypatch.setenv("TRITONSPEC_CHAOS_TRIGGER", str(trigger))
    server = start_server(
        tmp_path,
        str(tiny_model_dir),
        json.dumps(CHAOS_SPECULATIVE_CONFIG),
        per_model={"speculative": {"drafter_timeout_s": "1"}},
    )
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
