"""draft_model through the real server: an LM drafts by sampling, so its probabilities travel
drafter -> orchestrator -> verifier, and decoding stays lossless. The drafter is the target
itself: its draft distribution overlaps the target's, so acceptance depends on q and a
wrong q (lost or misaligned on the way) shows up as a biased output distribution."""

from __future__ import annotations

import json

import pytest
import torch

from tests.fixtures.helpers import (
    coarse_total_variation,
    load_hf_model,
    seeded_results,
    served_greedy_results,
    served_greedy_results_once,
)
from tests.fixtures.servers import fixture_server, start_server

SAMPLED_PROMPT = "The dog"  # the tiny model's next token: one likely, a few plausible

PROMPTS = ["def add(a, b):\n    return a + b\ndef add(a, b):", "The quick brown fox", "for i in range(10):"]


@pytest.fixture(scope="module")
def draft_server(tiny_model_dir, tmp_path_factory):
    config = {
        "method": "draft_model",
        "model": str(tiny_model_dir),
        "num_speculative_tokens": 3,
        "draft_sample_method": "probabilistic",
    }
    yield from fixture_server(
        tmp_path_factory, "draft-server", tiny_model_dir, json.dumps(config), sequence_idle_timeout_s="5"
    )


def test_greedy_equals_target_greedy(draft_server, tiny_model_dir):
    results = served_greedy_results(draft_server, tiny_model_dir, PROMPTS, 40)
    assert sum(r.total_accepted_draft_tokens for r in results) > 0


def test_sampled_tokens_follow_the_target_distribution(draft_server, tiny_model_dir):
    model, tokenizer = load_hf_model(str(tiny_model_dir))
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([tokenizer(SAMPLED_PROMPT)["input_ids"]])).logits[0, -1]
    exact = dict(enumerate((logits / 1.2).softmax(-1).tolist()))
    top3 = sum(sorted(exact.values(), reverse=True)[:3])
    # The drafter samples at temperature 1, the request at 1.2: q is sharper than p, so only a
    # correct q in min(1, p/q) and max(p - q, 0) brings the output back to p.
    assert 0.4 < top3 < 0.9

    results = seeded_results(draft_server, SAMPLED_PROMPT, 600, max_tokens=4, temperature=1.2)
    assert sum(r.total_accepted_draft_tokens for r in results) > 100  # q overlaps p: many drafts pass
    assert coarse_total_variation([r.output_ids[0] for r in results], exact) < 0.09


def test_heterogeneous_vocab_drafter_through_the_server(tiny_model_dir, tiny_hetero_dir, tmp_path):
    """A drafter with another tokenizer drafts through text; output is still the target's."""
    config = {
        "method": "draft_model",
        "model": str(tiny_hetero_dir),
        "num_speculative_tokens": 3,
        "use_heterogeneous_vocab": True,
    }
    results = served_greedy_results_once(tmp_path, tiny_model_dir, config, PROMPTS, 32)
    assert sum(r.total_draft_tokens for r in results) > 0


def test_mismatched_vocabulary_is_refused_at_load(tiny_model_dir, tiny_hetero_dir, tmp_path):
    from backends.config import SpeculativeConfig

    config = json.dumps({"method": "draft_model", "model": str(tiny_hetero_dir), "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="same vocabulary size"):
        SpeculativeConfig.from_json(config, target_model=str(tiny_model_dir))
    server = start_server(tmp_path, str(tiny_model_dir), config, require_all_models=False)
    try:
        state, reason = server.model_states()["drafter"]
        assert state == "UNAVAILABLE" and "same vocabulary size" in reason
    finally:
        server.stop()


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_drafter_through_the_server(tiny_model_dir, tmp_path, quantization):
    """An int8 or int4 drafter (the lean runtime's kernel where the CPU has one) drafts what it
    will; the output is the target's greedy output."""
    config = {
        "method": "draft_model",
        "model": str(tiny_model_dir),
        "num_speculative_tokens": 3,
        "quantization": quantization,
    }
    results = served_greedy_results_once(tmp_path, tiny_model_dir, config, PROMPTS, 32)
    assert sum(r.total_accepted_draft_tokens for r in results) > 0
