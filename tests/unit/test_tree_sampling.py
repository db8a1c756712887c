"""Sampled decoding with draft trees keeps the target's distribution: the first tokens of many
seeded requests, speculated with branching trees, against the target's exact marginals."""

from __future__ import annotations

import pytest

from backends.config import SpeculativeConfig
from backends.serving.drafting import DraftService
from backends.serving.local import generate_local
from backends.serving.proposer import build_proposer
from backends.serving.request import SamplingParams
from tests.fixtures.helpers import coarse_total_variation
from tests.fixtures.sampling import SAMPLES, TEMPERATURE, TOP_K, exact_marginals

# The prompt's last words continue two ways earlier on: suffix decoding's tree branches there.
BRANCHING = "Yes. The quick brown fox jumps. The quick brown dog sleeps. The quick brown"
CONFIGS = {
    "suffix": {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_use_tree_spec": True},
    # Probabilistic chain drafts (with q) beside fixed siblings (one-hot): both kinds at one node.
    "draft_model": {
        "method": "draft_model",
        "num_speculative_tokens": 3,
        "draft_sample_method": "probabilistic",
        "speculative_token_tree": "[(0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0)]",
    },
}


@pytest.mark.parametrize("method", CONFIGS)
def test_sampled_tree_speculation_follows_the_target_distribution(
    runner, tokenizer, tiny_model_dir, tiny_draft_dir, method
):
    spec = dict(CONFIGS[method], **({"model": str(tiny_draft_dir)} if method == "draft_model" else {}))
    config = SpeculativeConfig.from_json(spec, target_model=str(tiny_model_dir))
    proposer = build_proposer(config, max_model_len=512, dtype="float32", target_model=tiny_model_dir)
    branching, propose = [], proposer.propose

    def spy(batch):
        drafts = propose(batch)
        branching.extend(d.parents is not None and len(set(d.parents)) < len(d.parents) for d in drafts)
        return drafts

    proposer.propose = spy
    service = DraftService(proposer, config)
    exact = exact_marginals(str(tiny_model_dir), 2, BRANCHING)
    assert max(exact[0].values()) < 0.8  # no single token dominates
    outputs = []
    for seed in range(SAMPLES):
        sampling = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, seed=seed)
        ids, _ = generate_local(BRANCHING, tokenizer, runner, service, set(), max_tokens=2, sampling=sampling)
        outputs.append(ids)
    assert sum(branching) > SAMPLES // 2  # most steps verified a tree with a branch
    for position in range(2):
        tv = coarse_total_variation([ids[position] for ids in outputs], exact[position])
        assert tv < 0.09, (method, position, tv)
