"""`tritonspec export-onnx`: drafter heads (synthetic checkpoints in the published layouts)
exported to ONNX match the torch heads under onnxruntime at other shapes than the export's,
a chain of ONNX draft steps drafts what the proposer drafts, and mismatches are caught."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from backends.config import SpeculativeConfig
from backends.onnx_export import OnnxExportError, build_step, check_step, export_head, export_step
from backends.serving.proposer import DraftRequest, build_proposer
from backends.serving.target import TargetRunner, VerifyRequest
from client.cli.main import main
from tests.fixtures.helpers import three_layer_target_dir
from tests.fixtures.synthetic_checkpoints import write_eagle1, write_eagle3
from tests.fixtures.synthetic_heads import write_medusa, write_mlp_speculator

VARIANTS = {
    "eagle1-bin": ("eagle", write_eagle1, {}),
    "eagle3-midlayer": ("eagle3", write_eagle3, {}),
    "eagle3-speculators": (
        "eagle3",
        write_eagle3,
        {"speculators": True, "spelling": "layers.0.", "with_embedding": True},
    ),
    "medusa-faster-decoding": ("medusa", write_medusa, {"num_layers": 2}),
    "medusa-vllm-truncated-vocab": ("medusa", write_medusa, {"layout": "vllm", "draft_vocab_size": 200}),
    "mlp-speculator": ("mlp_speculator", write_mlp_speculator, {}),
    "mlp-speculator-tied": ("mlp_speculator", write_mlp_speculator, {"tie_weights": True, "inner_dim": 48}),
}
# The input tensors of each kind of step and their Triton dims (B, T, S: -1).
INPUTS = {
    "eagle": {
        "input_ids": "-1, -1",
        "hidden_states": "-1, -1, 1, 64",
        "position_ids": "-1, -1",
        "draft_ids": "-1, -1",
        "draft_hidden": "-1, -1, 64",
    },
    "eagle3": {
        "input_ids": "-1, -1",
        "hidden_states": "-1, -1, 3, 64",
        "position_ids": "-1, -1",
        "draft_ids": "-1, -1",
        "draft_hidden": "-1, -1, 64",
    },
    "medusa": {"hidden_states": "-1, 64", "token_ids": "-1, 4"},
    "mlp_speculator": {"hidden_states": "-1, 64", "token_ids": "-1, 3"},
}


target_dir = three_layer_target_dir


@pytest.fixture(scope="module")
def exported(tmp_path_factory, target_dir):
    """name -> (checkpoint dir, model dir), exported (and checked) through the CLI."""
    root = tmp_path_factory.mktemp("onnx-heads")
    out = {}
    for name, (method, writer, opts) in VARIANTS.items():
        writer(root / name, target_dir, **opts)
        model_dir = root / f"{name}-onnx"
        assert (
            main(
                [
                    "export-onnx",
                    str(root / name),
                    "--method",
                    method,
                    "--target",
                    str(target_dir),
                    "--out",
                    str(model_dir),
                ]
            )
            == 0
        )
        out[name] = (root / name, model_dir)
    return out


@pytest.mark.parametrize("name", VARIANTS)
def test_exported_head_is_a_triton_onnx_model(name, exported, target_dir):
    method = VARIANTS[name][0]
    _, model_dir = exported[name]
    model = onnx.load(str(model_dir / "1" / "model.onnx"))
    onnx.checker.check_model(model)
    meta = {p.key: p.value for p in model.metadata_props}
    layers = [0, 1, 2] if method == "eagle3" else [-1]
    assert meta["method"] == method and json.loads(meta["hidden_layer_ids"]) == layers
    config = (model_dir / "config.pbtxt").read_text()
    assert 'platform: "onnxruntime_onnx"' in config
    for tensor, dims in INPUTS[method].items():
        assert (
            f'name: "{tensor}" data_type: {"TYPE_FP32" if "hidden" in tensor else "TYPE_INT64"} dims: [ {dims} ]'
            in config
        ), tensor
    assert len(re.findall(r'\{ name: "', config.split("output [")[0])) == len(INPUTS[method])
    steps = {"medusa": 4, "mlp_speculator": 3}.get(method, -1)
    assert f'name: "logits" data_type: TYPE_FP32 dims: [ -1, {steps}, 384 ]' in config  # the target's vocabulary


@pytest.mark.parametrize("name", VARIANTS)
def test_onnx_matches_the_torch_head_at_other_shapes(name, exported, target_dir):
    checkpoint, model_dir = exported[name]
    step = build_step(VARIANTS[name][0], checkpoint, target_dir)
    assert check_step(step, model_dir / "1" / "model.onnx") < 1e-4


@pytest.mark.parametrize("name", ["eagle1-bin", "eagle3-midlayer"])
def test_onnx_draft_chain_equals_the_proposer(name, exported, target_dir):
    """k greedy drafts from the target's real hidden states: k ONNX steps, each appending the
    last draft and the head's hidden state for it (no cache), give the proposer's drafts."""
    method = VARIANTS[name][0]
    checkpoint, model_dir = exported[name]
    config = SpeculativeConfig.from_json(
        {"method": method, "model": str(checkpoint), "num_speculative_tokens": 3}, target_model=str(target_dir)
    )
    proposer = build_proposer(config, max_model_len=512, dtype="float32", target_model=str(target_dir))
    runner = TargetRunner(target_dir, dtype="float32")
    session = ort.InferenceSession(str(model_dir / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    for seq, context in enumerate([[5, 17, 99, 42, 7, 250, 3], [300, 12, 12, 80]]):
        hidden = runner.verify(
            VerifyRequest(seq, context[:-1], [], hidden_layer_ids=proposer.hidden_layer_ids)
        ).hidden_states
        runner.release(seq)
        expected = proposer.propose([DraftRequest(seq, context, 3, hidden)])[0].token_ids
        proposer.release(seq)
        feeds = {
            "input_ids": np.array([context[1:]]),
            "hidden_states": hidden.numpy()[None],
            "position_ids": np.arange(len(context) - 1)[None],
            "draft_ids": np.zeros((1, 0), dtype=np.int64),
            "draft_hidden": np.zeros((1, 0, 64), dtype=np.float32),
        }
        drafts = []
        for _ in range(3):
            logits, out = session.run(["logits", "hidden"], feeds)
            drafts.append(int(logits[0, -1].argmax()))
            feeds["draft_ids"] = np.array([[*feeds["draft_ids"][0], drafts[-1]]])
            feeds["draft_hidden"] = np.concatenate([feeds["draft_hidden"], out[:, -1:]], axis=1)
        assert len(expected) == 3 and drafts == expected, (name, context)


@pytest.mark.parametrize("name", ["medusa-vllm-truncated-vocab", "mlp-speculator-tied"])
def test_onnx_last_hidden_drafts_equal_the_proposer(name, exported, target_dir):
    """Greedy drafts from the target's real last hidden state: Medusa's K heads in one call,
    an MLP speculator's stages in K calls (each filling in the draft just made)."""
    method = VARIANTS[name][0]
    checkpoint, model_dir = exported[name]
    k = {"medusa": 4, "mlp_speculator": 3}[method]
    config = SpeculativeConfig.from_json(
        {"method": method, "model": str(checkpoint), "num_speculative_tokens": k}, target_model=str(target_dir)
    )
    proposer = build_proposer(config, max_model_len=512, dtype="float32", target_model=str(target_dir))
    runner = TargetRunner(target_dir, dtype="float32")
    session = ort.InferenceSession(str(model_dir / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    for seq, context in enumerate([[5, 17, 99, 42, 7, 250, 3], [300, 12, 12, 80]]):
        hidden = runner.verify(VerifyRequest(seq, context[:-1], [], hidden_layer_ids=(-1,))).hidden_states
        runner.release(seq)
        expected = proposer.propose([DraftRequest(seq, context, k, hidden)])[0].token_ids
        tokens = np.zeros((1, k), dtype=np.int64)
        tokens[0, 0] = context[-1]
        drafts = []
        for i in range(k):
            (logits,) = session.run(["logits"], {"hidden_states": hidden[-1:, 0].numpy(), "token_ids": tokens})
            if method == "medusa":  # the heads do not read the tokens: all drafts at once
                drafts = [int(t) for t in logits[0].argmax(-1)]
                break
            drafts.append(int(logits[0, i].argmax()))
            if i + 1 < k:
                tokens[0, i + 1] = drafts[-1]
        assert len(expected) == k and drafts == expected, (name, context)


def test_a_graph_that_differs_from_the_head_is_refused(tmp_path, target_dir):
    write_eagle1(tmp_path / "head", target_dir)
    step = build_step("eagle", tmp_path / "head", target_dir)
    path = export_step(step, tmp_path / "model.onnx")
    with torch.no_grad():
        step.module.head.fc.weight.mul_(1.01)  # the torch head moves on; the file does not
    with pytest.raises(OnnxExportError, match="output 'logits' differs from the torch head"):
        check_step(step, path)


def test_unknown_method_and_bad_checkpoint_are_named(tmp_path, target_dir, capsys):
    write_eagle1(tmp_path / "head", target_dir)
    with pytest.raises(
        OnnxExportError,
        match="method 'medusa_x' has no ONNX exporter; available: eagle, eagle3, medusa, mlp_speculator",
    ):
        export_head("medusa_x", tmp_path / "head", target_dir, tmp_path / "out")
    assert (
        main(
            [
                "export-onnx",
                str(tmp_path / "head"),
                "--method",
                "eagle3",
                "--target",
                str(target_dir),
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 1
    )
    assert "method 'eagle3' needs an EAGLE-3 checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
