"""IBM MLP speculator: the published format (tiny synthetic checkpoints, tied and untied,
prefixed keys, shared tensors stored once or repeated), refusals, drafts against the
published algorithm, stage count, batching, draft probabilities, the writer the trainer
uses, and speculative decoding through the real server."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from backends.config import SpeculativeConfig
from backends.methods.mlp_speculator import (
    MLPSpeculatorCheckpointError,
    MLPSpeculatorProposer,
    load_mlp_speculator,
    save_mlp_speculator,
)
from backends.serving.proposer import DraftRequest, build_proposer
from tests.fixtures.head_server import CONTEXTS, assert_batched_equals_one_at_a_time
from tests.fixtures.helpers import target_hidden
from tests.fixtures.synthetic_checkpoints import refusal_test
from tests.fixtures.synthetic_heads import write_mlp_speculator

H, V = 64, 384
VARIANTS = {
    "untied": {},
    "tied-repeated-prefixed": {"tie_weights": True, "prefix": "speculator."},
    "tied-once-inner48-unscaled": {"tie_weights": True, "repeat_tied": False, "inner_dim": 48, "scale_input": False},
    "untied-4-bin": {"n_predict": 4, "fmt": "bin"},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("mlp")
    return {
        name: (root / name, write_mlp_speculator(root / name, tiny_model_dir, **opts))
        for name, opts in VARIANTS.items()
    }


@pytest.fixture(scope="module")
def hidden(runner):
    return [target_hidden(runner, ids[:-1], (-1,)) for ids in CONTEXTS]


def stage_tensor(name: str, written: dict, kind: str, stage: int, param: str = "weight") -> torch.Tensor:
    """A stage's tensor as the format defines it: with tie_weights emb/head/ln are stage 0's
    and proj >= 1 is proj 1's, wherever the file stores them."""
    opts = VARIANTS[name]
    if opts.get("tie_weights"):
        stage = min(stage, 1) if kind == "proj" else 0
    return written[f"{opts.get('prefix', '')}{kind}.{stage}.{param}"]


def reference_logits(name: str, written: dict, f: torch.Tensor, tokens: list[int]) -> list[torch.Tensor]:
    """fms-extras' algorithm over the written tensors: stage i reads tokens[i] (x_{t+1}, then
    the drafts) and the state the stage before it left."""
    opts = VARIANTS[name]
    n_predict, d = opts.get("n_predict", 3), opts.get("inner_dim") or H
    state_weight = 0.5 ** (0.5 / n_predict)
    emb_weight = math.sqrt((1 - state_weight**2) * d / 2)
    s = f
    if opts.get("scale_input", True):
        s = s / torch.sqrt(s.pow(2).mean() + 1e-6) / math.sqrt(2)
    logits = []
    for i, token in enumerate(tokens):
        s = (
            F.linear(s, stage_tensor(name, written, "proj", i))
            + emb_weight / state_weight * stage_tensor(name, written, "emb", i)[token]
        )
        s = s / torch.sqrt(s.pow(2).mean() + 1e-6) * stage_tensor(name, written, "ln", i) + stage_tensor(
            name, written, "ln", i, "bias"
        )
        s = F.gelu(s)
        logits.append(F.linear(s, stage_tensor(name, written, "head", i)))
    return logits


def reference_drafts(name: str, written: dict, f: torch.Tensor, token: int, k: int) -> list[int]:
    tokens = [token]
    for _ in range(k):
        tokens.append(int(reference_logits(name, written, f, tokens)[-1].argmax()))
    return tokens[1:]


# ---------------------------------------------------------------------------- loading


@pytest.mark.parametrize("name", VARIANTS)
def test_published_layouts_load(name, checkpoints, target):
    path, written = checkpoints[name]
    head = load_mlp_speculator(path, target, "float32")
    n_predict = VARIANTS[name].get("n_predict", 3)
    assert head.num_steps == n_predict
    for i in range(n_predict):
        for kind, module in (("emb", head.emb[i]), ("proj", head.proj[i]), ("head", head.head[i]), ("ln", head.ln[i])):
            assert torch.equal(module.weight, stage_tensor(name, written, kind, i))
        assert torch.equal(head.ln[i].bias, stage_tensor(name, written, "ln", i, "bias"))
    if VARIANTS[name].get("tie_weights"):
        assert head.emb[0] is head.emb[2] and head.proj[1] is head.proj[2] and head.proj[0] is not head.proj[1]


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_drafts_follow_the_published_algorithm(name, checkpoints, target, hidden):
    path, written = checkpoints[name]
    proposer = MLPSpeculatorProposer(load_mlp_speculator(path, target, "float32"), 512)
    for ids, rows in zip(CONTEXTS, hidden):
        draft = proposer.propose([DraftRequest(0, ids, 3, rows)])[0]
        assert draft.token_ids == reference_drafts(name, written, rows[-1, 0], ids[-1], 3)
        assert draft.probs is None


def test_stages_follow_num_speculative_tokens(checkpoints, target, hidden, tiny_model_dir):
    ids, rows = CONTEXTS[0], hidden[0]
    untied, _ = checkpoints["untied-4-bin"]
    assert load_mlp_speculator(untied, target, "float32", num_stages=2).num_steps == 2  # later stages unused
    with pytest.raises(
        MLPSpeculatorCheckpointError,
        match=r"num_speculative_tokens=8 needs 8 stages, but the "
        r"checkpoint has weights for n_predict=4",
    ):
        load_mlp_speculator(untied, target, num_stages=8)
    # Tied stages repeat: 6 stages from n_predict 3, state_weight still from n_predict.
    tied, written = checkpoints["tied-repeated-prefixed"]
    config = SpeculativeConfig.from_json(
        {"model": str(tied), "num_speculative_tokens": 6}, target_model=str(tiny_model_dir)
    )
    proposer = build_proposer(config, max_model_len=512, dtype="float32", target_model=tiny_model_dir)
    assert isinstance(proposer, MLPSpeculatorProposer) and proposer.hidden_layer_ids == (-1,)
    draft = proposer.propose([DraftRequest(0, ids, 6, rows)])[0]
    assert draft.token_ids == reference_drafts("tied-repeated-prefixed", written, rows[-1, 0], ids[-1], 6)


REFUSALS = {
    "tied copies differ": (
        "tied-repeated-prefixed",
        lambda s: {**s, "speculator.emb.2.weight": s["speculator.emb.2.weight"] + 1},
        None,
        r"tie_weights is true, but 'speculator\.emb\.2\.weight' differs from "
        r"'speculator\.emb\.0\.weight'",
    ),
    "missing": (
        "untied",
        lambda s: {k: v for k, v in s.items() if k != "ln.1.bias"},
        None,
        r"missing key 'ln\.1\.bias' \(expected shape \[64\]\)",
    ),
    "projection": (
        "untied",
        lambda s: {**s, "proj.0.weight": torch.zeros(H, 32)},
        None,
        r"'proj\.0\.weight' has shape \[64, 32\], expected \[64, 64\]",
    ),
    "stage beyond n_predict": (
        "untied",
        lambda s: {**s, "head.3.weight": torch.zeros(V, H)},
        None,
        r"unexpected key 'head\.3\.weight' \(shape \[384, 64\]\)",
    ),
    "emb_dim": ("untied", None, {"emb_dim": 32}, r"emb_dim 32 in config\.json, but the target's hidden size is 64"),
    "vocabulary": (
        "untied",
        None,
        {"vocab_size": 500},
        r"vocab_size 500 in config\.json, but the target's vocabulary size is 384",
    ),
    "model_type": (
        "untied",
        None,
        {"model_type": "llama"},
        r"config\.json has model_type 'llama', not 'mlp_speculator'",
    ),
    "tied single stage": (
        "untied",
        lambda s: {k: v for k, v in s.items() if k.split(".")[1] == "0"},
        {"tie_weights": True, "n_predict": 1},
        r"tie_weights needs n_predict > 1",
    ),
}


test_checkpoints_that_do_not_fit_are_refused = refusal_test(
    REFUSALS, MLPSpeculatorCheckpointError, lambda path, target, _: load_mlp_speculator(path, target)
)


# ---------------------------------------------------------------------------- drafting


def test_batched_equals_one_at_a_time(checkpoints, target, hidden):
    proposer = MLPSpeculatorProposer(load_mlp_speculator(checkpoints["untied"][0], target, "float32"), 512)
    assert_batched_equals_one_at_a_time(proposer, hidden, (3, 1, 2))


def test_probabilistic_drafts_feed_the_sampled_token_and_come_with_probs(checkpoints, target, hidden):
    path, written = checkpoints["untied"]
    head = load_mlp_speculator(path, target, "float32")
    requests = [DraftRequest(i, ids, 3, rows) for i, (ids, rows) in enumerate(zip(CONTEXTS, hidden))]
    drafts = MLPSpeculatorProposer(head, 512, "probabilistic", seed=1).propose(requests)
    for req, draft in zip(requests, drafts):
        # Stage i's distribution given the tokens actually sampled before it.
        tokens = [req.token_ids[-1]] + draft.token_ids[:-1]
        expected = torch.stack(reference_logits("untied", written, req.hidden_states[-1, 0], tokens)).softmax(-1)
        torch.testing.assert_close(draft.probs, expected, rtol=1e-4, atol=1e-6)
        assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.token_ids))
    again = MLPSpeculatorProposer(head, 512, "probabilistic", seed=1).propose(requests)
    assert [d.token_ids for d in again] == [d.token_ids for d in drafts]


# ---------------------------------------------------------------------------- writing


@pytest.mark.parametrize("name", ["untied", "tied-once-inner48-unscaled"])
def test_the_writer_writes_the_published_layout(name, checkpoints, target, tmp_path, tiny_model_dir):
    head = load_mlp_speculator(checkpoints[name][0], target, "float32")
    save_mlp_speculator(head, tmp_path / "out")
    opts = {k: v for k, v in VARIANTS[name].items() if k != "prefix"}
    reference = write_mlp_speculator(tmp_path / "reference", tiny_model_dir, **{**opts, "repeat_tied": False})
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in reference.items()}
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    expected = json.loads((tmp_path / "reference" / "config.json").read_text())
    assert {k: config[k] for k in expected if k not in ("top_k_tokens_per_head", "torch_dtype")} == {
        k: v for k, v in expected.items() if k not in ("top_k_tokens_per_head", "torch_dtype")
    }
    again = load_mlp_speculator(tmp_path / "out", target, "float32")
    for (k, a), b in zip(head.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k
