"""Verifying in the `speculative` model's process (`verifier_in_process`) through a real server:
the output is the target's own, concurrent streams batch there, sampling, logprobs and the
hidden states a head drafts from come through, and the `verifier` model stands by."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from client.api.triton import grpc_generate
from tests.fixtures.helpers import (
    active_sequences,
    grpc_request,
    hf_greedy,
    served_greedy_results,
    wait_for_no_active_sequences,
)
from tests.fixtures.servers import start_server
from tests.fixtures.synthetic_checkpoints import write_eagle1

PROMPTS = [
    "def add(a, b):\n    return a + b\ndef add(a, b):",
    "The quick brown fox jumps over the lazy dog. The",
    "for i in range(10):\n    print(i",
]
IN_PROCESS = {"speculative": {"verifier_in_process": "true"}}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """EAGLE-1 drafts from the final hidden states that each verification returns."""
    root = tmp_path_factory.mktemp("in-process")
    write_eagle1(root / "head", tiny_model_dir)
    config = {"method": "eagle", "model": str(root / "head"), "num_speculative_tokens": 3}
    server = start_server(root, str(tiny_model_dir), json.dumps(config), per_model=IN_PROCESS)
    yield server
    server.stop()


def test_greedy_output_is_the_target_greedy_output(server, tiny_model_dir):
    results = served_greedy_results(server, tiny_model_dir, PROMPTS, 24, num_draft_tokens=3)
    assert sum(r.total_draft_tokens for r in results) > 0  # the head drafted from the hidden states
    plain = grpc_generate(server.grpc_url, PROMPTS[0], max_tokens=24, num_draft_tokens=0)
    assert tuple(plain.output_ids) == hf_greedy(str(tiny_model_dir), PROMPTS[0], 24)
    log = server.log_path.read_text()
    assert "verifying in this process (verifier_in_process)" in log
    assert "verifier standing by" in log


def test_concurrent_streams_share_steps_and_each_gets_its_own_output(server, tiny_model_dir):
    prompts = PROMPTS * 2
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: grpc_generate(server.grpc_url, p, max_tokens=24), prompts))
    for prompt, result in zip(prompts, results):
        assert tuple(result.output_ids) == hf_greedy(str(tiny_model_dir), prompt, 24), prompt
    assert not any(wait_for_no_active_sequences(server).values())
    assert "verifier" in active_sequences(server)  # the gauge, under the verifier's name


def test_seeded_sampling_and_logprobs_come_through(server, tiny_server):
    """Plain sampling with a seed draws what the BLS-verified server draws; logprobs (which
    the BLS batcher leaves to one request a step) are the target's, speculative == plain."""
    sampled = dict(max_tokens=16, num_draft_tokens=0, temperature=1.3, random_seed=7, ignore_eos=True)
    here, there = (grpc_generate(s.grpc_url, PROMPTS[1], **sampled) for s in (server, tiny_server))
    assert here.output_ids == there.output_ids
    kw = dict(max_tokens=16, stream=False, sampling_parameters={"logprobs": 2}, return_logprobs=True)
    plain = grpc_generate(server.grpc_url, PROMPTS[0], num_draft_tokens=0, **kw)
    spec = grpc_generate(server.grpc_url, PROMPTS[0], num_draft_tokens=3, **kw)
    assert spec.output_ids == plain.output_ids and spec.total_draft_tokens > 0
    assert len(spec.logprobs) == len(plain.output_ids)
    for s, p in zip(spec.logprobs, plain.logprobs):
        assert list(s) == list(p)
        for token in p:
            assert s[token]["logprob"] == pytest.approx(p[token]["logprob"], abs=1e-5)


def test_the_standing_by_verifier_refuses_requests(server):
    inputs = {"input_ids": np.array([[1, 2, 3]], np.int64), "draft_ids": np.zeros((1, 0), np.int64)}
    error = grpc_request(server, "verifier", inputs, sequence_id=5, sequence_start=True, sequence_end=True)
    assert "standing by" in error and "verifier_in_process" in error
    assert tuple(grpc_generate(server.grpc_url, PROMPTS[2], max_tokens=4).output_ids)  # still serving
