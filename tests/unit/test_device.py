"""The GPU path: which device each model instance uses (backends/runtime/device.py), the device
plumbing into the target runner and every model-based proposer, instance kinds in the
launcher, and, on a CUDA host, the same drafts and tokens on the GPU as on the CPU and the
OpenAI Triton kernels compiled there (the real server's devices: tests/e2e/test_device_server.py).

Tests marked `gpu` skip without CUDA; scripts/gpu_check.sh runs them on a GPU machine."""

from __future__ import annotations

import sys

import pytest
import torch

from backends.config import SpeculativeConfig
from backends.runtime.device import DeviceError, keep_attention_off_cudnn, resolve_device
from backends.runtime.engine import LeanEngine
from backends.serving import rejection
from backends.serving.proposer import DraftRequest, build_proposer, proposer_class
from backends.serving.target import TargetRunner, VerifyRequest
from client.cli.launcher import RepositoryOverrides, patched_repository, set_instance_kind
from tests.fixtures.helpers import hf_greedy, three_layer_target_dir
from tests.fixtures.synthetic_blocks import write_dflash, write_dspark
from tests.fixtures.synthetic_checkpoints import write_eagle1, write_eagle3
from tests.fixtures.synthetic_heads import write_medusa, write_mlp_speculator, write_mtp

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (scripts/gpu_check.sh)")
PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The"]
K, STEPS = 3, 5
# Every registered method that holds weights: its checkpoint writer (None: the draft model).
MODEL_BASED = {
    "draft_model": None,
    "eagle": write_eagle1,
    "eagle3": write_eagle3,
    "medusa": write_medusa,
    "mlp_speculator": write_mlp_speculator,
    "mtp": write_mtp,
    "dflash": write_dflash,
    "dspark": write_dspark,
}


# ---------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(
    "kind, device_id, parameter, environment, num_cuda, expected",
    [
        ("GPU", "1", "", "", 2, "cuda:1"),  # KIND_GPU: the instance's own GPU
        ("CPU", "0", "", "", 0, "cpu"),
        ("CPU", "0", "", "", 1, "cpu"),  # KIND_CPU stays on the CPU even where there is a GPU
        ("AUTO", "0", "", "", 0, "cpu"),
        ("AUTO", "0", "", "", 1, "cuda:0"),
        ("", "0", "", "", 1, "cuda:0"),
        ("GPU", "0", "cpu", "", 1, "cpu"),  # the parameter overrides the kind ...
        ("CPU", "0", "cuda:1", "", 2, "cuda:1"),
        ("CPU", "0", "auto", "", 1, "cuda:0"),
        ("CPU", "0", "AUTO", "", 0, "cpu"),
        ("CPU", "0", "", "auto", 1, "cuda:0"),  # ... and so does $TRITONSPEC_DEVICE
        ("CPU", "0", "cpu", "cuda", 1, "cpu"),  # the parameter wins over the environment
        ("GPU", "1", "cuda", "", 2, "cuda:1"),  # `cuda` = the instance's GPU
    ],
)
def test_device_rule(kind, device_id, parameter, environment, num_cuda, expected):
    device, why = resolve_device(kind, device_id, parameter, environment, num_cuda)
    assert device == expected
    assert why  # logged beside the device


@pytest.mark.parametrize(
    "kind, parameter, environment, num_cuda, message",
    [
        ("GPU", "", "", 0, r"instance_group KIND_GPU .*asks for a GPU, but torch .* has no CUDA device"),
        ("CPU", "cuda", "", 0, r"parameter device='cuda' asks for a GPU"),
        ("CPU", "", "cuda:0", 0, r"TRITONSPEC_DEVICE='cuda:0' asks for a GPU"),
        ("CPU", "cuda:3", "", 2, r"asks for cuda:3, but torch sees 2 CUDA device"),
        ("GPU", "tpu", "", 1, r"parameter device='tpu': not a device; use one of auto, cpu, cuda, cuda:N"),
        ("CPU", "cuda:x", "", 1, r"not a device"),
    ],
)
def test_a_device_that_cannot_be_used_is_a_load_error(kind, parameter, environment, num_cuda, message):
    with pytest.raises(DeviceError, match=message):
        resolve_device(kind, 0, parameter, environment, num_cuda)


def test_the_environment_variable_is_read_when_not_given(monkeypatch):
    monkeypatch.setenv("TRITONSPEC_DEVICE", "cpu")
    assert resolve_device("GPU", 0, "", num_cuda=1) == ("cpu", "TRITONSPEC_DEVICE='cpu'")
    monkeypatch.delenv("TRITONSPEC_DEVICE")
    assert resolve_device("GPU", 0, "", num_cuda=1)[0] == "cuda:0"


def test_instance_kinds_in_the_patched_repository(tmp_path):
    from client.cli.launcher import DEFAULT_REPOSITORY

    verifier = (DEFAULT_REPOSITORY / "verifier" / "config.pbtxt").read_text()
    assert "kind: KIND_CPU" in verifier  # the shipped default: CPU hosts
    assert "kind: KIND_GPU" in set_instance_kind(verifier, "KIND_GPU")
    with pytest.raises(ValueError, match="KIND_CPU, KIND_GPU, KIND_AUTO"):
        set_instance_kind(verifier, "GPU")
    overrides = RepositoryOverrides(
        instance_kinds={"verifier": "KIND_GPU", "drafter": "KIND_GPU"}, common={"device": "cpu"}
    )
    out = patched_repository(DEFAULT_REPOSITORY, overrides, tmp_path / "repo")
    for name, kind in (("verifier", "KIND_GPU"), ("drafter", "KIND_GPU"), ("speculative", "KIND_CPU")):
        text = (out / name / "config.pbtxt").read_text()
        assert f"kind: {kind}" in text, name
        # `device` is declared by the models that place weights, and only there.
        assert ('key: "device" value: { string_value: "cpu" }' in text) == (name != "speculative"), name


# ---------------------------------------------------------------------------- plumbing


target_dir = three_layer_target_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, target_dir, tiny_draft_dir):
    root = tmp_path_factory.mktemp("device-heads")
    out = {}
    for method, writer in MODEL_BASED.items():
        if writer is None:
            out[method] = tiny_draft_dir
        else:
            writer(root / method, target_dir)
            out[method] = root / method
    return out


def make_proposer(
    method: str, checkpoints: dict, target_dir, device: str, sample: str = "greedy", seed: int | None = None
):
    config = SpeculativeConfig.from_json(
        {
            "method": method,
            "model": str(checkpoints[method]),
            "num_speculative_tokens": K,
            "draft_sample_method": sample,
        },
        target_model=str(target_dir),
    )
    return build_proposer(config, max_model_len=256, target_model=target_dir, dtype="float32", device=device, seed=seed)


def tensors_of(proposer) -> list[torch.Tensor]:
    engine = getattr(proposer, "engine", None)  # draft_model's
    if isinstance(engine, LeanEngine):  # the lean runtime holds the only copy of its weights
        return engine.lm.tensors()
    module = proposer.head if engine is None else engine.model
    return list(module.parameters()) + [b for b in module.buffers() if b is not None]


@torch.inference_mode()
def speculate(runner: TargetRunner, proposer, prompt_ids: list[int], sampling=None) -> tuple[list, list[int]]:
    """Draft -> verify in process for STEPS steps, hidden states passed as the orchestrator
    passes them; (the Draft of each step, the emitted tokens)."""
    seq, layers = 7, proposer.hidden_layer_ids
    result = runner.verify(VerifyRequest(seq, prompt_ids, [], sampling, layers, max_new_tokens=64))
    tokens, hidden, drafts = prompt_ids + result.token_ids, result.hidden_states, []
    seen, accepted = 0, 0  # what the proposer saw last call, and how many of its drafts were accepted
    for _ in range(STEPS):
        request = DraftRequest(seq, list(tokens), K, hidden, num_new=len(tokens) - seen, num_accepted=accepted)
        draft = proposer.propose([request])[0]
        drafts.append(draft)
        seen = len(tokens)
        result = runner.verify(
            VerifyRequest(seq, [], draft.token_ids, hidden_layer_ids=layers, draft_probs=draft.probs)
        )
        tokens += result.token_ids
        hidden, accepted = result.hidden_states, result.num_accepted
    runner.release(seq)
    proposer.release(seq)
    return drafts, tokens[len(prompt_ids) :]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


def assert_target_greedy(target_dir, out: list[int], prompt: str) -> None:
    expected = hf_greedy(str(target_dir), prompt, len(out))
    assert out[: len(expected)] == list(expected)  # HF stops early only at EOS


@pytest.mark.parametrize("method", MODEL_BASED)
def test_model_based_proposers_build_and_draft_on_the_cpu(method, checkpoints, target_dir, runner, prompt_ids):
    proposer = make_proposer(method, checkpoints, target_dir, "cpu")
    assert proposer.device == torch.device("cpu") and proposer.generator.device.type == "cpu"
    assert all(t.device.type == "cpu" for t in tensors_of(proposer))
    for prompt, ids in zip(PROMPTS, prompt_ids):
        drafts, out = speculate(runner, proposer, ids)
        assert any(d.token_ids for d in drafts)
        assert_target_greedy(target_dir, out, prompt)


@pytest.mark.parametrize("method", MODEL_BASED)
def test_from_config_puts_weights_and_generator_on_the_device_given(method, checkpoints, target_dir, monkeypatch):
    """`meta` (no data, any host) stands for a GPU: every parameter and buffer must land on
    it. Generators cannot live on meta, so the proposers' generator factory is replaced by
    one that records the device it was asked for."""
    proposer_class(method)  # imported, so that its modules can be patched
    for module in list(sys.modules.values()):
        if module is not rejection and getattr(module, "new_generator", None) is rejection.new_generator:
            monkeypatch.setattr(module, "new_generator", lambda device, seed: ("generator on", torch.device(device)))
    proposer = make_proposer(method, checkpoints, target_dir, "meta")
    assert proposer.device.type == "meta"
    assert proposer.generator == ("generator on", torch.device("meta"))
    assert all(t.device.type == "meta" for t in tensors_of(proposer))


def test_target_runner_and_ngram_gpu_take_the_device(target_dir):
    # transformers: the lean runtime measures its steps at start-up, which meta (no data) cannot run
    runner = TargetRunner(target_dir, dtype="float32", device="meta", runtime="hf")
    assert runner.device.type == "meta" and all(p.device.type == "meta" for p in runner.engine.model.parameters())
    config = SpeculativeConfig.from_json({"method": "ngram_gpu", "num_speculative_tokens": 3}, target_model=None)
    assert build_proposer(config, max_model_len=256, device="meta").device.type == "meta"


def test_int8_draft_model_runs_on_the_cpu_only(tiny_draft_dir, tiny_model_dir):
    config = SpeculativeConfig.from_json(
        {"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 3, "quantization": "int8"},
        target_model=str(tiny_model_dir),
    )
    with pytest.raises(ValueError, match="int8.*CPU only.*cuda:0"):
        build_proposer(config, max_model_len=256, target_model=tiny_model_dir, device="cuda:0")


# ---------------------------------------------------------------------------- on the GPU


@gpu
def test_target_runner_on_cuda_equals_cpu(target_dir, runner, prompt_ids):
    cuda_runner = TargetRunner(target_dir, dtype="float32", device="cuda")
    layers = (0, 2, -1)
    for ids in prompt_ids:
        wrong = [(t + 1) % 384 for t in ids[-3:]]  # drafts the target rejects
        results = {}
        for name, each in (("cpu", runner), ("cuda", cuda_runner)):
            first = each.verify(VerifyRequest(3, ids[:-3], [], hidden_layer_ids=layers, max_new_tokens=16))
            second = each.verify(VerifyRequest(3, [], first.token_ids[:1] + wrong[:2], hidden_layer_ids=layers))
            if name == "cuda":  # the lean runtime on the GPU's Triton kernels, its KV pool there
                assert each.engine.lm.triton_kernels and each.engine.pool.kv.device.type == "cuda"
                assert each.sequences[3].generator.device.type == "cuda"
            each.release(3)
            results[name] = (first, second)
        for cpu, cuda in zip(results["cpu"], results["cuda"]):
            assert cuda.token_ids == cpu.token_ids
            torch.testing.assert_close(cuda.hidden_states.cpu(), cpu.hidden_states, rtol=1e-4, atol=1e-4)


@gpu
@pytest.mark.parametrize("method", MODEL_BASED)
def test_proposers_on_cuda_draft_what_they_draft_on_the_cpu(method, checkpoints, target_dir, runner, prompt_ids):
    cuda_runner = TargetRunner(target_dir, dtype="float32", device="cuda")
    on_cpu = make_proposer(method, checkpoints, target_dir, "cpu")
    on_cuda = make_proposer(method, checkpoints, target_dir, "cuda")
    assert all(t.device.type == "cuda" for t in tensors_of(on_cuda)) and on_cuda.generator.device.type == "cuda"
    for prompt, ids in zip(PROMPTS, prompt_ids):
        cpu_drafts, cpu_out = speculate(runner, on_cpu, ids)
        cuda_drafts, cuda_out = speculate(cuda_runner, on_cuda, ids)
        assert [d.token_ids for d in cuda_drafts] == [d.token_ids for d in cpu_drafts]
        assert cuda_out == cpu_out
        assert_target_greedy(target_dir, cuda_out, prompt)


@gpu
@pytest.mark.parametrize("method", ["draft_model", "eagle3", "mlp_speculator", "dspark"])
def test_sampled_drafts_and_verification_stay_on_cuda(method, checkpoints, target_dir, prompt_ids):
    """Probabilistic drafts keep their probabilities on the GPU, the verifier's seeded
    generator lives there, and a seeded request gives the same tokens twice."""
    from backends.serving.request import SamplingParams

    runner = TargetRunner(target_dir, dtype="float32", device="cuda")
    outs = []
    for _ in range(2):
        proposer = make_proposer(method, checkpoints, target_dir, "cuda", "probabilistic", seed=5)
        drafts, out = speculate(runner, proposer, prompt_ids[0], SamplingParams(temperature=0.8, seed=11))
        drafted = [d for d in drafts if d.token_ids]
        assert drafted and all(d.probs.device.type == "cuda" for d in drafted)
        outs.append(out)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("device, turned_off", [("cuda:0", True), ("cuda", True), ("cpu", False), ("meta", False)])
def test_transformers_attention_on_a_gpu_stays_off_cudnn(device, turned_off, monkeypatch):
    """cuDNN's attention plans again for every new shape, which decoding makes every step."""
    calls = []
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", calls.append)
    keep_attention_off_cudnn(device)
    assert calls == ([False] if turned_off else [])
