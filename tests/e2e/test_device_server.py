"""The devices of the real server's model instances: a GPU the host cannot give fails that
model's load with the reason, and on a CUDA host KIND_GPU instances put their weights on the
GPU and still give the target's greedy output.

Tests marked `gpu` skip without CUDA; scripts/gpu_check.sh runs them on a GPU machine."""

from __future__ import annotations

import json
import re

import pytest
import torch

from client.api.triton import http_generate
from tests.fixtures.helpers import hf_greedy, three_layer_target_dir
from tests.fixtures.servers import start_server
from tests.fixtures.synthetic_checkpoints import write_eagle3

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (scripts/gpu_check.sh)")
PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The"]
K = 3


target_dir = three_layer_target_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, target_dir, tiny_draft_dir):
    root = tmp_path_factory.mktemp("device-heads")
    write_eagle3(root / "eagle3", target_dir)
    return {"draft_model": tiny_draft_dir, "eagle3": root / "eagle3"}


def server_log(server) -> str:
    return server.log_path.read_text(errors="replace")


@pytest.mark.skipif(CUDA, reason="checks the error a host without CUDA gives")
def test_a_gpu_the_server_cannot_use_fails_that_models_load_with_the_reason(tiny_model_dir, tmp_path):
    # ngram drafting in the drafter model, which resolves its own device
    per_model = {"verifier": {"device": "cuda"}, "speculative": {"drafter_in_process": "false"}}
    server = start_server(tmp_path, str(tiny_model_dir), require_all_models=False, per_model=per_model)
    try:
        states = server.model_states()
        # The verifier's target loads in the orchestrator's process (verifier_in_process "auto").
        state, reason = states["speculative"]
        assert state != "READY" and "parameter device='cuda' asks for a GPU" in reason, states["speculative"]
        assert states["drafter"][0] == "READY"
        assert re.search(r"drafter instance \S+: device cpu \(instance_group KIND_CPU\)", server_log(server))
    finally:
        server.stop()


@gpu
@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_served_greedy_on_kind_gpu_equals_target_greedy(method, checkpoints, target_dir, tmp_path):
    """The real server with KIND_GPU verifier and drafter: weights on cuda:0 (the log says
    so; eagle3's head drafts beside the in-process verifier, its drafter model standing by),
    output == the target's own greedy output."""
    config = json.dumps({"method": method, "model": str(checkpoints[method]), "num_speculative_tokens": K})
    server = start_server(
        tmp_path,
        str(target_dir),
        config,
        sequence_idle_timeout_s="5",
        instance_kinds={"verifier": "KIND_GPU", "drafter": "KIND_GPU"},
    )
    try:
        log = server_log(server)
        drafter = {
            "draft_model": r"drafter instance \S+: device cuda:0 \(instance_group KIND_GPU, GPU 0\)",
            "eagle3": r"drafter 'drafter' drafts in this process, beside the verifier, on cuda:0",
        }
        assert re.search(drafter[method], log)
        assert re.search(r"the target of 'verifier' on cuda:0 \(instance_group KIND_GPU, GPU 0\)", log)
        drafted = 0
        for prompt in PROMPTS:
            result = http_generate(server.http_url, prompt, max_tokens=24)
            assert tuple(result.output_ids) == hf_greedy(str(target_dir), prompt, 24), prompt
            drafted += result.total_draft_tokens
        assert drafted > 0
    finally:
        server.stop()
