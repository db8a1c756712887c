"""DFlash and DSpark block drafters through the real server: greedy output is the target's own
(also under a grammar), and a DSpark head fitted to the target drafts probabilistically with the target's distribution
coming back out."""

from __future__ import annotations

import json

import pytest
import torch

from tests.fixtures.helpers import coarse_total_variation, load_hf_model, seeded_results, served_greedy_results
from tests.fixtures.sampling import PROMPT, SAMPLES, TEMPERATURE, TOP_K, exact_marginals
from tests.fixtures.servers import CHUNKED_PREFILL, fixture_servers
from tests.fixtures.structured import check_served_constrained
from tests.fixtures.synthetic_blocks import write_dflash, write_dspark
from tests.fixtures.synthetic_checkpoints import save_checkpoint

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The", "for i in range(10):\n    print(i"]
V, H = 384, 64


def write_fitted_dspark(out, tiny_model_dir):
    """A DSpark checkpoint whose drafts follow the target on the sampling test's prompt: the
    LM head is zero and the vanilla Markov head is a bigram table holding, for each of the
    first token's top-k candidates t, the target's top-k logits after prompt + t. Drafts are
    sampled at temperature 1, the requests at 1.5: q overlaps p but is sharper, so only a
    correct q in min(1, p/q) and max(p - q, 0) gives p back."""
    state = dict(write_dspark(out, tiny_model_dir, markov_rank=TOP_K, confidence=False))
    model, tokenizer = load_hf_model(str(tiny_model_dir))
    ids = tokenizer(PROMPT)["input_ids"]
    w1, w2 = torch.zeros(V, TOP_K), torch.zeros(V, TOP_K)
    with torch.inference_mode():
        firsts = model(input_ids=torch.tensor([ids])).logits[0, -1].topk(TOP_K).indices
        for i, t in enumerate(firsts.tolist()):
            w1[t, i] = 1.0
            logits = model(input_ids=torch.tensor([ids + [t]])).logits[0, -1]
            w2[:, i] = torch.full_like(logits, -30.0).scatter(0, logits.topk(TOP_K).indices, logits.topk(TOP_K).values)
    state.update(
        {"lm_head.weight": torch.zeros(V, H), "markov_head.markov_w1.weight": w1, "markov_head.markov_w2.weight": w2}
    )
    save_checkpoint(out, json.loads((out / "config.json").read_text()), state, "safetensors")
    return out


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    """A causal sliding-window DFlash head, and the fitted DSpark head drafting
    probabilistically with prompts prefilled in chunks: launched together."""
    root = tmp_path_factory.mktemp("block-heads")
    dflash = root / "dflash-causal-sliding"
    write_dflash(dflash, tiny_model_dir, causal=True, sliding_window=3, block_size=5)
    dspark = {
        "method": "dspark",
        "model": str(write_fitted_dspark(root / "fitted", tiny_model_dir)),
        "num_speculative_tokens": 3,
        "draft_sample_method": "probabilistic",
    }
    specs = {
        "dflash": dict(
            model=str(tiny_model_dir),
            speculative_config=json.dumps({"method": "dflash", "model": str(dflash), "num_speculative_tokens": 4}),
        ),
        "dspark": dict(model=str(tiny_model_dir), speculative_config=json.dumps(dspark), per_model=CHUNKED_PREFILL),
    }
    yield from fixture_servers(tmp_path_factory, specs)


@pytest.fixture(scope="module")
def dspark_server(servers):
    return servers["dspark"]


def test_served_dflash_greedy_equals_target_greedy(servers, tiny_model_dir):
    results = served_greedy_results(servers["dflash"], tiny_model_dir, PROMPTS, 24)
    assert sum(r.total_draft_tokens for r in results) > 0


def test_served_dspark_greedy_equals_target_greedy(dspark_server, tiny_model_dir):
    """Greedy requests verify greedily whatever the drafter sampled: still the target's output."""
    results = served_greedy_results(dspark_server, tiny_model_dir, PROMPTS, 24)
    assert sum(r.total_draft_tokens for r in results) > 0


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_served_constrained_greedy_equals_target_constrained_greedy(name, servers, tiny_model_dir):
    check_served_constrained(servers[name], tiny_model_dir)


def test_served_dspark_sampling_follows_the_target_distribution(dspark_server, tiny_model_dir):
    """Hidden-state drafters draft from the second step on: with max_tokens 3 the second
    token is verified against one probabilistic DSpark draft (its Markov-corrected q sent to
    the verifier). Both sampled tokens must follow the target's own distribution."""
    exact = exact_marginals(str(tiny_model_dir))
    assert max(exact[1].values()) < 0.8  # no single token dominates
    results = seeded_results(
        dspark_server, PROMPT, SAMPLES, workers=8, max_tokens=3, temperature=TEMPERATURE, top_k=TOP_K
    )
    assert sum(r.total_accepted_draft_tokens for r in results) > SAMPLES // 2  # q overlaps p
    for position in range(2):
        tv = coarse_total_variation([r.output_ids[position] for r in results], exact[position])
        assert tv < 0.09, (position, tv)
