"""The trainers for medusa, mlp_speculator, mtp, dflash and dspark on a tiny target: training
computes what the proposers compute, the heads learn, their files load through the methods'
own loaders with the trained weights (served: tests/e2e/test_training_heads_server.py)."""

from __future__ import annotations

import json

import pytest
import torch

from backends.config import SpeculativeConfig
from backends.serving.proposer import DraftRequest, build_proposer, proposer_class
from backends.training.blocks import MaskEmbedding
from backends.training.eagle import unroll
from backends.training.steps import Anchors, greedy_chain
from backends.training.trainer import head_trainer, make_batch
from tests.fixtures.training import HEAD_METHODS as METHODS
from tests.fixtures.training import HEAD_STEPS as STEPS


@pytest.fixture(scope="module")
def target_dir(training_target_dir):
    return training_target_dir


def _held_out_batches(corpus, layer_ids) -> list:
    """Each held-out sequence as a batch of its own."""
    _, _, data, _ = corpus
    _, val = data.split()
    return [make_batch(data, [(s.start, s.stop)], layer_ids) for s in map(data.sequence, val)]


def _training_probs(method, trainer, head, batch, anchors: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[anchors, STEPS, V]: the draft distributions training computes at the anchors (the last
    target position of each draft pass), teacher-forced with the sequence's own tokens."""
    if method == "mtp":
        steps = [head.logits(out[0, anchors]) for out, _, _ in unroll(head, batch, STEPS)]
    else:
        depth = greedy_chain(batch)[0, anchors]
        steps = list(trainer.predictions(head, batch, Anchors(torch.zeros_like(anchors), anchors, depth), STEPS))
        steps = [logits for logits, _ in steps]
    probs = torch.stack(steps, dim=1).float().softmax(-1)
    if head.draft_to_target is not None:  # the proposer's are over the target's vocabulary
        probs = probs.new_zeros(*probs.shape[:2], vocab_size).index_copy_(-1, head.draft_to_target, probs)
    return probs


@pytest.mark.parametrize("method", METHODS)
def test_training_computes_what_the_proposer_drafts(method, trained_heads, heads_corpus):
    """At anchors on the greedy chain, each draft step's distribution in training equals the
    proposer's for that step (probabilistic drafts carry it), as long as the proposer's
    earlier drafts were the sequence's own tokens (what training feeds those steps)."""
    _, head, _, _ = trained_heads[method]
    trainer = head_trainer(method)
    proposer = proposer_class(method)(head, max_model_len=512, sample_method="probabilistic", seed=0)
    compared = [0] * STEPS
    for batch in _held_out_batches(heads_corpus, trainer.layer_ids(heads_corpus[3])):
        anchors = (greedy_chain(batch)[0] >= STEPS).nonzero().flatten()
        with torch.no_grad():
            expected = _training_probs(method, trainer, head, batch, anchors, heads_corpus[3].vocab_size)
        ids = batch.token_ids[0].tolist()
        for i, t in enumerate(anchors.tolist()):
            draft = proposer.propose([DraftRequest(0, ids[: t + 2], STEPS, batch.hidden[0, : t + 1])])[0]
            proposer.release(0)
            assert len(draft.token_ids) == STEPS
            for d in range(STEPS):
                torch.testing.assert_close(draft.probs[d], expected[i, d], atol=1e-4, rtol=1e-3)
                compared[d] += 1
                if d + 1 < STEPS and draft.token_ids[d] != ids[t + 2 + d]:
                    break  # later steps read a token training did not feed
    assert compared[0] > 50 and compared[-1] > 5, compared


@pytest.mark.parametrize("method", METHODS)
def test_heads_learn_and_load_with_the_methods_loader(method, trained_heads, heads_corpus, target_dir):
    path, head, before, after = trained_heads[method]
    assert after["step_accuracy"][0] > before["step_accuracy"][0] + 0.1, (before, after)
    assert after["estimated_acceptance_length"] > before["estimated_acceptance_length"] + 0.1

    config = SpeculativeConfig.from_json(
        {"method": method, "model": str(path), "num_speculative_tokens": STEPS}, target_model=str(target_dir)
    )
    proposer = build_proposer(config, max_model_len=512, target_model=target_dir, dtype="float32")
    assert type(proposer) is proposer_class(method)
    # Every weight the loader ends up with is the trained one (stored in bfloat16).
    expected = dict(head.state_dict())
    if isinstance(getattr(head, "embed_tokens", None), MaskEmbedding):
        expected["embed_tokens.weight"] = head.embed_tokens.as_embedding().weight
    loaded = proposer.head.state_dict()
    assert set(loaded) <= set(expected)
    for key, value in loaded.items():
        torch.testing.assert_close(value, expected[key].to(value.dtype), atol=2e-2, rtol=1e-2, msg=key)

    batch = _held_out_batches(heads_corpus, proposer.hidden_layer_ids)[0]
    n = int(batch.valid.sum())
    ids = batch.token_ids[0, :n].tolist()
    drafts = proposer.propose([DraftRequest(1, ids, STEPS, batch.hidden[0, : n - 1])])[0].token_ids
    assert len(drafts) == STEPS and all(0 <= d < heads_corpus[3].vocab_size for d in drafts)


def test_the_published_layouts(trained_heads, heads_corpus):
    """What each writer put down is the method's published layout (keys and config fields)."""
    from safetensors import safe_open

    def keys(method):
        path = trained_heads[method][0]
        with safe_open(next(path.glob("*.safetensors")), "pt") as st:
            return set(st.keys()), json.loads((path / "config.json").read_text())

    num_layers = heads_corpus[3].num_layers
    medusa, cfg = keys("medusa")
    assert cfg["model_type"] == "medusa" and cfg["num_heads"] == STEPS and cfg["truncated_vocab_size"] == 256
    assert {f"lm_heads.{i}.weight" for i in range(STEPS)} | {"blocks.0.layers.0.weight", "token_map"} <= medusa
    mlp, cfg = keys("mlp_speculator")
    assert cfg["n_predict"] == STEPS and cfg["tie_weights"] and cfg["scale_input"]
    assert mlp == {"emb.0.weight", "head.0.weight", "ln.0.weight", "ln.0.bias", "proj.0.weight", "proj.1.weight"}
    mtp, cfg = keys("mtp")
    assert cfg["model_type"] == "deepseek_mtp" and cfg["num_nextn_predict_layers"] == 1
    assert f"model.layers.{num_layers}.eh_proj.weight" in mtp
    assert not any(k.endswith(("embed_tokens.weight", "shared_head.head.weight")) for k in mtp)  # the target's
    dflash, cfg = keys("dflash")
    assert cfg["block_size"] == STEPS + 1 and cfg["dflash_config"]["target_layer_ids"] == [-1, 0, 1]
    assert cfg["draft_vocab_size"] == 256 and {"fc.weight", "lm_head.weight", "d2t"} <= dflash
    assert "embed_tokens.weight" not in dflash
    assert (trained_heads["dflash"][0] / "mask_embedding.pt").exists()
    # Beside the heads that draft over the target's whole vocabulary, a token map (their
    # speculative_token_map); the others have a draft vocabulary of their own.
    mapped = {m for m, (path, *_) in trained_heads.items() if (path / "token_map.json").exists()}
    assert mapped == {"mlp_speculator", "mtp"}
    dspark, cfg = keys("dspark")
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["block_size"] == STEPS
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "embed_tokens.weight", "d2t"} <= dspark
