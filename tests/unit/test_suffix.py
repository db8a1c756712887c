"""Suffix decoding against a brute-force model of the same semantics (arctic-inference 0.1.1's
suffix trees, as backends/methods/suffix.py cites them)."""

import random
from collections import Counter

import pytest

from backends.config import SpeculativeConfig
from backends.methods.suffix import SuffixDecodingCache, SuffixProposer, SuffixTree
from backends.serving.proposer import DraftRequest, build_proposer


class RefTree:
    """The stored sequences, each token stamped with its append time; a node's count is the
    number of occurrences of its string, and the child followed is the most frequent one, ties
    to the most recent occurrence (count >= 2) or the earliest (count 1, never promoted).
    After a removal, the tree's tie order also remembers removed occurrences, which this model
    does not: `speculate` then returns None at a tie."""

    def __init__(self, depth):
        self.depth = depth
        self.seqs = {}
        self.clock = 0
        self.removed = False

    def extend(self, sid, ids):
        for t in ids:
            self.clock += 1
            self.seqs.setdefault(sid, []).append((t, self.clock))

    def remove(self, sid):
        self.removed |= self.seqs.pop(sid, None) is not None

    def occurrences(self, s):
        """[(end time, next token or None)] of every occurrence of s."""
        out = []
        for seq in self.seqs.values():
            toks = [t for t, _ in seq]
            for i in range(len(toks) - len(s) + 1):
                if tuple(toks[i : i + len(s)]) == s:
                    end = i + len(s) - 1
                    out.append((seq[end][1], toks[end + 1] if end + 1 < len(toks) else None))
        return out if len(s) <= self.depth else []

    def counts(self):
        c = Counter()
        for seq in self.seqs.values():
            toks = tuple(t for t, _ in seq)
            for i in range(len(toks)):
                for j in range(i + 1, min(i + self.depth, len(toks)) + 1):
                    c[toks[i:j]] += 1
        return dict(c)

    def speculate(self, context, max_spec, factor, min_prob):
        best = ([], [], 0.0, 0)
        for m in range(1, len(context)):
            cur = tuple(context[-m:])
            occ = self.occurrences(cur)
            if not occ:
                break
            max_tokens = max(0, min(max_spec, int(m * factor + 1e-6)))
            ids, probs, score, prob = [], [], 0.0, 1.0
            while len(ids) < max_tokens and len(cur) < self.depth:
                nxt = {t for _, t in self.occurrences(cur) if t is not None}
                if not nxt:
                    break
                keyed = []
                for t in nxt:
                    times = [time for time, _ in self.occurrences(cur + (t,))]
                    rank = max(times) if len(times) >= 2 else -min(times)
                    keyed.append((len(times), rank, t))
                count, _, t = max(keyed)
                if self.removed and sum(k[0] == count for k in keyed) > 1:
                    return None
                prob *= count / len(self.occurrences(cur))
                if prob < min_prob:
                    break
                ids.append(t)
                probs.append(prob)
                score += prob
                cur += (t,)
            if score >= best[2]:
                best = (ids, probs, score, m)
        return best


def stored_nodes(tree):
    """Node objects reachable from the root (lazy nodes stand for a whole count-1 chain)."""
    stack, n = [tree.root], 0
    while stack:
        node = stack.pop()
        n += 1
        stack.extend((node.children or {}).values())
    return n


def as_tuple(draft):
    return draft.token_ids, draft.probs, draft.score, draft.match_len


def test_tree_counts_match_brute_force_with_removals():
    rng = random.Random(1)
    for _ in range(300):
        depth = rng.randint(1, 6)
        tree, ref = SuffixTree(depth), RefTree(depth)
        live = []
        for _ in range(rng.randint(1, 8)):
            action = rng.random()
            if live and action < 0.25:
                sid = live.pop(rng.randrange(len(live)))
                tree.remove(sid)
                ref.remove(sid)
            else:
                sid = rng.choice(live) if live and action < 0.6 else rng.randrange(10**6)
                ids = [rng.randrange(rng.randint(1, 4)) for _ in range(rng.randint(0, 12))]
                tree.extend(sid, ids)
                ref.extend(sid, ids)
                if sid not in live and sid in tree:
                    live.append(sid)
            assert tree.counts() == ref.counts()
            assert tree.num_nodes == stored_nodes(tree) <= len(ref.counts()) + 1


def test_cache_speculation_matches_brute_force():
    rng = random.Random(2)
    compared = 0
    for _ in range(200):
        depth = rng.randint(2, 7)
        vocab = rng.randint(1, 4)
        limit = rng.choice([0, 1, 2, 100])
        cache = SuffixDecodingCache(depth, max_cached_requests=limit)
        global_ref, local_refs, cached = RefTree(depth), {}, []
        for req in range(rng.randint(1, 5)):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 10))]
            cache.start_request(req, prompt)
            if limit:
                cached.append(req)
                while len(cached) > limit:
                    global_ref.remove(cached.pop(0))
            assert cache.cached_requests == cached
            local_refs[req] = RefTree(depth)
            local_refs[req].extend(req, prompt)
            context = list(prompt)
            for _ in range(rng.randint(0, 6)):
                out = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
                cache.add_active_response(req, out)
                local_refs[req].extend(req, out)
                if req in cached:
                    global_ref.extend(req, out)
                context += out
                max_spec = rng.randint(0, 6)
                factor = rng.choice([0.0, 0.5, 1.0, 2.0, 3.0])
                min_prob = rng.choice([0.0, 0.1, 0.3, 0.5, 1.0])
                got = cache.speculate(req, context, max_spec, factor, min_prob)
                ctx = context[-depth:]
                local = local_refs[req].speculate(ctx, max_spec, factor, min_prob)
                shared = global_ref.speculate(ctx, max_spec, factor, min_prob)
                assert got.match_len + len(got.token_ids) <= depth
                if shared is None:
                    continue
                expected = local if local[2] >= shared[2] else shared
                assert as_tuple(got) == expected, (context, depth, max_spec, factor, min_prob)
                compared += 1
            if rng.random() < 0.7:
                cache.stop_request(req)
    assert compared > 500


# [7 1 2 7 1]: "7 1" occurs twice, once followed by 2: every step has probability 1/2.
SEQ = [7, 1, 2, 7, 1]


def single(prompt, depth=24):
    cache = SuffixDecodingCache(depth, max_cached_requests=0)
    cache.start_request("r", prompt)
    return cache


def test_clamps_on_a_known_sequence():
    cache = single(SEQ)
    draft = cache.speculate("r", SEQ, 8, max_spec_factor=1.0, min_token_prob=0.1)
    # match "7 1" (2 tokens) allows 2 tokens: 2 then 7, each with probability 1/2.
    assert (draft.token_ids, draft.probs, draft.match_len) == ([2, 7], [0.5, 0.5], 2)
    assert cache.speculate("r", SEQ, 8, max_spec_factor=2.0).token_ids == [2, 7, 1]
    assert cache.speculate("r", SEQ, 1).token_ids == [2]
    assert cache.speculate("r", SEQ, 0).token_ids == []
    assert cache.speculate("r", SEQ, 8, max_spec_factor=0.0).token_ids == []
    assert cache.speculate("r", SEQ, 8, min_token_prob=0.5).token_ids == [2, 7]  # >= passes
    assert cache.speculate("r", SEQ, 8, min_token_prob=0.51).token_ids == []


def test_no_match_gives_nothing():
    cache = single([1, 2, 3, 4])
    for context in ([1, 2, 3, 4], [9, 9], [4], []):
        draft = cache.speculate("r", context, 5)
        assert (draft.token_ids, draft.score) == ([], 0.0)


def test_depth_cuts_tree_and_draft():
    cache = single(SEQ * 3, depth=3)
    assert max(map(len, cache.local_tree("r").counts())) == 3
    draft = cache.speculate("r", SEQ * 3, 8, max_spec_factor=4.0)
    assert draft.match_len + len(draft.token_ids) <= 3
    assert len(single(SEQ * 3, depth=24).speculate("r", SEQ * 3, 8, max_spec_factor=4.0).token_ids) == 8


def test_global_tree_drafts_from_past_responses():
    cache = SuffixDecodingCache(24, max_cached_requests=10)
    cache.start_request("a", [1, 2])
    cache.add_active_response("a", [3, 4, 5, 6])
    cache.stop_request("a")
    cache.start_request("b", [9, 3, 4])
    # b's own tree knows nothing after "3 4"; a's response continues it with 5 6.
    assert cache.speculate("b", [9, 3, 4], 4, max_spec_factor=2.0).token_ids == [5, 6]
    assert cache.global_tree.counts().keys() >= {(3, 4, 5, 6)}
    assert (1, 2) not in cache.global_tree.counts()  # prompts never enter the global tree


def test_fifo_eviction_and_zero_disables_the_global_tree():
    rng = random.Random(3)
    responses = {}
    cache = SuffixDecodingCache(4, max_cached_requests=2)
    for req in range(5):
        cache.start_request(req, [rng.randrange(3) for _ in range(5)])
        responses[req] = [rng.randrange(3) for _ in range(6)]
        cache.add_active_response(req, responses[req])
        cache.stop_request(req)
        assert cache.cached_requests == list(range(max(0, req - 1), req + 1))
        ref = RefTree(4)
        for kept in cache.cached_requests:
            ref.extend(kept, responses[kept])
        assert cache.global_tree.counts() == ref.counts()
    # Restarting a cached id replaces its old response; the one just added is never evicted.
    cache.start_request(4, [0])
    assert cache.cached_requests == [3, 4] and 4 not in cache.global_tree

    off = SuffixDecodingCache(4, max_cached_requests=0)
    off.start_request("a", [1, 2])
    off.add_active_response("a", [3, 4, 5])
    off.stop_request("a")
    off.start_request("b", [3, 4])
    assert off.cached_requests == [] and off.global_tree.num_nodes == 1
    assert off.speculate("b", [3, 4], 4).token_ids == []


def test_stop_request_releases_local_state():
    cache = SuffixDecodingCache(8, max_cached_requests=5)
    cache.start_request("a", list(range(50)))
    cache.add_active_response("a", [1, 2, 3])
    cache.stop_request("a")
    assert cache.active_requests == set()
    with pytest.raises(ValueError, match="not active"):
        cache.speculate("a", [1, 2], 3)
    with pytest.raises(ValueError, match="not active"):
        cache.stop_request("a")
    assert cache.global_tree.counts()[(1, 2, 3)] == 1  # the response stays cached
    assert cache.global_tree._open == {}  # but nothing of the finished request grows


def test_memory_is_bounded_by_cached_responses():
    rng = random.Random(4)
    depth, limit = 6, 3
    cache = SuffixDecodingCache(depth, max_cached_requests=limit)
    responses = {}
    for req in range(40):
        cache.start_request(req, [rng.randrange(50) for _ in range(30)])
        responses[req] = [rng.randrange(50) for _ in range(rng.randint(10, 60))]
        cache.add_active_response(req, responses[req])
        cache.stop_request(req)
        fresh = SuffixTree(depth)
        for kept in cache.cached_requests:
            fresh.extend(kept, responses[kept])
        assert cache.global_tree.counts() == fresh.counts()
        assert cache.global_tree.num_nodes <= len(fresh.counts()) + 1
    for kept in cache.cached_requests:
        cache.evict_cached_response(kept)
    assert cache.global_tree.num_nodes == 1 and cache.global_tree.root.count == 0


def test_text_seen_once_costs_about_a_node_per_token():
    rng = random.Random(5)
    prompt = [rng.randrange(10**6) for _ in range(3000)]
    cache = single(prompt, depth=24)
    assert cache.local_tree("r").num_nodes <= 2 * len(prompt)  # not len * depth
    repeated = single(prompt[:100] * 30, depth=24)  # a repeated block shares its nodes
    assert repeated.local_tree("r").num_nodes <= 100 * 24 + 1


def test_drafter_feeds_the_cache_from_whole_sequences():
    config = SpeculativeConfig.from_json(
        '{"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 8}'
    )
    drafter = build_proposer(config, max_model_len=1000)
    assert isinstance(drafter, SuffixProposer)
    tokens = [5, 6, 7, 8, 5, 6]
    assert drafter.propose([DraftRequest(1, tokens, 4)])[0].token_ids == [7, 8]
    tokens += [7, 8, 5]  # the caller's list grows in place, as DraftService's does
    assert drafter.propose([DraftRequest(1, tokens, 2)])[0].token_ids == [6, 7]
    ref = RefTree(8)
    ref.extend(1, tokens)
    assert drafter.cache.local_tree(1).counts() == ref.counts()
    assert drafter.cache.global_tree.counts() == {
        (7,): 1,
        (8,): 1,
        (5,): 1,
        (7, 8): 1,
        (8, 5): 1,
        (7, 8, 5): 1,
    }  # only the response
    drafter.release(1)
    drafter.release(2)  # never drafted for: nothing to release
    assert drafter.cache.active_requests == set() and drafter._seen == {}
