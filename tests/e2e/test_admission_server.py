"""Admission that queues and preemption by recompute through a real tritonserver: a KV pool
too small for the requests sent together, verified in the orchestrator's process and over BLS
(the `waiting` answer on the wire). Every request is answered with exactly the target's own
greedy output, though requests waited for room and running ones were preempted and resumed."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from backends.runtime.model_store import load_config
from backends.serving.target_engine import kv_bytes_per_token
from client.api.triton import grpc_generate
from tests.fixtures.helpers import hf_greedy, metric_values, wait_for_no_active_sequences
from tests.fixtures.prompts import TINY_PROMPTS
from tests.fixtures.servers import fixture_servers

PROMPTS = [*TINY_PROMPTS, "one two three four five six seven"]
MAX_TOKENS = 48
POOL_BLOCKS = 8  # of 16 tokens: two or three of these requests at a time


@pytest.fixture(scope="module")
def small_pool_servers(tiny_model_dir, tmp_path_factory):
    per_token = kv_bytes_per_token(load_config(tiny_model_dir), "float32")
    pool_gb = str((POOL_BLOCKS * 16 + 0.5) * per_token / 2**30)
    specs = {
        name: dict(
            model=str(tiny_model_dir),
            per_model={
                "verifier": {"kv_cache_memory_gb": pool_gb},
                "speculative": {"verifier_in_process": in_process, "max_queue_time_s": "120"},
            },
        )
        for name, in_process in (("small-pool", "true"), ("small-pool-bls", "false"))
    }
    yield from fixture_servers(tmp_path_factory, specs)


@pytest.mark.parametrize("name", ["small-pool", "small-pool-bls"])
def test_requests_beyond_the_pool_queue_and_resume_with_the_target_s_output(small_pool_servers, tiny_model_dir, name):
    server = small_pool_servers[name]
    expected = [hf_greedy(str(tiny_model_dir), p, MAX_TOKENS) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        results = list(
            pool.map(lambda p: grpc_generate(server.grpc_url, p, max_tokens=MAX_TOKENS, timeout_s=300), PROMPTS * 2)
        )
    for result, want in zip(results, expected * 2):
        assert tuple(result.output_ids) == want
    log = server.log_path.read_text(errors="replace")
    assert "preempted (KV pool short)" in log  # they did not all fit: some were preempted and resumed
    wait_for_no_active_sequences(server)
    # Verified in process, the orchestrator's metrics count the scheduler's preemptions, and
    # nothing waits once every request is answered (the BLS verifier's are its own process's).
    if name == "small-pool":
        # The metrics are written from a thread of their own, in batches of 50 ms: wait for
        # the last preemptions and admissions to reach /metrics (a suite run read one
        # preemption short, 14 of 15, and another one request still waiting).
        logged, deadline = log.count("preempted (KV pool short)"), time.monotonic() + 10
        while True:
            preemptions = sum(metric_values(server, "vllm:num_preemptions_total").values())
            (waiting,) = metric_values(server, "vllm:num_requests_waiting").values()
            if (preemptions, waiting) == (logged, 0) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert (preemptions, waiting) == (logged, 0)
