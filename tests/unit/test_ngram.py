import random

import pytest

from backends.methods.ngram import NgramProposer, PromptLookupProposer
from backends.serving.proposer import DraftRequest, build_proposer, proposer_class


def reference_lookup(tokens, min_n, max_n, k, max_model_len):
    """vLLM's semantics written the slow, obvious way."""
    n = len(tokens)
    if n < min_n:
        return []
    k = min(k, max_model_len - n)
    if k <= 0:
        return []
    for length in range(min(max_n, n - 1), min_n - 1, -1):
        suffix = tokens[n - length :]
        for start in range(0, n - length):
            if tokens[start : start + length] == suffix:
                return tokens[start + length : start + length + k]
    return []


def test_matches_reference_on_random_sequences():
    rng = random.Random(0)
    for _ in range(20000):
        vocab = rng.randint(1, 4)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 14))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 5)
        max_len = rng.randint(1, 20)
        got = NgramProposer(min_n, max_n, k, max_len).propose(tokens)
        assert got == reference_lookup(tokens, min_n, max_n, k, max_len), (tokens, min_n, max_n, k, max_len)


def test_longest_match_wins_over_more_tokens():
    # "2 3" occurs at 1 and "1 2 3" at 0: the 3-gram wins although it yields fewer tokens.
    tokens = [1, 2, 3, 9, 2, 3, 7, 7, 7, 1, 2, 3]
    assert NgramProposer(1, 3, 5, 100).propose(tokens) == [9, 2, 3, 7, 7]


def test_earliest_occurrence_wins():
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    assert NgramProposer(2, 2, 1, 100).propose(tokens) == [1]


def test_no_match_and_suffix_never_matches_itself():
    assert NgramProposer(2, 3, 4, 100).propose([1, 2, 3, 4]) == []
    assert NgramProposer(1, 1, 4, 100).propose([7]) == []


def test_max_model_len_clamps_the_proposal():
    tokens = [1, 2, 3, 4, 5, 1, 2]
    assert NgramProposer(2, 2, 4, 100).propose(tokens) == [3, 4, 5, 1]
    assert NgramProposer(2, 2, 4, 9).propose(tokens) == [3, 4]
    assert NgramProposer(2, 2, 4, 7).propose(tokens) == []


def test_per_call_k_and_invalid_bounds():
    assert NgramProposer(1, 2, 4, 100).propose([1, 2, 3, 1, 2], k=1) == [3]
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2, 4, 100)


def test_registry_builds_the_ngram_drafter():
    from backends.config import SpeculativeConfig

    config = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3}')
    drafter = build_proposer(config, max_model_len=100)
    assert isinstance(drafter, PromptLookupProposer)
    drafts = drafter.propose([DraftRequest(1, [4, 5, 6, 7, 8, 4, 5, 6, 7, 8], 3), DraftRequest(2, [1, 2, 3], 3)])
    assert [d.token_ids for d in drafts] == [[4, 5, 6], []]  # default lookup n is 5..5
    drafts = drafter.propose([DraftRequest(1, [4, 5, 6, 7, 8, 9, 4, 5, 6, 7, 8], 3)])
    assert drafts[0].token_ids == [9, 4, 5]
    with pytest.raises(ValueError, match="no drafter backend"):
        proposer_class("no_such_method")


def test_drafter_follows_a_list_growing_in_place():
    # DraftService hands over the same list every step; the drafter converts only the new tail.
    rng = random.Random(1)
    proposer = NgramProposer(1, 3, 4, 10**6)
    drafter = PromptLookupProposer(proposer)
    tokens = []
    for _ in range(300):
        tokens.extend(rng.randrange(6) for _ in range(rng.randint(1, 5)))
        assert drafter.propose([DraftRequest(9, tokens, 4)])[0].token_ids == proposer.propose(list(tokens))
    rewritten = tokens[:-1] + [tokens[-1] + 1]  # a different list object starts over
    assert drafter.propose([DraftRequest(9, rewritten, 4)])[0].token_ids == proposer.propose(rewritten)
    drafter.release(9)
    assert len(drafter.history) == 0
