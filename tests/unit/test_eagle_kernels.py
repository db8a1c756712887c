"""The EAGLE family's kernel draft path (eagle, eagle3, mtp; bf16): each decoder layer of the
head in one C call (`run_layers` with its attention input) and the head's RMSNorms in C. It
must draft what the reference path drafts, bit for bit, on the same checkpoint: the layer op
by op, transformers' norms (`kernels=False`), for
chains and trees, fresh and running sequences, batched and one at a time."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from backends.methods.eagle import EagleProposer
from backends.methods.eagle_head import KernelRMSNorm, load_eagle
from backends.runtime import cpu_kernels, linear_kernels
from backends.serving.proposer import DraftRequest
from tests.fixtures.helpers import cached_entries, three_layer_target_dir
from tests.fixtures.synthetic_heads import EAGLE_FAMILY, load_eagle_family, write_eagle_family

pytestmark = pytest.mark.skipif(
    not linear_kernels.packed_linear_available(), reason="the bf16 layer kernels need AVX-512 BF16 or AVX2 + FMA"
)

V = 384  # the tiny target's vocabulary
SHAPES = {  # (proposer options, draft tokens, tree nodes)
    "chain": ({}, 3, 0),
    "dynamic-tree": ({"dynamic_tree": {"top_k": 3, "total_token": 10}}, 4, 10),
    "static-tree": ({"token_tree": ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0))}, 3, 8),
}


target_dir = three_layer_target_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, target_dir):
    return write_eagle_family(tmp_path_factory.mktemp("kernel-heads"), target_dir)


def proposer(path, target, name: str, options: dict, kernels: bool) -> EagleProposer:
    """A proposer on its own bf16 copy of the head (the kernel path turns the head's norms)."""
    head = load_eagle_family(name, path, target, "bfloat16")
    return EagleProposer(head, 512, kernels=kernels, **options)


def calls(head_layers: int, width: int, seqs: int = 3, rounds: int = 4, seed: int = 0) -> list[list[DraftRequest]]:
    """Propose calls for `seqs` sequences: each first brings its whole prompt (ragged lengths),
    then every round 1-3 new target positions with some of the last drafts accepted."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    ids = {s: torch.randint(1, V, (9 + 5 * s,), generator=gen).tolist() for s in range(seqs)}

    def hidden(rows: int) -> torch.Tensor:
        return torch.randn(rows, head_layers, width, generator=gen).bfloat16()

    out = [[DraftRequest(s, ids[s], 0, hidden(len(ids[s]) - 1)) for s in range(seqs)]]
    for _ in range(rounds):
        batch = []
        for s in range(seqs):
            new = rng.randrange(1, 4)
            ids[s] = ids[s] + torch.randint(1, V, (new,), generator=gen).tolist()
            batch.append(DraftRequest(s, ids[s], 0, hidden(new), num_new=new, num_accepted=new - 1))
        out.append(batch)
    return out


def drafted(p: EagleProposer, batch: list[DraftRequest], k: int, nodes: int) -> list[tuple]:
    drafts = p.propose([replace(r, num_draft_tokens=k, num_nodes=nodes) for r in batch])
    return [(d.token_ids, d.parents, d.scores) for d in drafts]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", EAGLE_FAMILY)
def test_kernel_path_drafts_the_reference_bit_for_bit(name, shape, checkpoints, target):
    """Drafts, tree scores and every cached K/V entry are the reference path's bits; the
    kernel path batched drafts what it drafts for each sequence alone."""
    options, k, nodes = SHAPES[shape]
    fast, ref, alone = (proposer(checkpoints[name], target, name, options, kernels) for kernels in (True, False, True))
    assert fast.kernels and not ref.kernels
    assert any(isinstance(m, KernelRMSNorm) for m in fast.head.modules())
    assert not any(isinstance(m, KernelRMSNorm) for m in ref.head.modules())
    for batch in calls(len(fast.hidden_layer_ids), target.hidden_size):
        got = drafted(fast, batch, k, nodes)
        assert got == drafted(ref, batch, k, nodes)
        assert got == [drafted(alone, [r], k, nodes)[0] for r in batch]
        assert all(len(d[0]) == (nodes or k) for d in got)
        for r in batch:
            assert fast.pool.length(r.seq_id) == ref.pool.length(r.seq_id)
            for a, b in zip(cached_entries(fast, r.seq_id), cached_entries(ref, r.seq_id), strict=True):
                assert torch.equal(a, b)


def test_a_float32_head_keeps_the_reference_path(checkpoints, target):
    """The kernels are bf16's: a float32 head drafts op by op, with its own norms."""
    head = load_eagle(checkpoints["eagle3"], target, "float32")
    p = EagleProposer(head, 512)
    assert not p.kernels and p.decoder.layer_steps is None
    assert not any(isinstance(m, KernelRMSNorm) for m in head.modules())


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("head", ["eagle", "eagle3", "eagle3-norm-before-residual", "mtp"])
def test_a_greedy_chain_is_one_kernel_call(k, head, checkpoints, target, monkeypatch):
    """A greedy EAGLE-1, EAGLE-3 or MTP (DeepSeek's layout) propose call, the forward over the
    new pairs included, is one C call (cpu_kernels.eagle_chain), with the reference path's
    drafts and KV bits; MTP's first call, whose pair at position 0 reads no embedding, drafts
    in torch."""
    name = head.split("-")[0]
    fast, ref = (proposer(checkpoints[name], target, name, {}, kernels) for kernels in (True, False))
    if head.endswith("-norm-before-residual"):
        for p in (fast, ref):
            p.head.norm_before_residual = True
    chains, forwards = [], []
    run_chain, decode = cpu_kernels.eagle_chain, fast._decode
    monkeypatch.setattr(cpu_kernels, "eagle_chain", lambda chain: chains.append(chain.steps) or run_chain(chain))
    monkeypatch.setattr(fast, "_decode", lambda *a: forwards.append(1) or decode(*a))
    batches = calls(len(fast.hidden_layer_ids), target.hidden_size)
    for batch in batches:
        assert drafted(fast, batch, k, 0) == drafted(ref, batch, k, 0)
        for r in batch:
            for a, b in zip(cached_entries(fast, r.seq_id), cached_entries(ref, r.seq_id), strict=True):
                assert torch.equal(a, b)
    first = 1 if name == "mtp" else 0  # the prompt's call starts at position 0: k forwards in torch
    assert chains == [k] * (len(batches) - first) and len(forwards) == first * k


def test_sampled_chains_and_nan_logits_leave_the_kernel_chain(checkpoints, target, monkeypatch):
    """Sampled drafts come with their probabilities from the loop in torch; logits with a NaN
    (the kernel's argmax refuses them) are drafted there too, from the context's entries."""
    sampled = proposer(checkpoints["eagle3"], target, "eagle3", {}, True)
    sampled.sample_method = "probabilistic"
    monkeypatch.setattr(cpu_kernels, "eagle_chain", lambda *a: pytest.fail("a sampled chain in the greedy kernel"))
    for batch in calls(len(sampled.hidden_layer_ids), target.hidden_size, rounds=1):
        drafts = sampled.propose([replace(r, num_draft_tokens=3, temperature=0.8) for r in batch])
    assert all(d.probs is not None and d.probs.shape[0] == 3 for d in drafts)
    monkeypatch.undo()
    fast, ref = (proposer(checkpoints["eagle3"], target, "eagle3", {}, kernels) for kernels in (True, False))
    for p in (fast, ref):
        with torch.no_grad():
            p.head.lm_head.weight[5] = float("nan")
    for batch in calls(len(fast.hidden_layer_ids), target.hidden_size, rounds=2):
        assert drafted(fast, batch, 3, 0) == drafted(ref, batch, 3, 0)
        assert [fast.pool.length(r.seq_id) for r in batch] == [ref.pool.length(r.seq_id) for r in batch]


def test_a_token_past_the_embedding_is_refused_before_the_kernel_reads(checkpoints, target):
    """The kernel reads the embedding row of each new pair's token: one past the table is refused
    by name (a KernelArgumentError, before any C runs), not read out of bounds."""
    fast = proposer(checkpoints["eagle3"], target, "eagle3", {}, True)
    first, second = calls(len(fast.hidden_layer_ids), target.hidden_size, seqs=1, rounds=1)
    fast.propose([replace(r, num_draft_tokens=2) for r in first])
    bad = replace(second[0], token_ids=second[0].token_ids[:-1] + [V], num_draft_tokens=2)
    with pytest.raises(cpu_kernels.KernelArgumentError, match="ids holds an index outside"):
        fast.propose([bad])
