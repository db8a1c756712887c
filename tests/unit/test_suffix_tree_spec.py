"""Suffix decoding's tree mode (suffix_decoding_use_tree_spec): the drafted tree holds the most
probable continuations of every match in both trees, within the node, depth and probability
bounds, in topological order; through the draft -> verify loop the output is the target's own
greedy output."""

import random

import pytest

from backends.config import SpeculativeConfig
from backends.methods.suffix import SuffixDecodingCache
from backends.serving.drafting import DraftCall, DraftService
from backends.serving.local import generate_local
from backends.serving.proposer import DraftRequest, build_proposer
from backends.serving.tree import ROOT, DraftTree
from tests.unit.test_suffix import RefTree


def continuation_probs(ref, tail, min_prob, max_levels):
    """{continuation: path probability} of every node a tree draft may hold after `tail`."""
    out, stack = {}, [((), 1.0)]
    while stack:
        path, prob = stack.pop()
        cur = tuple(tail) + path
        if len(path) >= max_levels or len(cur) >= ref.depth:
            continue
        count = sum(1 for _, t in ref.occurrences(cur) if t is not None)  # the occurrences that go on
        for t in {t for _, t in ref.occurrences(cur) if t is not None}:
            p = prob * (len(ref.occurrences(cur + (t,))) / count)
            if p >= min_prob:
                out[path + (t,)] = p
                stack.append((path + (t,), p))
    return out


def ref_tree_speculate(refs, context, max_nodes, factor, min_prob, max_levels):
    """(probs, score, {continuation: prob}): every continuation of every match of the
    context's tail in either tree (a match of m tokens at most m * factor levels deep), at its
    highest probability times 1 - 2^-m; the draft's probabilities are the largest of them, in
    non-increasing order."""
    scored = {}
    for ref in refs:
        for m in range(1, len(context)):
            tail = tuple(context[-m:])
            if not ref.occurrences(tail):
                break
            levels = min(max_levels, int(m * factor + 1e-6))
            for path, prob in continuation_probs(ref, tail, min_prob, levels).items():
                scored[path] = max(scored.get(path, 0.0), prob * (1 - 0.5**m))  # a short match counts less
    probs = sorted(scored.values(), reverse=True)[:max_nodes]
    score = 0.0
    for p in probs:
        score += p
    return probs, score, scored


def paths(draft):
    """Each node's continuation: the tokens from the root's child down to it."""
    out = []
    for token, parent in zip(draft.token_ids, draft.parents):
        out.append((out[parent] if parent != ROOT else ()) + (token,))
    return out


def check_tree(draft, nodes, max_nodes, max_levels):
    """The draft is a tree of real continuations with their own probabilities."""
    tree = DraftTree(tuple(draft.token_ids), tuple(draft.parents))  # parents first
    assert len(tree) <= max_nodes and tree.depth <= max_levels
    found = paths(draft)
    assert len(set(found)) == len(found)  # siblings differ
    assert [nodes[path] for path in found] == draft.probs


def test_tree_speculation_matches_brute_force():
    rng = random.Random(6)
    compared = branched = 0
    for _ in range(150):
        depth = rng.randint(2, 7)
        vocab = rng.randint(1, 4)
        cache = SuffixDecodingCache(depth, max_cached_requests=rng.choice([0, 2, 100]))
        refs = {"global": RefTree(depth)}
        for req in range(rng.randint(1, 4)):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 10))]
            cache.start_request(req, prompt)
            refs["local"] = RefTree(depth)
            refs["local"].extend(req, prompt)
            for evicted in set(refs["global"].seqs) - set(cache.cached_requests):
                refs["global"].remove(evicted)
            context = list(prompt)
            for _ in range(rng.randint(1, 5)):
                out = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
                cache.add_active_response(req, out)
                refs["local"].extend(req, out)
                if req in cache.cached_requests:
                    refs["global"].extend(req, out)
                context += out
                ctx = context[-depth:]
                max_nodes, levels = rng.randint(0, 8), rng.randint(1, 6)
                factor = rng.choice([0.5, 1.0, 2.0, 8.0])
                min_prob = rng.choice([0.0, 0.1, 0.3, 0.5])
                got = cache.speculate(req, context, max_nodes, factor, min_prob, tree_depth=levels)
                expected = ref_tree_speculate((refs["local"], refs["global"]), ctx, max_nodes, factor, min_prob, levels)
                assert (got.probs, got.score) == expected[:2], (context, depth, max_nodes, levels)
                if got.token_ids:
                    check_tree(got, expected[2], max_nodes, levels)
                    branched += not DraftTree(tuple(got.token_ids), tuple(got.parents)).is_chain
                # A tree scores at least what a path of as many nodes does, its match's trust
                # (1 - 2^-m) applied.
                path = cache.speculate(req, context, min(max_nodes, levels), factor, min_prob)
                assert got.score >= path.score * (1 - 0.5**path.match_len) - 1e-12
                compared += 1
            cache.stop_request(req)
    assert compared > 300 and branched > 30


# "1 2" continues 3 4 7 0 (twice), 3 4 8 0 (twice) and 5 6 0 (once); the sequence ends in
# "1 2" again, with no next token yet (the 5 that go on count): p(3) = p(4) = 4/5, p(7) =
# p(8) = p(0 after either) = 2/5, p(5) = p(6) = p(0 after 6) = 1/5. The context "0 1 2" tries
# the matches "2" and "1 2" only.
BRANCHY = [1, 2, 3, 4, 7, 0] * 2 + [1, 2, 3, 4, 8, 0] * 2 + [1, 2, 5, 6, 0, 1, 2]


def tree_of(max_nodes, levels, min_token_prob=0.1):
    cache = SuffixDecodingCache(24, max_cached_requests=0)
    cache.start_request("r", BRANCHY)
    draft = cache.speculate("r", BRANCHY[-3:], max_nodes, 10.0, min_token_prob, tree_depth=levels)
    return draft.token_ids, draft.parents


def test_the_tree_is_the_most_probable_nodes():
    # 8 was promoted last, so it goes first among the equally probable 7 and 8 (path mode's order)
    assert tree_of(4, 8) == ([3, 4, 8, 7], [ROOT, 0, 1, 1])
    assert tree_of(6, 8) == ([3, 4, 8, 7, 0, 0], [ROOT, 0, 1, 1, 2, 3])
    assert tree_of(2, 8) == ([3, 4], [ROOT, 0])


def test_depth_and_min_token_prob_bound_the_tree():
    # 3 levels: the 1/5 branch takes the nodes the fourth level may not
    assert tree_of(8, 3) == ([3, 4, 8, 7, 5, 6, 0], [ROOT, 0, 1, 1, ROOT, 4, 5])
    assert tree_of(8, 1) == ([3, 5], [ROOT, ROOT])
    assert tree_of(8, 3, min_token_prob=0.25) == ([3, 4, 8, 7], [ROOT, 0, 1, 1])
    assert tree_of(8, 3, min_token_prob=0.5) == ([3, 4], [ROOT, 0])  # 4/5 passes, 2/5 does not


# "0 5 6 7" went on with 8 9 once and with 1 2 once; the sequence ends in "0 5 6 7" again.
REPEATED = [0, 5, 6, 7, 8, 9, 3, 0, 5, 6, 7, 1, 2, 4, 0, 5, 6, 7]


def test_drafter_proposes_both_continuations_of_a_repeated_context():
    config = SpeculativeConfig.from_json(
        {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_use_tree_spec": True}
    )
    drafter = build_proposer(config, max_model_len=1000)
    tree = drafter.propose([DraftRequest(1, REPEATED, 3, num_nodes=4)])[0]
    assert (tree.token_ids, tree.parents) == ([8, 1, 9, 2], [ROOT, ROOT, 0, 1])
    # "0 5 6 7" went on with 8 once, with 1 once; a match of 4 tokens is trusted 1 - 2^-4
    assert tree.scores == pytest.approx([0.5 * (1 - 2**-4)] * 4)
    one_level = drafter.propose([DraftRequest(1, REPEATED, 1, num_nodes=4)])[0]
    assert (one_level.token_ids, one_level.parents) == ([8, 1], [ROOT, ROOT])
    chain = drafter.propose([DraftRequest(1, REPEATED, 3)])[0]  # num_nodes 0: path mode, as before
    assert (chain.token_ids, chain.parents, chain.scores) == ([8, 9, 3], None, None)


def test_the_caches_hold_the_real_sequence_whichever_branch_was_accepted():
    config = SpeculativeConfig.from_json(
        {
            "method": "suffix",
            "num_speculative_tokens": 4,
            "suffix_decoding_use_tree_spec": True,
            "suffix_decoding_max_tree_depth": 8,
        }
    )
    service = DraftService(build_proposer(config, max_model_len=1000), config)
    tree = service.draft([DraftCall(1, list(REPEATED), 3, num_nodes=4)])[0]
    assert (tree.token_ids, tree.parents) == ([8, 1, 9, 2], [ROOT, ROOT, 0, 1])
    # "0 5 6 7" went on with 8 once, with 1 once; a match of 4 tokens is trusted 1 - 2^-4
    assert tree.scores == pytest.approx([0.5 * (1 - 2**-4)] * 4)
    # The target took the second branch (1 2) and then emitted 3, as the orchestrator says.
    service.draft([DraftCall(1, [1, 2, 3], 3, num_accepted=2, num_nodes=4)])
    local = RefTree(8)
    local.extend(1, REPEATED + [1, 2, 3])
    shared = RefTree(8)
    shared.extend(1, [1, 2, 3])  # the response only
    cache = service.proposer.cache
    assert cache.local_tree(1).counts() == local.counts()
    assert cache.global_tree.counts() == shared.counts()
    service.release(1)
    assert cache.active_requests == set()


# --- through the draft -> verify loop on the tiny target --------------------------------------

TREE_CONFIG = {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_use_tree_spec": True}
PROMPTS = [
    "def add(a, b):\n    return a + b\ndef add(a, b):",
    "for i in range(10):\n    print(i, i * i)\nfor i in",
    "a b c a b c a b c a b c",
    "The quick brown fox",
]


class TreeLog:
    """Wraps a runner's verify: records each step's draft tree and the tokens it emitted."""

    def __init__(self, runner, monkeypatch) -> None:
        self.steps = []
        verify = runner.verify

        def logged(req):
            result = verify(req)
            if req.draft_parents is not None:
                tree = DraftTree(tuple(req.draft_token_ids), tuple(req.draft_parents))
                self.steps.append((tree, result.token_ids))
            return result

        monkeypatch.setattr(runner, "verify", logged)

    @property
    def branching(self) -> int:
        return sum(not tree.is_chain for tree, _ in self.steps)

    @property
    def off_first_branch(self) -> int:
        """Steps whose accepted path left the chain of first children (what a chain verifies)."""
        count = 0
        for tree, emitted in self.steps:
            first = [tree.token_ids[i] for i in tree.first_path()]
            accepted = emitted[:-1]
            count += accepted != first[: len(accepted)]
        return count


def service_for(config, runner):
    config = SpeculativeConfig.from_json(config)
    return DraftService(build_proposer(config, max_model_len=runner.max_model_len), config)


def test_tree_mode_output_is_greedy_output(runner, tokenizer, monkeypatch):
    log = TreeLog(runner, monkeypatch)
    service = service_for(TREE_CONFIG, runner)
    for prompt in PROMPTS:
        plain, _ = generate_local(prompt, tokenizer, runner, None, max_tokens=48)
        ids, _ = generate_local(prompt, tokenizer, runner, service, max_tokens=48)
        assert ids == plain, prompt
    assert log.steps and service.num_sequences == 0 and not runner.sequences


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_trees_hold_the_branch_path_mode_misses(runner, tokenizer, monkeypatch, prompt):
    """A request seen before (its response is in the global tree), and past responses that
    continued 23-token stretches of it another way, twice each: there the longest match
    branches and path mode follows the majority, wrongly; the tree also holds the target's
    branch, and the verifier takes it. Stretches 24 apart, so no longer match settles it."""
    n = 100
    target, _ = generate_local(prompt, tokenizer, runner, None, max_tokens=n, eos_token_ids=set())
    decoys = [target[max(0, j - 23) : j] + [(target[j] + 1) % 256] for j in range(12, n, 24)]
    log, lengths = TreeLog(runner, monkeypatch), {}
    for tree in (False, True):
        service = service_for({**TREE_CONFIG, "suffix_decoding_use_tree_spec": tree}, runner)
        cache = service.proposer.cache
        for i, response in enumerate(decoys * 2 + [target]):
            cache.start_request(f"past-{i}", [])
            cache.add_active_response(f"past-{i}", response)
            cache.stop_request(f"past-{i}")
        ids, stats = generate_local(prompt, tokenizer, runner, service, max_tokens=n, eos_token_ids=set())
        assert ids == target
        lengths[tree] = stats.acceptance.mean_acceptance_length
    assert log.branching > 0 and log.off_first_branch > 0
    print("mean acceptance length, path:", lengths[False], "tree:", lengths[True])
    assert lengths[True] >= lengths[False]
