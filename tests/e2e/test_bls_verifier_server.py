"""Where the target's forward runs: in the `speculative` model's process (the shipped default,
`verifier_in_process` "auto", as `tiny_server` runs) or in the `verifier` model over BLS
(`bls_server`, "false"). Through real servers: the output is the target's own either way,
concurrent streams batch, sampling, logprobs and the hidden states a head drafts from come
through, and a standing-by verifier refuses requests by name."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from client.api.triton import grpc_generate
from client.cli.launcher import pids_with_cmdline
from tests.fixtures.helpers import (
    active_sequences,
    grpc_request,
    hf_greedy,
    metric_values,
    served_greedy_results,
    wait_for_no_active_sequences,
)

PROMPTS = [
    "def add(a, b):\n    return a + b\ndef add(a, b):",
    "The quick brown fox jumps over the lazy dog. The",
    "for i in range(10):\n    print(i",
]


def test_the_shipped_repository_verifies_in_process_and_bls_when_pinned(tiny_server, bls_server):
    default, pinned = (s.log_path.read_text() for s in (tiny_server, bls_server))
    assert "verifying in this process (verifier_in_process)" in default and "verifier standing by" in default
    assert "verifying in this process" not in pinned and "verifier standing by" not in pinned
    assert "verify steps of concurrent sequences go to 'verifier' in batches" in pinned


def _stub_libraries(server, instance: str) -> str:
    """The shared libraries that the Python stub of model instance `instance` has mapped."""
    (pid,) = pids_with_cmdline(server.shm_prefix, b"triton_python_backend_stub", b"\0" + instance.encode() + b"\0")
    with open(f"/proc/{pid}/maps") as maps:
        return "".join(line for line in maps if ".so" in line)


@pytest.mark.parametrize("model", ["verifier", "drafter"])
def test_a_standing_by_model_loads_neither_torch_nor_the_target(tiny_server, bls_server, model):
    """Its stub would import them beside `speculative`'s own load, on the same cores. On
    `tiny_server` the orchestrator verifies and drafts (ngram) in its own process; on
    `bls_server` it calls both models (an EAGLE head drafts from hidden states over BLS)."""
    assert f"{model} standing by" in tiny_server.log_path.read_text()
    assert "libtorch" not in _stub_libraries(tiny_server, f"{model}_0_0")
    assert "libtorch" in _stub_libraries(bls_server, f"{model}_0_0")  # the one that serves


def test_greedy_output_over_bls_is_the_target_greedy_output(bls_server, tiny_model_dir):
    results = served_greedy_results(bls_server, tiny_model_dir, PROMPTS, 24, num_draft_tokens=3)
    assert sum(r.total_draft_tokens for r in results) > 0  # the head drafted from the hidden states
    plain = grpc_generate(bls_server.grpc_url, PROMPTS[0], max_tokens=24, num_draft_tokens=0)
    assert tuple(plain.output_ids) == hf_greedy(str(tiny_model_dir), PROMPTS[0], 24)


def test_concurrent_streams_reach_the_verifier_batched(bls_server, tiny_model_dir):
    def verifier_requests() -> float:
        return metric_values(bls_server, "nv_inference_request_success").get('model="verifier",version="1"', 0.0)

    prompts = PROMPTS * 2
    before = verifier_requests()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: grpc_generate(bls_server.grpc_url, p, max_tokens=24), prompts))
    for prompt, result in zip(prompts, results):
        assert tuple(result.output_ids) == hf_greedy(str(tiny_model_dir), prompt, 24), prompt
    assert not any(wait_for_no_active_sequences(bls_server).values())
    assert "verifier" in active_sequences(bls_server)
    # The streams' steps (and releases) reached the verifier batched: fewer requests than steps.
    assert verifier_requests() - before < sum(r.perf_metrics["num_steps"] for r in results)


def test_seeded_sampling_and_logprobs_are_the_same_in_process_and_over_bls(tiny_server, bls_server):
    """Plain sampling with a seed draws the same tokens on both paths; logprobs (batched in
    process, one request a step over BLS) are the target's, speculative == plain."""
    sampled = dict(max_tokens=16, num_draft_tokens=0, temperature=1.3, random_seed=7, ignore_eos=True)
    here, there = (grpc_generate(s.grpc_url, PROMPTS[1], **sampled) for s in (tiny_server, bls_server))
    assert here.output_ids == there.output_ids
    kw = dict(max_tokens=16, stream=False, sampling_parameters={"logprobs": 2}, return_logprobs=True)
    for server in (tiny_server, bls_server):
        plain = grpc_generate(server.grpc_url, PROMPTS[0], num_draft_tokens=0, **kw)
        spec = grpc_generate(server.grpc_url, PROMPTS[0], num_draft_tokens=3, **kw)
        assert spec.output_ids == plain.output_ids and spec.total_draft_tokens > 0
        assert len(spec.logprobs) == len(plain.output_ids)
        for s, p in zip(spec.logprobs, plain.logprobs):
            assert list(s) == list(p)
            for token in p:
                assert s[token]["logprob"] == pytest.approx(p[token]["logprob"], abs=1e-5)


def test_the_standing_by_verifier_refuses_requests(tiny_server):
    inputs = {"input_ids": np.array([[1, 2, 3]], np.int64), "draft_ids": np.zeros((1, 0), np.int64)}
    error = grpc_request(tiny_server, "verifier", inputs, sequence_id=5, sequence_start=True, sequence_end=True)
    assert "standing by" in error and "verifier_in_process" in error
    assert tuple(grpc_generate(tiny_server.grpc_url, PROMPTS[2], max_tokens=4).output_ids)  # still serving
