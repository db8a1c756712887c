"""Draft trees from the EAGLE-family heads (eagle, eagle3, mtp): EAGLE-2's dynamic trees and
static `speculative_token_tree`s against a cacheless reference, batching, the state a tree
step leaves for the next call, and speculative decoding in process with trees verified by
the lean runtime (greedy output is the target's own)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

from backends.config import SpeculativeConfig
from backends.methods.eagle import EagleProposer, best_subtree
from backends.methods.eagle_head import load_eagle
from backends.methods.mtp import MTPHead
from backends.serving.drafting import DraftService
from backends.serving.local import generate_local
from backends.serving.proposer import build_proposer
from backends.serving.target import TargetRunner
from backends.serving.tree import ROOT, DraftTree
from tests.fixtures.head_server import GREEDY_PROMPTS, fit, next_token_loss, teacher
from tests.fixtures.helpers import assert_same_caches, hf_greedy, request, three_layer_target_dir
from tests.fixtures.synthetic_heads import EAGLE_FAMILY, load_eagle_family, write_eagle_family

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The", "for i in range(10):\n    print(i"]
V = 384  # the tiny target's vocabulary
DYNAMIC = {"top_k": 3, "total_token": 10}
STATIC = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0))
TREES = {"dynamic": {"dynamic_tree": DYNAMIC}, "static": {"token_tree": STATIC}}
# What the fitted heads keep of the target's: the embedding and LM head (MTP: shared_head.head).
FROZEN = {"embed_tokens.weight", "lm_head.weight", "layers.0.shared_head.head.weight"}


target_dir = three_layer_target_dir


@pytest.fixture(scope="module")
def runner(target_dir):
    """The lean runtime verifies trees in one pass (the transformers engine cuts them to a chain)."""
    return TargetRunner(target_dir, dtype="float32", runtime="lean")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, target_dir):
    return write_eagle_family(tmp_path_factory.mktemp("tree-heads"), target_dir)


@pytest.fixture(scope="module")
def heads(checkpoints, target):
    return {name: load_eagle_family(name, path, target, "float32") for name, path in checkpoints.items()}


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


# ---------------------------------------------------------------------------- the reference


class Cacheless:
    """The head run afresh for every node: the context's pairs, then the (token, parent state)
    pairs down the node's path, causal; a node's state and draft log-probs are its last row's."""

    def __init__(self, head, context: list[int], hidden: torch.Tensor) -> None:
        self.head, self.context, self.hidden = head, context, hidden

    @torch.inference_mode()
    def run(self, tokens: list[int], states: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.context[1:] + tokens
        n = len(ids)
        feats = torch.cat([self.head.features(self.hidden), *[s[None] for s in states]])
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        out = self.head(
            torch.tensor([ids]),
            feats[None],
            torch.arange(n)[None],
            mask,
            DynamicCache(config=self.head.config),
            len(tokens),
        )[0, -1]
        return out, self.head.logits(out, len(tokens)).float().log_softmax(-1)

    def target_id(self, draft_id: int) -> int:
        to_target = self.head.draft_to_target
        return draft_id if to_target is None else int(to_target[draft_id])


def reference_dynamic_tree(ref: Cacheless, top_k: int, depth: int, size: int) -> tuple[list[int], list[int]]:
    """EAGLE-2 written plainly: nodes are (token, score, depth, parent, path tokens, path states)."""
    nodes: list[tuple] = []

    def expand(parent: int, score: torch.Tensor, tokens: list[int], states: list[torch.Tensor]) -> list[int]:
        state, logp = ref.run(tokens, states)
        values, ids = logp.topk(top_k)
        new = []
        for value, draft_id in zip(values, ids.tolist()):
            token = ref.target_id(draft_id)
            nodes.append((token, score + value, len(states), parent, tokens + [token], states + [state]))
            new.append(len(nodes) - 1)
        return new

    level = expand(ROOT, torch.tensor(0.0), [], [])
    for _ in range(depth - 1):
        frontier = sorted(level, key=lambda i: -float(nodes[i][1]))[:top_k]
        level = [child for i in frontier for child in expand(i, nodes[i][1], nodes[i][4], nodes[i][5])]
    ranked = sorted(range(len(nodes)), key=lambda i: (-float(nodes[i][1]), nodes[i][2]))[:size]
    kept = sorted(ranked, key=lambda i: nodes[i][2])
    index = {node: new for new, node in enumerate(kept)}
    return [nodes[i][0] for i in kept], [ROOT if nodes[i][3] == ROOT else index[nodes[i][3]] for i in kept]


def reference_static_tree(ref: Cacheless, paths: list[tuple[int, ...]]) -> list[int]:
    """Node (r_0, .., r_d) is the rank-r_d token of its parent's distribution."""
    tokens, runs = {}, {(): ([], [], *ref.run([], []))}  # path -> (path tokens, path states, state, logp)
    for path in paths:
        above, states, state, logp = runs[path[:-1]]
        tokens[path] = ref.target_id(int(logp.topk(path[-1] + 1).indices[-1]))
        runs[path] = (above + [tokens[path]], states + [state], *ref.run(above + [tokens[path]], states + [state]))
    return [tokens[p] for p in paths]


def tree_request(runner, head, seq_id: int, context: list[int], k: int, nodes: int, delivered: int = 0):
    return replace(request(runner, head, seq_id, context, k, delivered), num_nodes=nodes)


# ---------------------------------------------------------------------------- the trees


def test_the_rerank_keeps_parents_before_equal_scoring_children():
    """Node 2 (a child of probability 1) scores as its parent, node 0: the shallower is kept
    first. Nodes deeper than the depth asked for are left out."""
    candidates = ([5, 6, 7, 8], [-1.0, -0.5, -1.0, -2.0], [ROOT, ROOT, 0, 2], [0, 0, 1, 2])
    assert best_subtree(*candidates, 3, 2)[:2] == ([6, 5], [ROOT, ROOT])
    assert best_subtree(*candidates, 3, 3)[:2] == ([6, 5, 7], [ROOT, ROOT, 1])
    tokens, parents, scores = best_subtree(*candidates, 2, 9)
    assert (tokens, parents) == ([6, 5, 7], [ROOT, ROOT, 1])
    assert scores == pytest.approx([math.exp(-0.5), math.exp(-1.0), math.exp(-1.0)])  # path probabilities


@pytest.mark.parametrize("name", EAGLE_FAMILY)
@pytest.mark.parametrize(("k", "nodes"), [(4, 10), (3, 2), (2, 12)])
def test_dynamic_tree_is_eagle2s(name, k, nodes, heads, runner, prompt_ids):
    """The nodes are the `nodes` best by cumulative draft log-probability of the levels that
    fed their top_k, ordered by depth then score; greedy and sampled requests get the same
    tree, without probabilities."""
    head = heads[name]
    greedy = EagleProposer(head, 512, dynamic_tree=DYNAMIC)
    sampling = EagleProposer(head, 512, "probabilistic", seed=0, dynamic_tree=DYNAMIC)
    for seq, ids in enumerate(prompt_ids):
        req = tree_request(runner, head, seq, ids, k, nodes)
        draft = greedy.propose([req])[0]
        tree = DraftTree(tuple(draft.token_ids), tuple(draft.parents))  # parents come first
        assert len(tree) == nodes and tree.depth <= k and draft.probs is None
        assert all(len(set(tree.token_ids[c] for c in kids)) == len(kids) for kids in tree.children.values())
        assert (draft.token_ids, draft.parents) == reference_dynamic_tree(
            Cacheless(head, ids, req.hidden_states), DYNAMIC["top_k"], k, nodes
        )
        other = sampling.propose([replace(req, temperature=1.0)])[0]
        assert (other.token_ids, other.parents, other.probs) == (draft.token_ids, draft.parents, None)
        assert greedy.pool.length(seq) == len(ids) - 1  # the tree's entries are dropped
        assert_path_probabilities(draft)


@pytest.mark.parametrize("name", EAGLE_FAMILY)
@pytest.mark.parametrize(("k", "nodes"), [(4, 9), (3, 7), (2, 9), (3, 2)])
def test_static_tree_takes_the_heads_ranked_tokens(name, k, nodes, heads, runner, prompt_ids):
    """The paths of at most k levels, the first `nodes` of them."""
    head = heads[name]
    proposer = EagleProposer(head, 512, token_tree=STATIC)
    paths = [p for p in STATIC if len(p) <= k][:nodes]
    for seq, ids in enumerate(prompt_ids):
        req = tree_request(runner, head, seq, ids, k, nodes)
        draft = proposer.propose([req])[0]
        assert draft.parents == list(DraftTree.from_paths(paths, draft.token_ids).parents)
        assert draft.token_ids == reference_static_tree(Cacheless(head, ids, req.hidden_states), paths)
        assert draft.probs is None
        assert_path_probabilities(draft)


def assert_path_probabilities(draft) -> None:
    """A tree's scores are path probabilities: in (0, 1], a child's at most its parent's, and
    the root's children (distinct tokens of one distribution) at most 1 together."""
    scores = draft.scores
    assert len(scores) == len(draft.token_ids) and all(0 < s <= 1 for s in scores)
    assert all(scores[i] <= scores[p] * (1 + 1e-6) for i, p in enumerate(draft.parents) if p != ROOT)
    assert sum(s for s, p in zip(scores, draft.parents) if p == ROOT) <= 1 + 1e-6


def random_root_path(rng: random.Random, draft) -> list[int]:
    """The tokens of a random accepted path (a chain's prefix, or a root path of a tree)."""
    parents = draft.parents or list(range(-1, len(draft.token_ids) - 1))
    tree, node, path = DraftTree(tuple(draft.token_ids), tuple(parents)), ROOT, []
    while tree.children[node] and rng.random() < 0.7:
        node = rng.choice(tree.children[node])
        path.append(draft.token_ids[node])
    return path


@pytest.mark.parametrize("name", ["eagle", "eagle3", "mtp-per-step"])
@pytest.mark.parametrize("kind", TREES)
def test_batched_trees_equal_one_at_a_time_across_steps(name, kind, heads, runner, prompt_ids):
    """Ragged sequences, trees of several sizes and a chain in one batch, for three steps in
    which the target accepts a random root path: each draft is the one drafted alone, the
    caches agree, and after the last step a proposer that kept its state drafts (chains and
    trees) what a fresh one given every hidden state drafts."""
    head = heads[name]
    batched, alone = (EagleProposer(head, 512, **TREES[kind]) for _ in range(2))
    contexts, delivered = dict(enumerate(prompt_ids)), dict.fromkeys(range(3), 0)
    rng = random.Random(0)
    for step in range(3):
        requests = [
            tree_request(runner, head, seq, ids, 2 + (seq + step) % 3, (0, 4, 9, 12)[(seq + step) % 4], delivered[seq])
            for seq, ids in contexts.items()
        ]
        for req, draft in zip(requests, batched.propose(requests)):
            lone = alone.propose([req])[0]
            assert (draft.token_ids, draft.parents) == (lone.token_ids, lone.parents)
            assert (draft.parents is None) == (req.num_nodes == 0)
            delivered[req.seq_id] = len(req.token_ids) - 1
            contexts[req.seq_id] = req.token_ids + random_root_path(rng, draft) + [rng.randrange(1, V)]
    assert_same_caches(alone, batched, contexts, atol=1e-4)
    for seq, ids in contexts.items():
        nodes = 0 if seq == 0 else 9
        kept = batched.propose([tree_request(runner, head, seq, ids, 3, nodes, delivered[seq])])[0]
        fresh = EagleProposer(head, 512, **TREES[kind]).propose([tree_request(runner, head, seq, ids, 3, nodes)])[0]
        assert (kept.token_ids, kept.parents) == (fresh.token_ids, fresh.parents)


# ---------------------------------------------------------------------------- in process, end to end


def tree_config(method: str, path, target_dir, tree: dict | None) -> SpeculativeConfig:
    spec = {"method": method, "model": str(path), "num_speculative_tokens": 3, **(tree or {})}
    return SpeculativeConfig.from_json(spec, target_model=str(target_dir))


@pytest.mark.parametrize("name", ["eagle", "eagle3", "mtp"])
@pytest.mark.parametrize("tree", [{"dynamic_tree": DYNAMIC}, {"speculative_token_tree": list(STATIC[:-1])}])
def test_speculative_greedy_with_trees_equals_target_greedy(name, tree, checkpoints, runner, tokenizer, target_dir):
    """Built from the speculative config as the server builds it; every step drafts a tree
    (more nodes than k levels) and the output is the target's own greedy decoding."""
    config = tree_config(name, checkpoints[name], target_dir, tree)
    proposer = build_proposer(config, max_model_len=runner.max_model_len, dtype="float32", target_model=target_dir)
    for prompt in PROMPTS[:2]:
        out, stats = generate_local(prompt, tokenizer, runner, DraftService(proposer, config), {0}, max_tokens=24)
        assert tuple(out) == hf_greedy(str(target_dir), prompt, 24)
        assert stats.acceptance.num_draft_tokens > 3 * stats.acceptance.num_drafts > 0
    assert proposer.num_sequences == 0 and not runner.sequences


@pytest.fixture(scope="module")
def fitted(checkpoints, target_dir, target):
    """An EAGLE-1 and an MTP head fitted to the target's distributions (as
    tests/fixtures/head_server.py fits the served heads), the target's embedding and LM head
    left as they are: drafts the target accepts."""
    heads = {
        "eagle": load_eagle(checkpoints["eagle"], target, "float32"),
        "mtp": MTPHead(json.loads((target_dir / "config.json").read_text()), target),
    }
    data = teacher(target_dir)
    for head in heads.values():
        for param_name, param in head.named_parameters():
            param.requires_grad = param_name not in FROZEN
        fit(head, next_token_loss, data)
    return heads


@pytest.mark.parametrize("name", ["eagle", "mtp"])
def test_a_dynamic_tree_accepts_at_least_as_much_as_a_chain(name, fitted, checkpoints, runner, tokenizer, target_dir):
    """Mean acceptance length with a fitted head, the same k, over the prompts it was fitted on."""
    lengths = {}
    for kind, tree in (("chain", None), ("tree", {"dynamic_tree": DYNAMIC})):
        config = tree_config(name, checkpoints[name], target_dir, tree)
        service = DraftService(EagleProposer(fitted[name], 512, dynamic_tree=config.dynamic_tree), config)
        accepted = steps = 0
        for prompt in GREEDY_PROMPTS:
            out, stats = generate_local(prompt, tokenizer, runner, service, {0}, max_tokens=24)
            assert tuple(out) == hf_greedy(str(target_dir), prompt, 24)
            accepted += stats.acceptance.num_accepted_tokens
            steps += stats.acceptance.num_drafts
        lengths[kind] = 1 + accepted / steps
    assert lengths["tree"] >= lengths["chain"] > 1.5, lengths
