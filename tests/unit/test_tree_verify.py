"""Draft trees verified in one forward pass: the emitted tokens are the target's own (greedy:
exactly its greedy decoding; sampled: its distribution), and the KV kept is the accepted path's."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoTokenizer

from backends.serving.request import SamplingParams
from backends.serving.target import SequenceError, TargetRunner, VerifyRequest
from backends.serving.tree import ROOT, DraftTree, TreeError, accept_tree

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return a + b\n", "for i in range(10):", "café au lait"]
VOCAB = 64  # drafts come from the tiny model's first ids, so decoys are plausible tokens


# --- the tree itself ---------------------------------------------------------------------------


def test_tree_structure():
    tree = DraftTree.from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)], [10, 11, 12, 13, 14])
    assert tree.parents == (ROOT, ROOT, 0, 0, 2)
    assert tree.depths == (0, 0, 1, 1, 2) and tree.depth == 3
    assert tree.children[ROOT] == [0, 1] and tree.children[0] == [2, 3]
    assert tree.path(4) == [0, 2, 4] and tree.first_path() == [0, 2, 4]
    assert tree.row_prefixes()[5] == [10, 12, 14]
    assert not tree.is_chain and DraftTree.chain([1, 2, 3]).is_chain
    mask = tree.attention_mask(num_pending=2)
    assert mask[:2, :2].tolist() == [[True, False], [True, True]]
    assert mask[2 + 4].tolist() == [True, True, True, False, True, False, True]  # node 4: pending, 0, 2, itself
    assert tree.positions(start=7, num_pending=2).tolist() == [7, 8, 9, 9, 10, 10, 11]


@pytest.mark.parametrize("parents", [(0,), (ROOT, 1), (ROOT, -2), (ROOT, ROOT, 5)])
def test_a_parent_must_come_first(parents):
    with pytest.raises(TreeError, match="parent"):
        DraftTree(tuple(range(len(parents))), parents)


# --- greedy through the verifier ----------------------------------------------------------------


@pytest.fixture(scope="module")
def runners(tiny_model_dir):
    """(reference, tree) runners on the lean runtime in float32."""
    return tuple(TargetRunner(tiny_model_dir, dtype="float32", runtime="lean") for _ in range(2))


def greedy_reference(runner: TargetRunner, seq_id: int, prompt: list[int], n: int) -> list[int]:
    out = runner.verify(VerifyRequest(seq_id, prompt, [], max_new_tokens=n + 16)).token_ids
    while len(out) < n:
        out += runner.verify(VerifyRequest(seq_id, [], [])).token_ids
    return out


def random_tree(rng: random.Random, truth: list[int], kind: str) -> tuple[DraftTree, int]:
    """A random tree of decoys and how many levels of the true continuation it holds. "hit":
    the true continuation is one of its root paths (at a random place among the siblings);
    "miss": no child of the root is the true next token; "full": the tree's every level is on
    the true path, so everything is accepted."""
    depth = rng.randint(1, min(5, len(truth)))
    if kind == "full":
        tree = DraftTree.chain(truth[:depth]) if rng.random() < 0.5 else _with_leaf_decoys(rng, truth[:depth])
        return tree, depth
    tokens, parents = [], []
    on_path = ROOT
    for level in range(depth):
        for _ in range(rng.randint(0, 3)):  # decoys under a random earlier node or the root
            parent = rng.choice([ROOT, *range(len(tokens))])
            decoy = rng.randrange(VOCAB)
            if parent == on_path and decoy == truth[level]:
                decoy = (decoy + 1) % VOCAB
            if parent == ROOT and decoy == truth[0]:
                decoy = (decoy + 1) % VOCAB
            tokens.append(decoy)
            parents.append(parent)
        if kind == "hit":
            tokens.append(truth[level])
            parents.append(on_path)
            on_path = len(tokens) - 1
    if not tokens:
        tokens, parents = [(truth[0] + 1) % VOCAB], [ROOT]
    return DraftTree(tuple(tokens), tuple(parents)), depth if kind == "hit" else 0


def _with_leaf_decoys(rng: random.Random, path: list[int]) -> DraftTree:
    """The true path, with wrong siblings (other tokens) beside its nodes, placed after them."""
    tokens, parents = list(path), [ROOT, *range(len(path) - 1)]
    for level in range(len(path)):
        wrong = (path[level] + 1 + rng.randrange(VOCAB - 1)) % VOCAB
        tokens.append(wrong)
        parents.append(ROOT if level == 0 else level - 1)
    return DraftTree(tuple(tokens), tuple(parents))


@pytest.mark.parametrize("batched", [False, True])
def test_greedy_trees_emit_the_target_greedy_tokens_and_keep_its_kv(runners, tiny_model_dir, batched):
    reference, runner = runners
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rng = random.Random(1 + batched)
    prompts = {i: tokenizer(p)["input_ids"] for i, p in enumerate(PROMPTS, start=1)}
    length = 40
    truths = {i: greedy_reference(reference, i, p, length + 8) for i, p in prompts.items()}
    outputs = {i: [] for i in prompts}
    kinds_seen = {"hit": 0, "miss": 0, "full": 0}
    first = True
    while min(map(len, outputs.values())) < length:
        batch, kinds = [], []
        for i, prompt in prompts.items():
            if len(outputs[i]) >= length:
                continue
            truth = truths[i][len(outputs[i]) :]
            kind = rng.choice(["hit", "miss", "full", "chain"])
            if kind == "chain":  # chains and trees share the batch
                req = VerifyRequest(i, [], truth[: rng.randint(0, 3)])
            else:
                tree, hits = random_tree(rng, truth, kind)
                req = VerifyRequest(i, [], list(tree.token_ids), draft_parents=list(tree.parents))
            if first:
                req.new_token_ids, req.max_new_tokens = prompt, length + 32
            batch.append(req)
            kinds.append((kind, req, hits if kind != "chain" else 0))
        first = False
        results = runner.verify_batch(batch) if batched else [runner.verify(r) for r in batch]
        for (kind, req, hits), result in zip(kinds, results):
            i = req.seq_id
            truth = truths[i][len(outputs[i]) :]
            assert result.token_ids == truth[: len(result.token_ids)], (kind, req)
            if kind == "miss":
                assert len(result.token_ids) == 1
            if kind in ("hit", "full"):  # every true level is accepted (a decoy below may be too)
                assert len(result.token_ids) >= hits + 1
            if kind == "full":
                assert (
                    len(result.token_ids) == DraftTree(tuple(req.draft_token_ids), tuple(req.draft_parents)).depth + 1
                )
            kinds_seen[kind] = kinds_seen.get(kind, 0) + 1
            outputs[i] += result.token_ids
    assert min(kinds_seen.values()) > 0
    for i in prompts:
        # The kept KV is exactly the plain decoding's: every position in place after the compaction.
        n = runner.cached_tokens(i)
        ref_seq = reference.sequences[i]
        assert runner.sequences[i].token_ids == ref_seq.token_ids[: len(runner.sequences[i].token_ids)]
        pool, ref_pool = runner.engine.pool, reference.engine.pool
        ours = pool.kv[:, pool.slots(i)[:n]]
        theirs = ref_pool.kv[:, ref_pool.slots(i)[:n]]
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
        runner.release(i)
    for i in prompts:
        reference.release(i)


def test_tree_hidden_states_are_the_kept_rows(runners, tiny_model_dir):
    reference, runner = runners
    prompt = AutoTokenizer.from_pretrained(tiny_model_dir)("hello there")["input_ids"]
    truth = greedy_reference(reference, 7, prompt, 6)
    reference.release(7)
    chain = reference.verify(VerifyRequest(7, prompt, truth[:3], hidden_layer_ids=(1, -1), max_new_tokens=8))
    # A tree holding the same path after a decoy branch: the same rows must come back.
    tree = DraftTree((truth[0] + 1, truth[0], 5, truth[1], truth[2]), (ROOT, ROOT, 0, 1, 3))
    got = runner.verify(
        VerifyRequest(
            7,
            prompt,
            list(tree.token_ids),
            hidden_layer_ids=(1, -1),
            max_new_tokens=8,
            draft_parents=list(tree.parents),
        )
    )
    assert got.token_ids == chain.token_ids
    torch.testing.assert_close(got.hidden_states, chain.hidden_states, rtol=1e-4, atol=1e-5)
    runner.release(7)
    reference.release(7)


def test_a_bad_tree_fails_only_its_own_request(runners, tiny_model_dir):
    _, runner = runners
    prompt = AutoTokenizer.from_pretrained(tiny_model_dir)("abc")["input_ids"]
    good = VerifyRequest(21, prompt, [1, 2], max_new_tokens=8, draft_parents=[ROOT, ROOT])
    bad = VerifyRequest(22, prompt, [1, 2], max_new_tokens=8, draft_parents=[1, ROOT])
    short = VerifyRequest(23, prompt, [1, 2], max_new_tokens=8, draft_parents=[ROOT])
    ok, err, err2 = runner.verify_batch([good, bad, short])
    assert isinstance(err, SequenceError) and "draft_parents" in str(err) and "parent" in str(err)
    assert isinstance(err2, SequenceError) and "needs as many parents" in str(err2)
    assert len(ok.token_ids) >= 1 and 22 not in runner.sequences
    runner.release(21)


def test_the_transformers_engine_verifies_a_tree_as_its_first_chain(tiny_model_dir, caplog):
    runner = TargetRunner(tiny_model_dir, dtype="float32", runtime="hf")
    prompt = AutoTokenizer.from_pretrained(tiny_model_dir)("abc")["input_ids"]
    truth = greedy_reference(runner, 1, prompt, 4)
    runner.release(1)
    tree = DraftTree((truth[0], truth[0] + 1, truth[1]), (ROOT, ROOT, 0))
    with caplog.at_level("WARNING"):
        got = runner.verify(VerifyRequest(1, prompt, list(tree.token_ids), draft_parents=list(tree.parents)))
    assert got.token_ids == truth[:3] and "first chain" in caplog.text


# --- sampled: the target's distribution --------------------------------------------------------


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


@pytest.mark.parametrize("drafted", ["fixed", "sampled"])
def test_sampled_trees_follow_the_target_distribution(drafted):
    """First token ~ p(root); after an accepted child a, the next ~ p(a). Siblings are either
    fixed tokens (one-hot q) or independent draws from q (with q given)."""
    vocab, trials = 6, 20000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen) * 1.5
    q = torch.softmax(logits[0] + torch.randn(vocab, generator=gen), -1)  # a drafter near the target
    q_next = torch.softmax(torch.randn(vocab, generator=gen), -1)  # what it draws below node 0
    target = torch.softmax(logits, -1)
    likely = int(target[0].argmax())
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(trials):
        if drafted == "fixed":
            tree, probs = DraftTree((likely, (likely + 1) % vocab, 2), (ROOT, ROOT, 0)), None
        else:
            a, b = torch.multinomial(q, 2, replacement=True, generator=gen).tolist()
            c = int(torch.multinomial(q_next, 1, generator=gen))
            tree, probs = DraftTree((a, b, c), (ROOT, ROOT, 0)), torch.stack([q, q, q_next])
        path, token = accept_tree(tree, logits, probs, SamplingParams(temperature=1.0), gen)
        emitted = [tree.token_ids[n] for n in path] + [token]
        first[emitted[0]] += 1
        if path and path[0] == 0:  # the first child was accepted: the next token is drawn at it
            second[emitted[1]] += 1
    assert total_variation(first, target[0]) < 0.02
    assert second.sum() > 2000 and total_variation(second, target[1]) < 0.04


def test_a_seeded_sampled_tree_is_reproducible():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(3))
    tree = DraftTree((1, 2, 3), (ROOT, ROOT, 1))
    runs = [
        accept_tree(tree, logits, None, SamplingParams(temperature=0.8), torch.Generator().manual_seed(5))
        for _ in range(3)
    ]
    assert runs[0] == runs[1] == runs[2]


def test_sampled_tree_through_the_verifier_respects_top_k(runners, tiny_model_dir):
    """top_k=1 makes sampling greedy: every sampled tree step emits the greedy tokens."""
    reference, runner = runners
    prompt = AutoTokenizer.from_pretrained(tiny_model_dir)("once upon")["input_ids"]
    truth = greedy_reference(reference, 9, prompt, 20)
    reference.release(9)
    sampling = SamplingParams(temperature=1.0, top_k=1, seed=1)
    out = runner.verify(VerifyRequest(9, prompt, [], sampling, max_new_tokens=24)).token_ids
    rng = random.Random(0)
    while len(out) < 16:
        tree, _ = random_tree(rng, truth[len(out) :], rng.choice(["hit", "miss", "full"]))
        out += runner.verify(VerifyRequest(9, [], list(tree.token_ids), draft_parents=list(tree.parents))).token_ids
    assert out == truth[: len(out)]
    runner.release(9)
