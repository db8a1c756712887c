"""`tritonspec soak`'s judgement: the KV pool it sizes, RSS growth after warm-up, and what
fails a chaos soak (client/cli/soak.py, client/cli/measure_commands.py)."""

from __future__ import annotations

import http.server
import threading
import time
from pathlib import Path

import pytest
import torch

from backends.runtime.kv_cache import KVCachePool
from backends.runtime.model_store import load_tokenizer
from client.cli.bench import load_prompts
from client.cli.measure_commands import RSS_FLAT_MB, _chaos_failures
from client.cli.soak import HealthProbe, kv_budget_gb, retryable, rss_growth_mb


def test_kv_budget_holds_exactly_the_sequences_asked_for(tiny_model_dir):
    """The budget becomes a pool of whole blocks: room for each sequence's longest prompt,
    its tokens and a step's drafts, for `sequences` of them and not one block more."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    tokenizer = load_tokenizer(tiny_model_dir)
    _, prompts = load_prompts()
    longest = max(len(tokenizer(p)["input_ids"]) for ps in prompts.values() for p in ps)
    head_dim = config.hidden_size // config.num_attention_heads
    budget = kv_budget_gb(tiny_model_dir, "float32", sequences=8, max_tokens=32)
    pool = KVCachePool(
        config.num_hidden_layers,
        config.num_key_value_heads,
        head_dim,
        memory_gb=float(repr(budget)),
        dtype=torch.float32,
    )
    per_sequence = pool.num_blocks // 8
    assert pool.num_blocks == 8 * per_sequence
    assert (per_sequence - 1) * pool.block_size >= longest + 32 + 8
    assert (per_sequence - 2) * pool.block_size < longest + 32 + 8


def test_rss_growth_counts_only_after_warm_up():
    memory = [(0.0, 1000.0), (10.0, 1400.0), (20.0, 1500.0), (30.0, 1510.0), (40.0, 1505.0)]
    assert rss_growth_mb(memory, warmup_s=20.0) == 10.0
    assert rss_growth_mb(memory, warmup_s=0.0) == 510.0
    assert rss_growth_mb(memory, warmup_s=40.0) == 0.0  # one sample: nothing to compare


def test_retryable_refusals_are_not_lost_requests():
    assert retryable(RuntimeError("unavailable: the server is at its limit of 64 requests running"))
    assert retryable(RuntimeError("KV cache budget full: the request waited 60.0 s (max_queue_time_s)"))
    assert not retryable(RuntimeError("generation failed: the verifier crashed"))
    assert not retryable(RuntimeError("max_tokens must be at least 1, got 0"))


CLEAN = {
    "wrong": 0,
    "cancelled_wrong": 0,
    "errors": 0,
    "bad_misjudged": 0,
    "oversized_misjudged": 0,
    "kv_usage_end": 0.0,
    "health_ms_max": 40.0,
    "health_slowest": [(12.0, 40.0)],
}


def test_a_clean_chaos_soak_passes():
    assert _chaos_failures(CLEAN, ready=True, active={"speculative": 0.0}, rss_growth=5.0) == []


@pytest.mark.parametrize(
    ("change", "active", "rss_growth", "named"),
    [
        ({"wrong": 1}, {}, 0.0, "wrong outputs"),
        ({"errors": 2}, {}, 0.0, "2 requests lost"),
        ({"oversized_misjudged": 1}, {}, 0.0, "misjudged"),
        ({"kv_usage_end": 0.125}, {}, 0.0, "KV blocks still held"),
        ({"health_ms_max": 250.0}, {}, 0.0, "/health took 250 ms"),
        ({}, {"speculative": 1.0}, 0.0, "sequence state left"),
        ({}, {}, RSS_FLAT_MB + 1, "RSS rose"),
    ],
)
def test_each_broken_promise_fails_the_chaos_soak(change, active, rss_growth, named):
    failures = _chaos_failures({**CLEAN, **change}, ready=True, active=active, rss_growth=rss_growth)
    assert len(failures) == 1 and named in failures[0]


def test_memory_is_told_by_process():
    import os
    import sys

    from client.cli.soak import process_growth, rss_by_process

    rss = rss_by_process([os.getpid(), 2**22 + 7])  # this process, and one that does not exist
    assert list(rss) == [Path(sys.executable).name] or len(rss) == 1
    assert next(iter(rss.values())) > 10
    samples = [(0.0, {"a": 100.0}), (10.0, {"a": 150.0, "b": 10.0}), (20.0, {"a": 151.0, "b": 40.0})]
    assert process_growth(samples, warmup_s=10.0) == {"a": 1.0, "b": 30.0}


def test_the_health_probe_times_each_answer_from_its_own_process():
    """The probe asks once a second from a child process and reports each answer's time:
    an endpoint that takes 300 ms is reported at 300 ms or more, not hidden by the soak."""

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            time.sleep(0.3)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        start = time.monotonic()
        probe = HealthProbe(f"127.0.0.1:{server.server_address[1]}")
        time.sleep(3)
        answers = probe.stop()
        end = time.monotonic()
    finally:
        server.shutdown()
    assert len(answers) >= 2
    assert all(300 <= ms < 2000 for _, ms in answers)
    # when each answer came, on this process's clock: in order, a second or so apart
    whens = [when for when, _ in answers]
    assert start < whens[0] and whens == sorted(whens) and whens[-1] <= end
    assert all(1.0 < b - a < 2.5 for a, b in zip(whens, whens[1:]))
