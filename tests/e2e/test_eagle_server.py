"""EAGLE-1 and EAGLE-3 heads through the real server: the verifier returns the hidden states the
head names, the orchestrator carries them to the drafter, and the output is the target's own
(tiny synthetic checkpoints), also under a grammar (eagle3 also drafting trees, and in bf16);
and a fitted EAGLE-1 head drafting EAGLE-2's dynamic trees (tests/fixtures/head_server.py's
ServedHeadTests)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from safetensors.torch import load_file, save_file

from backends.methods.eagle_head import load_eagle
from backends.methods.head_checkpoint import TargetInfo
from backends.training.eagle import Eagle1Trainer
from client.api.triton import grpc_generate
from tests.fixtures.head_server import ServedHeadTests, fit_and_save, next_token_loss
from tests.fixtures.helpers import hf_greedy, metric_values, served_greedy_results, three_layer_target_dir
from tests.fixtures.servers import fixture_servers, start_server, start_servers, stop_servers
from tests.fixtures.structured import PROMPT, SERVED, check_served_constrained
from tests.fixtures.synthetic_checkpoints import write_eagle1, write_eagle3

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The", "for i in range(10):\n    print(i"]
WRITERS = {"eagle": write_eagle1, "eagle3": write_eagle3}


target_dir = three_layer_target_dir


# int8 heads draft in bf16 with their linears on the int8 kernel: greedy chains in one C call
# (cpu_kernels.eagle_chain); float32 heads draft op by op. (The session's bls-server serves a
# float32 EAGLE-1 head.)
GREEDY = [("eagle", "int8"), ("eagle3", None), ("eagle3", "int8")]
# The structured-output tests' servers besides: eagle3 drafting EAGLE-2's dynamic trees, and
# eagle3 on the target in bf16 (batch-invariant, the served default).
TREE = {"dynamic_tree": {"top_k": 3, "total_token": 8}}
BF16 = {"dtype": "bfloat16", "batch_invariant": "on"}


@pytest.fixture(scope="module")
def greedy_servers(target_dir, tmp_path_factory):
    """{"method-quantization": a synthetic head served} for GREEDY, and "eagle3-tree",
    "eagle3-bf16": launched together."""
    specs, heads = {}, {}
    for method, quantization in GREEDY:
        head = heads[method] = tmp_path_factory.mktemp(f"{method}-head") / method
        WRITERS[method](head, target_dir)
        config = {"method": method, "model": str(head), "num_speculative_tokens": 3}
        if quantization:
            config["quantization"] = quantization
        specs[f"{method}-{quantization}"] = dict(model=str(target_dir), speculative_config=json.dumps(config))
    eagle3 = {"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 3}
    specs["eagle3-tree"] = dict(model=str(target_dir), speculative_config=json.dumps({**eagle3, **TREE}))
    specs["eagle3-bf16"] = dict(model=str(target_dir), speculative_config=json.dumps(eagle3), **BF16)
    yield from fixture_servers(tmp_path_factory, specs)


@pytest.mark.parametrize("method,quantization", GREEDY)
def test_served_greedy_equals_target_greedy(method, quantization, greedy_servers, target_dir):
    """int8: the head (in bf16) drafts with its fc and LM head on the int8 kernel."""
    results = served_greedy_results(greedy_servers[f"{method}-{quantization}"], target_dir, PROMPTS, 24)
    assert sum(r.total_draft_tokens for r in results) > 0


@pytest.mark.parametrize("name", ["eagle-int8", "eagle3-None", "eagle3-tree"])
def test_served_constrained_greedy_equals_target_constrained_greedy(name, greedy_servers, target_dir):
    check_served_constrained(greedy_servers[name], target_dir)


def test_bf16_constrained_speculative_equals_bf16_constrained_plain(greedy_servers):
    """In bf16 the reference is the server's own plain decoding (batch invariance makes a
    verified row the row decoded alone)."""
    server = greedy_servers["eagle3-bf16"]
    for fields in SERVED.values():
        sampling = {"structured_outputs": fields}
        speculative = grpc_generate(
            server.grpc_url, PROMPT, max_tokens=24, sampling_parameters=sampling, num_draft_tokens=3
        )
        plain = grpc_generate(server.grpc_url, PROMPT, max_tokens=24, sampling_parameters=sampling, num_draft_tokens=0)
        assert speculative.output_ids == plain.output_ids, fields
    assert speculative.total_draft_tokens > 0  # free text: the head's drafts (nothing is forced)


def test_a_head_drafts_beside_the_in_process_verifier_or_in_the_drafter_model(target_dir, tmp_path_factory):
    """With the verifier in the `speculative` model's process (the default), the head drafts
    there too, concurrent streams' calls gathered into one propose, and the drafter model gets
    no request; `drafter_in_process: "false"` keeps it in the drafter model. Both give the
    target's own output."""
    head = tmp_path_factory.mktemp("eagle3-beside") / "head"
    write_eagle3(head, target_dir)
    config = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    prompts = PROMPTS * 2
    expected = [hf_greedy(str(target_dir), p, 20) for p in prompts]
    specs = {
        str(beside): dict(
            model=str(target_dir),
            speculative_config=config,
            per_model={"speculative": {"drafter_in_process": str(beside).lower()}},
        )
        for beside in (True, False)
    }
    servers = start_servers(tmp_path_factory, specs)  # launched together
    try:
        for beside in (True, False):
            server = servers[str(beside)]
            with ThreadPoolExecutor(len(prompts)) as pool:
                results = list(pool.map(lambda p, url=server.grpc_url: grpc_generate(url, p, max_tokens=20), prompts))
            drafter_requests = sum(
                v for k, v in metric_values(server, "nv_inference_request_success").items() if 'model="drafter"' in k
            )
            server.stop()  # its whole log written
            assert [tuple(r.output_ids) for r in results] == expected
            assert sum(r.total_draft_tokens for r in results) > 0
            log = server.log_path.read_text()
            assert ("beside the verifier" in log) == beside
            # the verify thread alone runs parallel work, though request threads handle hidden states
            assert "spec-verify_0 runs this process's forwards on" in log and "runs the forwards on" not in log
            assert (drafter_requests == 0) == beside, drafter_requests
    finally:
        stop_servers(servers)


@pytest.fixture(scope="module")
def fitted_dir(tiny_model_dir, tmp_path_factory):
    """An EAGLE-1 head for the served tests' target (the tiny model), fitted to its
    distributions one token further (embedding and LM head stay the target's), written as the
    trainer writes heads."""
    root = tmp_path_factory.mktemp("eagle-fitted")
    write_eagle1(root / "random", tiny_model_dir)
    head = load_eagle(root / "random", TargetInfo.load(tiny_model_dir), "float32")
    head.saved_config = json.loads((root / "random" / "config.json").read_text())
    for name, param in head.named_parameters():
        param.requires_grad = name not in ("embed_tokens.weight", "lm_head.weight")

    return fit_and_save(head, next_token_loss, tiny_model_dir, Eagle1Trainer().save, root / "head")


class TestServedTree(ServedHeadTests):
    METHOD = "eagle"
    EXTRA = {"dynamic_tree": {"top_k": 3, "total_token": 8}}
    # Sampled verification of these fixed-token trees is served by mtp's static tree (the same
    # EagleProposer, tests/e2e/test_mtp_server.py) and tested in process (test_tree_sampling.py,
    # test_tree_verify.py); served here too it took three more minutes of the suite.
    test_served_sampling_follows_the_target_distribution = None


def test_a_head_that_cannot_be_built_beside_the_verifier_fails_the_load_by_name(target_dir, tmp_path):
    """The drafter model stands by while the head drafts beside the in-process verifier, so a
    head that parses but cannot be built (a weight missing) fails the `speculative` model's load
    with the loader's own message, as the drafter model's load did when it loaded a copy."""
    head = tmp_path / "eagle3-broken"
    write_eagle3(head, target_dir)
    (weights,) = head.glob("*.safetensors")
    save_file({k: v for k, v in load_file(weights).items() if k != "fc.weight"}, weights)
    config = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    server = start_server(tmp_path, str(target_dir), config, require_all_models=False)
    try:
        states = server.model_states()
        state, reason = states["speculative"]
        assert state != "READY" and "its head cannot be built" in reason and "fc.weight" in reason, states
        assert states["drafter"][0] == "READY"  # standing by: it loaded no head
    finally:
        server.stop()
