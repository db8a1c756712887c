"""Draft trees and their verification in one target pass.

A tree is its nodes in topological order: node i holds a draft token and the index of its
parent, -1 for the root (the last token the target has emitted, which is not a node). A
chain is the tree whose node i has parent i - 1. One verification pass runs every node, each
attending to the cached context and its own ancestors, at position (next position + depth).

Acceptance walks down from the root:
- greedy: follow the child whose token is the target's argmax; where no child matches (or
  there are none) emit the argmax and stop. The output is the target's own greedy decoding.
- sampled: at each node try its children in order (recursive rejection sampling, as
  SpecInfer and EAGLE-2): a child x with draft distribution q is accepted with probability
  min(1, p(x) / q(x)); if rejected, the target distribution becomes the residual
  normalize(max(p - q, 0)) for the next sibling; when every child is rejected, or there are
  none, a token is sampled from what remains. A child without draft probabilities counts as
  a one-hot q (the residual is then p without that token). Each emitted token is an exact
  sample of the target's distribution whenever the siblings are fixed tokens or independent
  draws from their q (what our drafters produce), never Medusa's "typical acceptance".

Randomness: one float64 uniform per child tried, then one multinomial draw where no child is
accepted, all from the request's generator, in that order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from backends.runtime.cpu_kernels import argmax_rows
from backends.serving.rejection import request_probs
from backends.serving.request import GREEDY, SamplingParams

ROOT = -1


class TreeError(ValueError):
    """A draft tree that is not one: a parent after its child, an unknown parent, a wrong length."""


@dataclass(frozen=True)
class DraftTree:
    token_ids: tuple[int, ...]
    parents: tuple[int, ...]  # parent node of each node; ROOT (-1) for children of the root

    def __post_init__(self) -> None:
        if len(self.parents) != len(self.token_ids):
            raise TreeError(f"a tree of {len(self.token_ids)} tokens needs as many parents, got {len(self.parents)}")
        for i, parent in enumerate(self.parents):
            if not ROOT <= parent < i:
                raise TreeError(f"node {i} has parent {parent}; a parent must be -1 (the root) or an earlier node")

    @classmethod
    def chain(cls, token_ids: Sequence[int]) -> DraftTree:
        return cls(tuple(token_ids), tuple(range(-1, len(token_ids) - 1)))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], token_ids: Sequence[int]) -> DraftTree:
        """The tree whose node i is reached by `paths[i]` (child ranks from the root, e.g.
        (0, 1) = the second child of the first child); parents must come before children."""
        index = {tuple(path): i for i, path in enumerate(paths)}
        parents = []
        for path in paths:
            parent = tuple(path[:-1])
            if parent and parent not in index:
                raise TreeError(f"tree path {tuple(path)} has no parent path {parent}")
            parents.append(index[parent] if parent else ROOT)
        return cls(tuple(token_ids), tuple(parents))

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node: 0 for the root's children."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(0 if parent == ROOT else depths[parent] + 1)
        return tuple(depths)

    @property
    def depth(self) -> int:
        """Levels below the root (the longest accepted run it allows)."""
        return max(self.depths, default=-1) + 1

    def walk(self, token_ids: Sequence[int]) -> list[int]:
        """The nodes `token_ids` lead down to from the root, each the first child holding the
        next token (as acceptance tries them): a step's accepted path from its emitted tokens."""
        node, path = ROOT, []
        for token in token_ids:
            node = next((c for c in self.children.get(node, []) if self.token_ids[c] == token), None)
            if node is None:
                break
            path.append(node)
        return path

    @cached_property
    def children(self) -> dict[int, list[int]]:
        """Node (ROOT included) -> its children in node order."""
        children: dict[int, list[int]] = {ROOT: []}
        for i, parent in enumerate(self.parents):
            children.setdefault(i, [])
            children[parent].append(i)
        return children

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def first_path(self) -> list[int]:
        """The nodes of the chain of first children: what an engine without tree attention verifies."""
        node, nodes = ROOT, []
        while self.children.get(node):
            node = self.children[node][0]
            nodes.append(node)
        return nodes

    def attention_mask(self, num_pending: int) -> torch.Tensor:
        """[p + n, p + n] bool over a step's new tokens (p pending ones, then the n nodes): the
        pending tokens are causal, and each node sees every pending token, its ancestors and itself."""
        p, n = num_pending, len(self)
        mask = torch.ones(p + n, p + n, dtype=torch.bool).tril_()
        seen: list[list[bool]] = []  # each node's ancestors and itself, from its parent's (parents come first)
        for i, parent in enumerate(self.parents):
            row = seen[parent][:] if parent != ROOT else [False] * n
            row[i] = True
            seen.append(row)
        mask[p:, p:] = torch.tensor(seen, dtype=torch.bool).reshape(n, n)
        return mask

    def positions(self, start: int, num_pending: int) -> torch.Tensor:
        """RoPE positions of a step's new tokens when the sequence has `start` cached."""
        pending = torch.arange(start, start + num_pending)
        return torch.cat([pending, start + num_pending + torch.tensor(self.depths, dtype=torch.long)])

    def row_prefixes(self) -> list[list[int]]:
        """Draft tokens before each verification row (the root's, then each node's)."""
        return [[]] + [[self.token_ids[j] for j in self.path(i)] for i in range(len(self))]


def best_nodes(scores: Sequence[float], depths: Sequence[int], size: int) -> list[int]:
    """Which `size` candidate nodes a draft tree keeps: those of the highest score (ties: the
    shallower, then the earlier), ordered by depth, then score. Where no node scores above its
    parent (cumulative draft probabilities), every kept node's parent is kept: EAGLE-2's
    rerank, and how a static tree is cut to the size a step can afford."""
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], depths[i], i))[:size]
    return sorted(ranked, key=lambda i: depths[i])  # stable: by rank within a level


def subtree_parents(parents: Sequence[int], kept: Sequence[int]) -> list[int]:
    """The parents of the subtree made of nodes `kept` (each after its parent), renumbered."""
    index = {node: new for new, node in enumerate(kept)}
    return [ROOT if parents[i] == ROOT else index[parents[i]] for i in kept]


def path_scores(paths: Sequence[Sequence[int]], probs: Callable[[int, int], float]) -> list[float]:
    """Each static-tree path's cumulative draft probability: the product over its levels d of
    probs(d, rank at d), the draft's probability of that level's token."""
    return [math.prod(probs(depth, rank) for depth, rank in enumerate(path)) for path in paths]


def accept_tree(
    tree: DraftTree,
    logits: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Verify a tree against its logit rows ([n + 1, V]: the root's, then each node's);
    `draft_probs`: [n, V], node i's row being the distribution it was drawn from (None:
    one-hot). Returns the accepted nodes (a root path) and the token that follows them."""
    if logits.dim() != 2 or logits.shape[0] != len(tree) + 1:
        raise TreeError(f"a tree of {len(tree)} nodes is verified by {len(tree) + 1} logit rows, got {logits.shape[0]}")
    if sampling.greedy:
        return _accept_greedy(tree, argmax_rows(logits))
    probs = request_probs(logits, sampling).double()
    q = None if draft_probs is None else draft_probs.to(probs.device, torch.float64)
    node, path = ROOT, []
    while True:
        p = probs[node + 1].clone()
        for child in tree.children[node]:
            x = tree.token_ids[child]
            q_child = None if q is None else q[child]
            q_x = 1.0 if q_child is None else float(q_child[x])
            u = torch.rand((), dtype=torch.float64, generator=generator, device=p.device).item()
            if p[x] > 0 and p[x] >= u * q_x:
                path.append(child)
                node = child
                break
            p = _residual(p, x, q_child)
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))


def _accept_greedy(tree: DraftTree, argmax: list[int]) -> tuple[list[int], int]:
    node, path = ROOT, []
    while True:
        target = argmax[node + 1]
        match = next((c for c in tree.children[node] if tree.token_ids[c] == target), None)
        if match is None:
            return path, target
        path.append(match)
        node = match


def _residual(p: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """normalize(max(p - q, 0)); q None is one-hot at `token`. An all-zero residual (p == q,
    which a rejection makes impossible but rounding might not) keeps p."""
    residual = p.clone()
    if q is None:
        residual[token] = 0.0
    else:
        residual = (residual - q).clamp_min_(0.0)
    total = residual.sum()
    return residual / total if total > 0 else p
