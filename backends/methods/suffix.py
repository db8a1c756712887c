"""Suffix decoding (the `suffix` method): drafts from suffix trees over token history, with the
semantics vLLM gets from arctic-inference 0.1.1 (SuffixDecoding, arXiv 2411.04975;
https://github.com/snowflakedb/ArcticInference/blob/v0.1.1/arctic_inference/suffix_decoding/cache.py
and csrc/suffix_decoding/suffix_tree.cc), written here.

Every active request has a local tree over its prompt plus its output so far; one global tree
holds the responses (never prompts) of up to `max_cached_requests` requests, evicted FIFO. Both
are suffix tries cut at `max_tree_depth`: the node for a string s counts the occurrences of s
(one per stored suffix start whose path reaches it). A draft follows the most frequent child
from the longest-scoring match of the context's tail; the tree with the higher score wins.

A string seen once is one lazy node that stands for the rest of its occurrence, so memory is
at most a node per distinct string and in practice a few per token (random text: ~1); an
append touches only the nodes of suffixes seen before, at most max_tree_depth of them.
Probabilities are Python floats (arctic-inference uses float32; only exact ties can differ).

Tree mode (suffix_decoding_use_tree_spec; arctic-inference's `use_tree_spec`, which vLLM never
turns on, grows one subtree from the best match of one tree): the draft is the most probable
continuations of every match of the context's tail in BOTH trees, each at the highest
probability any match gives it, up to the node budget (suffix_decoding_max_tree_nodes) and
num_speculative_tokens levels. The longest match's continuation leads; where it goes wrong,
a shorter match or the other tree often holds the right token, as a sibling the verifier can
take instead (it accepts any root path, so the target picks the branch). Each match's
candidates are grown best-first (the frontier node with the highest path probability next).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

from backends.config import DrafterConfig
from backends.serving.proposer import Draft, DraftRequest, Proposer, ProposerContext


@dataclass
class SuffixDraft:
    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # each token's path probability
    score: float = 0.0  # sum of probs: the expected number of accepted tokens
    match_len: int = 0  # how many context tokens a path draft continues
    # Tree mode: each token's parent (-1 = the root), parents first; None: a chain.
    parents: list[int] | None = None


class _Node:
    __slots__ = ("token", "count", "depth", "children", "head", "rank", "seq", "pos")

    def __init__(self, token: int, depth: int, rank: int) -> None:
        self.token = token
        self.count = 1
        self.depth = depth
        # None = lazy: a count-1 node whose subtree is the rest of its one occurrence, read
        # from the sequence (seq, pos = index of its last token) instead of stored as nodes.
        self.children: dict[int, _Node] | None = None
        # The child drafts follow: highest count, ties to the highest rank. None with children
        # present means "stale, recompute": set when the head's count drops on eviction.
        self.head: _Node | None = None
        # +clock when promoted (count went up), so the most recently promoted wins a tie;
        # -clock when created, so a new child goes behind its equal-count siblings.
        self.rank = rank
        self.seq: Hashable = None
        self.pos = 0


def _rank(node: _Node) -> tuple[int, int]:
    return node.count, node.rank


def _head(node: _Node) -> _Node | None:
    if node.head is None and node.children:
        node.head = max(node.children.values(), key=_rank)
    return node.head


class SuffixTree:
    """A suffix trie over several sequences, cut at `max_depth`, updated one token at a time.

    Count-1 nodes are lazy (see `_Node.children`), so a string seen once costs one node, not
    one per depth: an append touches only the nodes of suffixes seen before, and random text
    costs a few nodes per token instead of max_depth.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(-1, 0, 0)
        self.root.count = 0  # the root counts suffix starts: every stored token
        self.root.children = {}
        self.num_nodes = 1
        self._clock = 0
        self._seqs: dict[Hashable, list[int]] = {}  # read by lazy nodes, and for removal
        self._clocks: dict[Hashable, list[int]] = {}  # each token's append time (creation ranks)
        # Per sequence that may still grow: the stored (non-lazy) nodes of its suffixes that
        # can be extended (depth < max_depth); lazy ones grow with the sequence by themselves.
        self._open: dict[Hashable, list[_Node]] = {}

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def extend(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        seq = self._seqs.setdefault(seq_id, [])
        clocks = self._clocks.setdefault(seq_id, [])
        open_nodes = self._open.setdefault(seq_id, [])
        for token in token_ids:
            self._clock += 1
            pos = len(seq)
            seq.append(token)
            clocks.append(self._clock)
            self.root.count += 1
            grown = []
            for node in (self.root, *open_nodes):
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = self._lazy(token, node.depth + 1, seq_id, pos)
                    if len(node.children) == 1:
                        node.head = child
                    continue
                if child.children is None:
                    self._materialize(child)
                child.count += 1
                child.rank = self._clock
                head = node.head
                if head is not None and head is not child and child.count >= head.count:
                    node.head = child
                if child.depth < self.max_depth:
                    grown.append(child)
            open_nodes[:] = grown

    def _lazy(self, token: int, depth: int, seq_id: Hashable, pos: int) -> _Node:
        node = _Node(token, depth, -self._clocks[seq_id][pos])
        node.seq, node.pos = seq_id, pos
        self.num_nodes += 1
        return node

    def _materialize(self, node: _Node) -> None:
        """Store a lazy node's first implicit child, about to get a second occurrence."""
        seq_id, pos = node.seq, node.pos
        node.children, node.seq = {}, None
        token = self._implicit(seq_id, pos, node.depth, 0)
        if token is not None:
            node.children[token] = self._lazy(token, node.depth + 1, seq_id, pos + 1)
        elif pos == len(self._seqs[seq_id]) - 1 and seq_id in self._open and node.depth < self.max_depth:
            # Its occurrence ends its (still growing) sequence: that sequence extends it now.
            self._open[seq_id].append(node)

    def _implicit(self, seq_id: Hashable, pos: int, depth: int, extra: int) -> int | None:
        """The token `extra` + 1 places past a lazy node's occurrence, if within the tree."""
        seq = self._seqs[seq_id]
        at = pos + extra + 1
        return seq[at] if depth + extra < self.max_depth and at < len(seq) else None

    def close(self, seq_id: Hashable) -> None:
        """The sequence will not grow any more: drop its open suffixes, keep its counts."""
        self._open.pop(seq_id, None)

    def remove(self, seq_id: Hashable) -> None:
        """Take every suffix of the sequence out of the counts, freeing nodes that reach 0."""
        seq = self._seqs[seq_id]
        self._open.pop(seq_id, None)
        for start in range(len(seq)):
            self.root.count -= 1
            node = self.root
            for d in range(min(self.max_depth, len(seq) - start)):
                child = node.children[seq[start + d]]
                child.count -= 1
                if node.head is child:
                    node.head = None
                if child.count == 0:  # only this suffix passed here: a chain of count-1 nodes
                    del node.children[child.token]
                    self.num_nodes -= 1
                    while child.children:
                        child = next(iter(child.children.values()))
                        self.num_nodes -= 1
                    break
                node = child
        del self._seqs[seq_id], self._clocks[seq_id]

    def _match(self, tail: Sequence[int]) -> tuple[_Node, int] | None:
        """(node, tokens past it along a lazy node's occurrence) that `tail` leads to."""
        node, extra = self.root, 0
        for token in tail:
            if node.children is None:
                if self._implicit(node.seq, node.pos, node.depth, extra) != token:
                    return None
                extra += 1
            else:
                node = node.children.get(token)
                if node is None:
                    return None
        return node, extra

    def speculate(
        self, context: Sequence[int], max_spec_tokens: int, max_spec_factor: float, min_token_prob: float
    ) -> SuffixDraft:
        """The best single path over every match length 1..len(context)-1."""
        best = SuffixDraft()
        n = len(context)
        for match_len in range(1, n):
            match = self._match(context[n - match_len :])
            if match is None:
                return best  # a longer tail cannot match either
            max_tokens = max(0, min(max_spec_tokens, int(match_len * max_spec_factor + 1e-6)))
            draft = self._follow(*match, max_tokens, min_token_prob)
            if draft.score >= best.score:  # ties go to the longer match
                draft.match_len = match_len
                best = draft
        return best

    def _follow(self, node: _Node, extra: int, max_tokens: int, min_token_prob: float) -> SuffixDraft:
        draft = SuffixDraft()
        prob = 1.0
        while len(draft.token_ids) < max_tokens:
            if node.children is None:  # count 1 all along a lazy node: prob is unchanged
                token = self._implicit(node.seq, node.pos, node.depth, extra)
                if token is None:
                    break
                extra += 1
            else:
                child = _head(node)
                if child is None:
                    break
                prob *= child.count / node.count
                if prob < min_token_prob:
                    break
                token, node = child.token, child
            draft.token_ids.append(token)
            draft.probs.append(prob)
            draft.score += prob
        return draft

    def tree_candidates(
        self,
        context: Sequence[int],
        max_nodes: int,
        max_depth: int,
        max_spec_factor: float,
        min_token_prob: float,
        out: dict[tuple[int, ...], float],
    ) -> None:
        """Adds to `out` ({continuation: score}, a continuation's highest score kept) the
        `max_nodes` most probable continuations of each match of the context's tail, a match of
        m tokens at most m * max_spec_factor levels deep. The tails seen once all continue the
        same occurrence, with probability 1: of them only the one that may go deepest is grown.

        A continuation's score is its probability times 1 - 2^-m: a short match says less about
        what comes next than its counts do (where the trees held the same answers many times,
        continuations of short matches scored 0.5-0.9 and were accepted 8-30% of the time). In
        process at 8 and 16 streams this took the 16-level tree from 0.88-0.93x and 0.80-0.88x
        the chain's tok/s to 0.97-1.07x and 0.86-0.97x; a replay of the bench's outputs
        estimated 1.15x the chain at batch 1 (from 1.12-1.13x)."""
        n = len(context)
        grow, once = [], None
        for match_len in range(1, n):
            match = self._match(context[n - match_len :])
            if match is None:
                break
            # the trie holds max_depth - match_len levels below a match
            levels = min(max_depth, int(match_len * max_spec_factor + 1e-6), self.max_depth - match_len)
            if match[0].count > 1:
                grow.append((match, levels, match_len))
            elif once is None or levels > once[1]:
                once = (match, levels, match_len)
        for (node, extra), levels, match_len in grow + ([once] if once else []):
            trust = 1 - 0.5**match_len
            for path, prob in self._grow(node, extra, max_nodes, levels, min_token_prob):
                out[path] = max(prob * trust, out.get(path, 0.0))

    def _grow(
        self, node: _Node, extra: int, max_nodes: int, max_depth: int, min_token_prob: float
    ) -> list[tuple[tuple[int, ...], float]]:
        """Best-first: the frontier node with the highest probability next, until max_nodes
        (and any tied with the last). A child's probability is at most its parent's, so these
        are the most probable continuations there are (within max_depth levels), each after
        its parent, in non-increasing probability."""
        found: list[tuple[tuple[int, ...], float]] = []
        order = itertools.count()  # equal probabilities: the earliest pushed first
        frontier: list[tuple[float, int, tuple[int, ...], _Node, int]] = []  # (-prob, order, path, node, extra)

        def push_children(node: _Node, extra: int, prob: float, path: tuple[int, ...]) -> None:
            if len(path) < max_depth:
                for token, p, child, child_extra in self._next(node, extra, prob, min_token_prob):
                    heapq.heappush(frontier, (-p, next(order), path + (token,), child, child_extra))

        push_children(node, extra, 1.0, ())
        while frontier and (len(found) < max_nodes or (found and -frontier[0][0] == found[-1][1])):
            neg_prob, _, path, node, extra = heapq.heappop(frontier)
            found.append((path, -neg_prob))
            push_children(node, extra, -neg_prob, path)
        return found

    def _next(
        self, node: _Node, extra: int, prob: float, min_token_prob: float
    ) -> Iterator[tuple[int, float, _Node, int]]:
        """(token, probability, node, extra) of each continuation at or above min_token_prob,
        siblings in the order path mode prefers them (so it breaks their ties). A continuation's
        probability is among the occurrences that go on: the match's count also holds the
        context's own occurrence, which has no next token yet (path mode keeps arctic's
        count, which weighs every continuation of a match seen n times by (n - 1) / n: a tree's
        scores then understated what the target accepted, and the expected-value cut of a
        replay under load verified 0.2 nodes a step instead of 3.3)."""
        if node.children is None:  # a lazy node has one continuation, as probable as itself
            token = self._implicit(node.seq, node.pos, node.depth, extra)
            if token is not None:
                yield token, prob, node, extra + 1
            return
        going_on = sum(child.count for child in node.children.values())
        for child in sorted(node.children.values(), key=_rank, reverse=True):
            p = prob * (child.count / going_on)
            if p < min_token_prob:
                return  # the rest are no more probable
            yield child.token, p, child, 0

    def counts(self) -> dict[tuple[int, ...], int]:
        """{string: count} for every string the tree holds (for tests and debugging)."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[tuple[int, ...], _Node]] = [((), self.root)]
        while stack:
            path, node = stack.pop()
            if node.children is None:
                extra = 0
                while (token := self._implicit(node.seq, node.pos, node.depth, extra)) is not None:
                    path += (token,)
                    out[path] = 1
                    extra += 1
                continue
            for token, child in node.children.items():
                out[path + (token,)] = child.count
                stack.append((path + (token,), child))
        return out


class SuffixDecodingCache:
    """Local trees of the active requests plus the global tree of cached responses."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000) -> None:
        if max_tree_depth < 1 or max_cached_requests < 0:
            raise ValueError(
                f"max_tree_depth={max_tree_depth} must be >= 1 and max_cached_requests={max_cached_requests} >= 0"
            )
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.global_tree = SuffixTree(max_tree_depth)
        self._local: dict[Hashable, SuffixTree] = {}
        self._cached: OrderedDict[Hashable, None] = OrderedDict()  # FIFO of global responses

    @property
    def active_requests(self) -> set[Hashable]:
        return set(self._local)

    @property
    def cached_requests(self) -> list[Hashable]:
        return list(self._cached)

    def local_tree(self, req_id: Hashable) -> SuffixTree:
        try:
            return self._local[req_id]
        except KeyError:
            raise ValueError(f"request {req_id!r} is not active") from None

    def start_request(self, req_id: Hashable, prompt_ids: Sequence[int]) -> None:
        if req_id in self._local:
            raise ValueError(f"request {req_id!r} is already active")
        if req_id in self._cached:  # a new response under an old id replaces the old one
            self.evict_cached_response(req_id)
        tree = self._local[req_id] = SuffixTree(self.max_tree_depth)
        tree.extend(req_id, prompt_ids)
        if self.max_cached_requests > 0:
            self._cached[req_id] = None
            while len(self._cached) > self.max_cached_requests:  # never the one just added
                self.evict_cached_response(next(iter(self._cached)))

    def add_active_response(self, req_id: Hashable, token_ids: Sequence[int]) -> None:
        self.local_tree(req_id).extend(req_id, token_ids)
        if req_id in self._cached:
            self.global_tree.extend(req_id, token_ids)

    def stop_request(self, req_id: Hashable) -> None:
        """Drop the local tree; the response stays in the global tree until evicted."""
        if self._local.pop(req_id, None) is None:
            raise ValueError(f"request {req_id!r} is not active")
        self.global_tree.close(req_id)

    def evict_cached_response(self, req_id: Hashable) -> None:
        del self._cached[req_id]
        if req_id in self.global_tree:  # a request that produced nothing left no trace
            self.global_tree.remove(req_id)

    def speculate(
        self,
        req_id: Hashable,
        context: Sequence[int],
        max_spec_tokens: int | None = None,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        tree_depth: int | None = None,
    ) -> SuffixDraft:
        """A path of at most max_spec_tokens tokens from the tree that scores higher, or with
        `tree_depth` (tree mode) a subtree of at most max_spec_tokens nodes and tree_depth
        levels drawn from both trees and every match length."""
        context = context[-self.max_tree_depth :]
        if max_spec_tokens is None:
            max_spec_tokens = self.max_tree_depth
        trees = (self.local_tree(req_id), self.global_tree)
        if tree_depth is None:
            local, shared = (t.speculate(context, max_spec_tokens, max_spec_factor, min_token_prob) for t in trees)
            return local if local.score >= shared.score else shared
        scored: dict[tuple[int, ...], float] = {}
        for tree in trees:
            tree.tree_candidates(context, max_spec_tokens, tree_depth, max_spec_factor, min_token_prob, scored)
        return _best_subtree(scored, max_spec_tokens)


def _best_subtree(scored: dict[tuple[int, ...], float], max_nodes: int) -> SuffixDraft:
    """The `max_nodes` most probable continuations as a tree, parents first. A continuation is
    at most as probable as its prefix and ties go to the shorter, so every node's parent ranks
    before it: the result is closed under parents."""
    ranked = sorted(scored.items(), key=lambda item: (-item[1], len(item[0])))[:max_nodes]
    draft = SuffixDraft(parents=[])  # match_len stays 0: the nodes come from many matches
    index: dict[tuple[int, ...], int] = {}
    for path, prob in ranked:
        index[path] = len(draft.token_ids)
        draft.token_ids.append(path[-1])
        draft.parents.append(index[path[:-1]] if len(path) > 1 else -1)
        draft.probs.append(prob)
        draft.score += prob
    return draft


class SuffixProposer(Proposer):
    """The `suffix` drafter backend: turns DraftService's whole-sequence calls into the cache's
    start / add-response / stop calls. The cache only ever gets the sequence's own tokens
    (prompt + output), never drafts, so nothing rolls back whichever tree branch was accepted.
    A request with num_nodes > 0 gets a tree (suffix_decoding_use_tree_spec)."""

    in_orchestrator = True

    def __init__(self, cache: SuffixDecodingCache, max_spec_factor: float, min_token_prob: float) -> None:
        self.cache = cache
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._seen: dict[int, int] = {}  # seq_id -> tokens already given to the cache

    @classmethod
    def from_config(cls, config: DrafterConfig, ctx: ProposerContext) -> SuffixProposer:
        cache = SuffixDecodingCache(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests)
        return cls(cache, config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)

    def propose(self, batch: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for r in batch:
            seen = self._seen.get(r.seq_id)
            if seen is None:  # first call of the sequence: what it has is the prompt
                self.cache.start_request(r.seq_id, r.token_ids)
            elif len(r.token_ids) > seen:
                self.cache.add_active_response(r.seq_id, r.token_ids[seen:])
            self._seen[r.seq_id] = len(r.token_ids)
            # num_draft_tokens (and num_nodes) are already clamped to max_tokens and the context
            # window by the caller; a tree keeps within num_draft_tokens levels.
            tree = r.num_nodes > 0
            draft = self.cache.speculate(
                r.seq_id,
                r.token_ids[-self.cache.max_tree_depth :],
                r.num_nodes if tree else r.num_draft_tokens,
                self.max_spec_factor,
                self.min_token_prob,
                r.num_draft_tokens if tree else None,
            )
            drafts.append(Draft(draft.token_ids, parents=draft.parents, scores=draft.probs if tree else None))
        return drafts

    def release(self, seq_id: int) -> None:
        if self._seen.pop(seq_id, None) is not None:
            self.cache.stop_request(seq_id)
