"""draft_model through the real server: an LM drafts by sampling, so its probabilities travel
drafter -> orchestrator -> verifier, and decoding stays lossless. The drafter is the target
itself: its draft distribution overlaps the target's, so acceptance depends on q and a
wrong q (lost or misaligned on the way) shows up as a biased output distribution."""

from __future__ import annotations

import json

import pytest
import torch

from tests.fixtures.helpers import coarse_total_variation, load_hf_model, seeded_results, served_greedy_results
from tests.fixtures.servers import fixture_servers

SAMPLED_PROMPT = "The dog"  # the tiny model's next token: one likely, a few plausible

QUANTIZATIONS = ["int8", "int4"]
PROMPTS = ["def add(a, b):\n    return a + b\ndef add(a, b):", "The quick brown fox", "for i in range(10):"]


def draft_model(model, **options) -> str:
    return json.dumps({"method": "draft_model", "model": str(model), "num_speculative_tokens": 3, **options})


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tiny_hetero_dir, tmp_path_factory):
    """The module's servers, launched together: the target drafting for itself
    (probabilistic drafts, shared by two tests), with another tokenizer's drafter, with a
    drafter of another vocabulary (which fails to load), and quantized drafters."""
    target = str(tiny_model_dir)
    specs = {
        "draft-server": dict(
            model=target,
            speculative_config=draft_model(tiny_model_dir, draft_sample_method="probabilistic"),
            sequence_idle_timeout_s="5",
        ),
        "hetero": dict(model=target, speculative_config=draft_model(tiny_hetero_dir, use_heterogeneous_vocab=True)),
        "mismatched": dict(model=target, speculative_config=draft_model(tiny_hetero_dir), require_all_models=False),
        **{
            q: dict(model=target, speculative_config=draft_model(tiny_model_dir, quantization=q)) for q in QUANTIZATIONS
        },
    }
    yield from fixture_servers(tmp_path_factory, specs)


@pytest.fixture(scope="module")
def draft_server(servers):
    return servers["draft-server"]


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


def test_heterogeneous_vocab_drafter_through_the_server(servers, tiny_model_dir):
    """A drafter with another tokenizer drafts through text; output is still the target's."""
    results = served_greedy_results(servers["hetero"], tiny_model_dir, PROMPTS, 32)
    assert sum(r.total_draft_tokens for r in results) > 0


def test_mismatched_vocabulary_is_refused_at_load(servers, tiny_model_dir, tiny_hetero_dir):
    from backends.config import SpeculativeConfig

    with pytest.raises(ValueError, match="same vocabulary size"):
        SpeculativeConfig.from_json(draft_model(tiny_hetero_dir), target_model=str(tiny_model_dir))
    state, reason = servers["mismatched"].model_states()["drafter"]
    assert state == "UNAVAILABLE" and "same vocabulary size" in reason


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_quantized_drafter_through_the_server(servers, tiny_model_dir, quantization):
    """An int8 or int4 drafter (the lean runtime's kernel where the CPU has one) drafts what it
    will; the output is the target's greedy output."""
    results = served_greedy_results(servers[quantization], tiny_model_dir, PROMPTS, 32)
    assert sum(r.total_accepted_draft_tokens for r in results) > 0
