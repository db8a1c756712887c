"""Sampled decoding through the real server: seeds reproduce, and with ngram drafting the
emitted tokens follow the target's own (temperature / top-k) distribution exactly."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from client.api.triton import grpc_generate
from tests.helpers import _load, coarse_total_variation

# Ends with an n-gram seen earlier in the prompt, so ngram drafts the very first tokens.
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
TEMPERATURE, TOP_K, SAMPLES = 1.5, 4, 600


def exact_marginals(model_dir: str, num_tokens: int = 2) -> list[dict[int, float]]:
    """The target's distribution of each of the first `num_tokens` sampled tokens (top-k,
    temperature), summed over every path of top-k tokens before it."""
    model, tokenizer = _load(model_dir)

    def dist(context):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([context])).logits[0, -1] / TEMPERATURE
        top = logits.topk(TOP_K)
        probs = top.values.softmax(-1)
        return dict(zip(top.indices.tolist(), probs.tolist()))

    marginals: list[dict[int, float]] = []
    paths = {tuple(tokenizer(PROMPT)["input_ids"]): 1.0}
    for _ in range(num_tokens):
        marginal: dict[int, float] = {}
        longer: dict[tuple, float] = {}
        for context, p in paths.items():
            for token, q in dist(list(context)).items():
                marginal[token] = marginal.get(token, 0.0) + p * q
                longer[context + (token,)] = p * q
        marginals.append(marginal)
        paths = longer
    return marginals


def sample(server, num_draft_tokens: int | None, seeds: range, with_stats: bool = False,
           max_tokens: int = 2) -> list:
    """`max_tokens` sampled tokens per seed: their ids (or the whole results, `with_stats`)."""
    extra = {} if num_draft_tokens is None else {"num_draft_tokens": num_draft_tokens}

    def one(seed):
        result = grpc_generate(server.grpc_url, PROMPT, max_tokens=max_tokens, temperature=TEMPERATURE,
                               top_k=TOP_K, random_seed=seed, ignore_eos=True, **extra)
        return result if with_stats else result.output_ids

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, seeds))


def test_seeded_requests_reproduce(tiny_server):
    runs = [grpc_generate(tiny_server.grpc_url, PROMPT, max_tokens=24, temperature=1.0, random_seed=seed,
                          ignore_eos=True).output_ids for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("mode", ["ngram", "plain"])
def test_sampled_tokens_follow_the_target_distribution(tiny_server, tiny_model_dir, mode):
    exact = exact_marginals(str(tiny_model_dir))
    # The test only means something if no single token dominates.
    assert max(exact[0].values()) < 0.8
    results = sample(tiny_server, None if mode == "ngram" else 0, range(SAMPLES))
    for position in range(2):
        tv = coarse_total_variation([r[position] for r in results], exact[position])
        assert tv < 0.09, (mode, position, tv)


def test_ngram_drafts_are_exercised_by_the_distribution_test(tiny_server):
    r = grpc_generate(tiny_server.grpc_url, PROMPT, max_tokens=2, temperature=TEMPERATURE, top_k=TOP_K,
                      random_seed=1, ignore_eos=True)
    assert r.total_draft_tokens >= 1  # the first step already verifies drafts
