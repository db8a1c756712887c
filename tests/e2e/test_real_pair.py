"""Opt-in (TRITONSPEC_REAL_PAIR=1; fetches 1.6 GB once): the real Qwen2.5-Coder pair through
the server, its drafter in int4 as the qwen-coder profile runs it, reproduces the 1.5B target's
own greedy output."""

from __future__ import annotations

import json
import os

import pytest

from client.api.triton import grpc_generate
from tests.fixtures.helpers import hf_greedy
from tests.fixtures.servers import start_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("TRITONSPEC_REAL_PAIR") != "1",
        reason="set TRITONSPEC_REAL_PAIR=1 to run the Qwen2.5-Coder pair (1.6 GB)",
    ),
]

PROMPT = "def fibonacci(n):\n"


def test_qwen_coder_pair_is_lossless(tmp_path):
    from backends.runtime.model_store import fetch

    target, draft = fetch("qwen2.5-coder-1.5b"), fetch("qwen2.5-coder-0.5b")
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4, "quantization": "int4"}
    server = start_server(tmp_path, str(target), json.dumps(config))
    try:
        r = grpc_generate(server.grpc_url, PROMPT, max_tokens=24, timeout_s=900)
        assert tuple(r.output_ids) == hf_greedy(str(target), PROMPT, 24)
        assert r.total_accepted_draft_tokens > 0
    finally:
        server.stop()
