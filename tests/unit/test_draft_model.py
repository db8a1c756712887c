"""The draft_model proposer: its drafts, per-sequence KV rollback, batching, probabilities,
the heterogeneous-vocabulary bridge, and speculative decoding with it in process."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from backends.config import SpeculativeConfig
from backends.config.errors import SpeculativeConfigError
from backends.methods.draft_model import DraftModelProposer
from backends.methods.drafts import DRAFT_KV_MEMORY_GB, argmax_ids, sample_drafts
from backends.methods.hetero_vocab import TextBridge
from backends.runtime import linear_kernels
from backends.runtime.engine import LeanEngine
from backends.runtime.hf_engine import HFEngine
from backends.runtime.kv_cache import SequenceError
from backends.runtime.lean_lm import LeanCausalLM, _Int4Linear, _Int8Linear, _PackedLinear
from backends.runtime.model_store import load_causal_lm, load_tokenizer
from backends.serving.drafting import DraftService
from backends.serving.local import generate_local
from backends.serving.proposer import DraftRequest, build_proposer
from backends.serving.request import SamplingParams
from backends.serving.target import VerifyRequest
from client.cli.hf_baseline import hf_assisted, hf_greedy_timed, hf_prompt_lookup
from tests.fixtures.helpers import assert_same_caches, check_ragged_batches, hf_greedy

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The", "for i in range(10):\n    print(i"]


@pytest.fixture(scope="module")
def draft_lm(tiny_draft_dir):
    return load_causal_lm(tiny_draft_dir, "float32")


@pytest.fixture(scope="module", params=["transformers", "lean"])
def make(request, draft_lm):
    """A DraftModelProposer of draft_lm on either engine, each with its own caches:
    transformers' or the lean runtime's pool (what from_config picks on the CPU)."""
    if request.param == "lean":
        lean = LeanCausalLM.from_hf(draft_lm)
        engine = functools.partial(LeanEngine.with_pool, lean, memory_gb=DRAFT_KV_MEMORY_GB, prefix_caching=True)
    else:
        engine = functools.partial(HFEngine, draft_lm)
    return lambda *args, **kw: DraftModelProposer(engine(), *args, **kw)


def cached_length(proposer: DraftModelProposer, seq_id: int) -> int:
    return proposer.engine.length(seq_id)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


def cacheless_greedy(model, ids: list[int], k: int) -> list[int]:
    """The reference: k argmax steps, each a full forward over the whole sequence."""
    ids = list(ids)
    with torch.inference_mode():
        for _ in range(k):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-k:]


def draft_config(model_dir, target_dir, **extra) -> SpeculativeConfig:
    return SpeculativeConfig.from_json(
        {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 4, **extra},
        target_model=str(target_dir),
    )


def test_drafts_are_the_drafters_greedy_continuation(make, draft_lm, prompt_ids):
    proposer = make(512)
    for seq_id, ids in enumerate(prompt_ids):
        draft = proposer.propose([DraftRequest(seq_id, ids, 5)])[0]
        assert draft.token_ids == cacheless_greedy(draft_lm, ids, 5)
        assert draft.probs is None  # greedy drafts are one-hot: the verifier assumes q = 1


def cacheless_path_probabilities(model, ids: list[int], drafts: list[int]) -> list[float]:
    """The reference of a chain's scores: the product of the drafter's softmax probabilities
    of each draft and of those before it, each from a full forward."""
    scores, path = [], 1.0
    with torch.inference_mode():
        for i, token in enumerate(drafts):
            logits = model(input_ids=torch.tensor([ids + drafts[:i]])).logits[0, -1]
            path *= float(logits.float().softmax(-1)[token])
            scores.append(path)
    return scores


def test_a_chain_is_scored_with_its_path_probabilities(make, draft_lm, prompt_ids):
    """Each draft's score is the drafter's probability of the chain up to it (what the
    orchestrator's cut weighs against the cost of verifying it)."""
    proposer = make(512)
    for seq_id, ids in enumerate(prompt_ids):
        draft = proposer.propose([DraftRequest(seq_id, ids, 4)])[0]
        assert draft.scores == pytest.approx(cacheless_path_probabilities(draft_lm, ids, draft.token_ids), rel=1e-4)
        assert all(a >= b for a, b in zip(draft.scores, draft.scores[1:]))


@pytest.mark.parametrize("diverge_at", [0, 2, 4, 5])
def test_rollback_after_a_rejection_equals_a_fresh_proposer(make, draft_lm, prompt_ids, diverge_at):
    proposer = make(512)
    ids = prompt_ids[0]
    drafts = proposer.propose([DraftRequest(7, ids, 5)])[0].token_ids
    # The target accepted `diverge_at` drafts and emitted another token (or the bonus).
    wrong = (drafts[diverge_at] + 1) % 300 if diverge_at < 5 else 42
    context = ids + drafts[:diverge_at] + [wrong]
    again = proposer.propose([DraftRequest(7, context, 4)])[0].token_ids
    assert again == make(512).propose([DraftRequest(7, context, 4)])[0].token_ids
    assert again == cacheless_greedy(draft_lm, context, 4)
    state = proposer._seqs[7]
    assert state.token_ids == context + again[:-1]
    assert cached_length(proposer, 7) == len(state.token_ids)


def test_a_context_that_changes_earlier_than_the_drafts_is_redrafted(make, draft_lm, prompt_ids):
    proposer = make(512)
    proposer.propose([DraftRequest(1, prompt_ids[1], 4)])
    changed = prompt_ids[1][:3] + prompt_ids[2]
    again = proposer.propose([DraftRequest(1, changed, 4)])[0].token_ids
    assert again == cacheless_greedy(draft_lm, changed, 4)


def test_a_prompt_another_sequence_drafted_over_is_not_computed_again(make, draft_lm, prompt_ids):
    """Prefix caching in the drafter's pool: a second sequence with the same prompt takes its
    whole blocks from the first (released or not), drafts the same, and can still roll back
    into them (it starts over from the cache)."""
    proposer = make(512)
    if not proposer.engine.prefix_caching:
        pytest.skip("prefix caching is the lean runtime's pool")
    prompt = prompt_ids[0] * 3  # a few whole blocks of 16
    first = proposer.propose([DraftRequest(1, prompt, 4)])[0].token_ids
    proposer.release(1)
    hits = proposer.engine.prefix_hits
    assert proposer.propose([DraftRequest(2, prompt, 4)])[0].token_ids == first
    assert proposer.engine.prefix_hits - hits == (len(prompt) - 1) // 16 * 16
    assert first == cacheless_greedy(draft_lm, prompt, 4)
    changed = prompt[:5] + prompt_ids[1]  # earlier than the shared blocks end
    again = proposer.propose([DraftRequest(2, changed, 4)])[0].token_ids
    assert again == cacheless_greedy(draft_lm, changed, 4)
    assert cached_length(proposer, 2) == len(changed) + 3


def test_batched_equals_one_at_a_time(make, draft_lm, prompt_ids):
    """Ragged caches (fresh, running, rolled back) and ragged draft counts in one batch; the
    drafts and every sequence's cache after splitting must match the lone runs."""
    batched, alone = make(512), make(512)
    alone.propose([DraftRequest(0, prompt_ids[0], 3)])
    batched.propose([DraftRequest(0, prompt_ids[0], 3)])
    contexts = check_ragged_batches(
        batched, alone, prompt_ids, lambda seq, ids, k, _: DraftRequest(seq, ids, k), steps=4, first_k=2, vocab_size=300
    )
    if isinstance(batched.engine, HFEngine):
        assert_same_caches(alone, batched, contexts, atol=1e-5)
    for seq in contexts:
        assert batched._seqs[seq].token_ids == alone._seqs[seq].token_ids
        assert cached_length(batched, seq) == cached_length(alone, seq) == len(alone._seqs[seq].token_ids)


def test_probabilistic_drafts_come_with_their_distribution(make, draft_lm, prompt_ids):
    proposer = make(512, "probabilistic", seed=0)
    drafts = proposer.propose([DraftRequest(s, ids, 4) for s, ids in enumerate(prompt_ids)])
    for ids, draft in zip(prompt_ids, drafts):
        assert draft.probs.shape == (4, draft_lm.config.vocab_size)
        assert draft.probs.dtype == torch.float32
        torch.testing.assert_close(draft.probs.sum(dim=-1), torch.ones(4))
        assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.token_ids))
        # Row 0 is the drafter's next-token distribution after the context.
        with torch.inference_mode():
            first = draft_lm(input_ids=torch.tensor([ids])).logits[0, -1].softmax(-1)
        torch.testing.assert_close(draft.probs[0], first, rtol=1e-4, atol=1e-6)


def test_probabilistic_drafts_follow_each_requests_temperature(make, draft_lm, prompt_ids):
    """As vLLM: a greedy request drafts the argmax even under probabilistic drafting (its
    verification accepts only the argmax), a sampled one drafts from softmax(logits / T)."""
    greedy = make(512).propose([DraftRequest(0, prompt_ids[0], 4)])[0]
    proposer = make(512, "probabilistic", seed=0)
    alone = proposer.propose([DraftRequest(9, prompt_ids[0], 4, temperature=0.0)])[0]
    assert alone.token_ids == greedy.token_ids and alone.probs is None  # an all-greedy batch: no q at all
    drafts = proposer.propose(
        [DraftRequest(s, ids, 4, temperature=t) for s, (ids, t) in enumerate(zip(prompt_ids, (0.0, 0.5, 2.0)))]
    )
    assert drafts[0].token_ids == greedy.token_ids  # greedy beside sampled rows
    with torch.inference_mode():
        logits = draft_lm(input_ids=torch.tensor([prompt_ids[1]])).logits[0, -1]
    torch.testing.assert_close(drafts[1].probs[0], (logits / 0.5).softmax(-1), rtol=1e-4, atol=1e-6)


def test_sampled_drafts_follow_the_tempered_distribution():
    """Frequencies of many draws (fixed seed) match softmax(logits / T); greedy rows take the
    argmax; draft-vocabulary ids and probabilities land on their target ids."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    temperatures = [0.0] + [0.7] * 19999
    to_target = torch.tensor([3, 5, 6, 9])
    gen = torch.Generator().manual_seed(0)
    tokens, probs = sample_drafts(logits, "probabilistic", temperatures, [gen] * 20000, to_target, 10)
    assert tokens[0] == 3 and probs.shape == (20000, 10) and probs[:, [0, 1, 2, 4, 7, 8]].sum() == 0
    expected = (logits[0] / 0.7).softmax(-1)
    torch.testing.assert_close(probs[1, to_target], expected)
    frequencies = torch.stack([(tokens[1:] == t).float().mean() for t in to_target])
    assert (frequencies - expected).abs().sum() / 2 < 0.015, (frequencies, expected)
    assert sample_drafts(logits[:2], "greedy", [1.0, 1.0], [gen, gen])[1] is None  # greedy drafting: one-hot


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_draft_ids_are_torchs_argmax(dtype):
    """argmax_ids (the C kernel on the CPU) is torch's argmax: the first of equal maxima, a NaN
    row's NaN, any leading shape, strided rows."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 1001, generator=gen).to(dtype)
    logits[0, 1, [7, 500, 900]] = 50.0  # ties: the first
    views = [logits, logits[:, 2], logits[:, 1:3, :999], logits[0]]
    for view in views:
        assert torch.equal(argmax_ids(view), view.float().argmax(-1))
    logits[2, 3, 40] = float("nan")
    assert torch.equal(argmax_ids(logits), logits.float().argmax(-1)) and argmax_ids(logits)[2, 3] == 40


def test_release_frees_the_sequence(make, draft_lm, prompt_ids):
    proposer = make(512)
    proposer.propose([DraftRequest(1, prompt_ids[0], 2), DraftRequest(2, prompt_ids[1], 2)])
    assert proposer.num_sequences == 2
    proposer.release(1)
    proposer.release(99)  # unknown: nothing to do
    assert set(proposer._seqs) == {2}
    assert proposer.engine.length(2) > 0
    with pytest.raises(SequenceError, match="not in the KV cache"):  # its cache is gone
        proposer.engine.length(1)


def test_no_drafts_past_the_context_window(make, draft_lm, prompt_ids):
    proposer = make(len(prompt_ids[0]) + 2)
    assert len(proposer.propose([DraftRequest(1, prompt_ids[0], 5)])[0].token_ids) == 2
    assert proposer.propose([DraftRequest(2, prompt_ids[1], 5)])[0].token_ids == []


def test_from_config(tiny_draft_dir, tiny_model_dir, prompt_ids):
    proposer = build_proposer(draft_config(tiny_draft_dir, tiny_model_dir), max_model_len=512, dtype="float32")
    assert isinstance(proposer, DraftModelProposer)
    # a Llama on the CPU: the lean runtime, which holds the only copy of the weights
    assert isinstance(proposer.engine, LeanEngine) and proposer.engine.lm.dtype == torch.float32
    int8 = build_proposer(draft_config(tiny_draft_dir, tiny_model_dir, quantization="int8"), max_model_len=512)
    if linear_kernels.int8_linear_available():  # the lean runtime's int8 kernel
        assert isinstance(int8.engine.lm.lm_head, _Int8Linear)
    elif linear_kernels.packed_linear_available():  # bf16 on the packed kernel: faster than dynamic int8
        assert isinstance(int8.engine.lm.lm_head, _PackedLinear)
    else:  # torch's dynamic int8 through transformers
        assert "DynamicQuantizedLinear" in repr(int8.engine.model)
    assert len(int8.propose([DraftRequest(1, prompt_ids[0], 3)])[0].token_ids) == 3
    int4 = build_proposer(draft_config(tiny_draft_dir, tiny_model_dir, quantization="int4"), max_model_len=512)
    if linear_kernels.int4_linear_available():  # int4 where K is a multiple of 64 (the tiny hidden size)
        assert isinstance(int4.engine.lm.lm_head, _Int4Linear)
    assert len(int4.propose([DraftRequest(1, prompt_ids[0], 3)])[0].token_ids) == 3
    with pytest.raises(ValueError, match="quantization='fp8'"):
        build_proposer(draft_config(tiny_draft_dir, tiny_model_dir, quantization="fp8"), max_model_len=512)
    config = draft_config(tiny_draft_dir, tiny_model_dir)
    config.draft_tensor_parallel_size = 2
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2"):
        build_proposer(config, max_model_len=512)


def speculate(runner, tokenizer, prompt, proposer, max_tokens=40):
    """The orchestrator's loop in process with `proposer` drafting; the output ids and stats."""
    # DraftService reads only the draft length from its config.
    config = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 4})
    return generate_local(prompt, tokenizer, runner, DraftService(proposer, config), {0}, max_tokens=max_tokens)


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_speculative_greedy_equals_target_greedy(runner, tokenizer, tiny_model_dir, tiny_draft_dir, quantization):
    config = draft_config(tiny_draft_dir, tiny_model_dir, quantization=quantization)
    proposer = build_proposer(config, max_model_len=512, dtype="float32")
    for prompt in PROMPTS:
        out, stats = speculate(runner, tokenizer, prompt, proposer)
        assert tuple(out) == hf_greedy(str(tiny_model_dir), prompt, 40)
        assert stats.acceptance.num_draft_tokens > 0
    assert proposer.num_sequences == 0


def test_sampled_verification_with_the_draft_probs(runner, tiny_model_dir, prompt_ids):
    """Drafting with the target's own weights: row j of the draft probabilities must be the
    target's distribution for draft j (q = p), so every draft is accepted, where passing no
    probabilities (q = 1) accepts a draft only with probability p."""
    target = load_causal_lm(tiny_model_dir, "float32")
    ids = prompt_ids[1]

    def run(with_probs: bool) -> int:
        proposer = DraftModelProposer(HFEngine(target), 512, "probabilistic", seed=0)
        emitted, accepted, new = [], 0, list(ids)
        for _ in range(4):
            draft = proposer.propose([DraftRequest(5, ids + emitted, 4)])[0]
            with torch.inference_mode():
                logits = target(input_ids=torch.tensor([ids + emitted + draft.token_ids])).logits[0]
            torch.testing.assert_close(draft.probs, logits[-5:-1].softmax(-1), rtol=1e-4, atol=1e-6)
            sampling = SamplingParams(temperature=1.0, seed=3)
            result = runner.verify(
                VerifyRequest(5, new, draft.token_ids, sampling, draft_probs=draft.probs if with_probs else None)
            )
            accepted += result.num_accepted
            emitted += result.token_ids
            new = []
        runner.release(5)
        return accepted

    assert run(with_probs=True) == 16
    assert run(with_probs=False) < 16


def test_text_bridge_maps_draft_text_to_target_tokens(tiny_model_dir, tiny_hetero_dir):
    target, draft = load_tokenizer(tiny_model_dir), load_tokenizer(tiny_hetero_dir)
    context, continuation = "def add(a, b):", "\n    return a + b"
    assert target(context)["input_ids"] != draft(context)["input_ids"]  # really another vocabulary
    bridge = TextBridge(target, draft)
    target_ids = target(context)["input_ids"]
    draft_context = bridge.to_draft(target_ids)
    assert draft_context == draft(context)["input_ids"]
    whole = target(context + continuation)["input_ids"]
    draft_drafts = draft(context + continuation)["input_ids"][len(draft_context) :]
    assert bridge.to_target(target_ids, draft_context, draft_drafts, 20) == whole[len(target_ids) :]
    assert bridge.to_target(target_ids, draft_context, draft_drafts, 2) == whole[len(target_ids) :][:2]


def test_heterogeneous_vocab_speculation_equals_target_greedy(runner, tokenizer, tiny_model_dir, tiny_hetero_dir):
    config = draft_config(tiny_hetero_dir, tiny_model_dir, use_heterogeneous_vocab=True)
    proposer = build_proposer(config, max_model_len=512, dtype="float32", target_model=tiny_model_dir)
    vocab = runner.config.vocab_size
    drafts = proposer.propose([DraftRequest(1, tokenizer(PROMPTS[0])["input_ids"], 4)])[0]
    assert drafts.probs is None and drafts.token_ids and all(0 <= t < vocab for t in drafts.token_ids)
    proposer.release(1)
    for prompt in PROMPTS:
        out, stats = speculate(runner, tokenizer, prompt, proposer)
        assert tuple(out) == hf_greedy(str(tiny_model_dir), prompt, 40)
        assert stats.acceptance.num_draft_tokens > 0


def test_hf_baselines_reproduce_plain_greedy(tiny_model_dir, tiny_draft_dir):
    prompts = PROMPTS[:2]
    runs = {
        "greedy": hf_greedy_timed(tiny_model_dir, prompts, 20, dtype="float32"),
        "assisted": hf_assisted(tiny_model_dir, tiny_draft_dir, prompts, 20, dtype="float32"),
        "prompt_lookup": hf_prompt_lookup(tiny_model_dir, prompts, 20, num_tokens=3, dtype="float32"),
    }
    for results in runs.values():
        for prompt, result in zip(prompts, results):
            assert tuple(result["ids"]) == hf_greedy(str(tiny_model_dir), prompt, 20)
            assert result["num_tokens"] == len(result["ids"]) and result["tokens_per_s"] > 0
            assert result["text"] and result["prompt"] == prompt


def test_a_seeded_requests_drafts_do_not_depend_on_who_else_is_drafted(draft_lm, prompt_ids):
    """Its own generator (seeded by the request): the same sampled drafts alone as beside
    other sampled sequences, batched in any order."""

    def drafts_of_seq_1(batch_ids: list[int]) -> list[int]:
        proposer = DraftModelProposer(HFEngine(draft_lm), 512, "probabilistic", seed=123)
        requests = {
            1: DraftRequest(1, prompt_ids[0], 4, temperature=0.9, seed=5),
            2: DraftRequest(2, prompt_ids[1], 4, temperature=1.0),
            3: DraftRequest(3, prompt_ids[0], 3, temperature=0.7, seed=6),
        }
        drafts = proposer.propose([requests[i] for i in batch_ids])
        return drafts[batch_ids.index(1)].token_ids

    alone = drafts_of_seq_1([1])
    assert drafts_of_seq_1([2, 1, 3]) == alone and drafts_of_seq_1([3, 2, 1]) == alone


# ---------------------------------------------------------------------------- trees

CHAIN_TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]"


def test_a_tree_is_the_chain_with_its_next_most_likely_siblings(make, draft_lm, prompt_ids, tiny_draft_dir):
    from backends.config.fields import parse_token_tree

    proposer = make(512)
    proposer.token_tree = parse_token_tree(CHAIN_TREE)
    ids = prompt_ids[0]
    draft = proposer.propose([DraftRequest(1, ids, 4, num_nodes=7)])[0]
    chain = cacheless_greedy(draft_lm, ids, 4)
    with torch.inference_mode():
        logits = draft_lm(input_ids=torch.tensor([ids + chain])).logits[0, len(ids) - 1 :]
    ranked = [row.argsort(descending=True).tolist() for row in logits]
    probs = logits.softmax(-1)

    def token(path):  # the chain's token at the path's depth, or the rank-th most likely other one
        d, r = len(path) - 1, path[-1]
        return chain[d] if r == 0 else [t for t in ranked[d] if t != chain[d]][r - 1]

    # num_nodes keeps the 7 of the 8 paths the draft finds most probable (the chain's
    # probabilities down to the node, times the node's), by depth, then probability.
    paths = proposer.token_tree
    score = {
        p: math.prod(float(probs[d][chain[d]]) for d in range(len(p) - 1)) * float(probs[len(p) - 1][token(p)])
        for p in paths
    }
    kept = sorted(sorted(paths, key=lambda p: (-score[p], len(p)))[:7], key=len)
    assert draft.token_ids == [token(p) for p in kept]
    assert draft.parents == [kept.index(p[:-1]) if len(p) > 1 else -1 for p in kept] and draft.probs is None
    assert draft.scores == pytest.approx([score[p] for p in kept], rel=1e-4)  # what the loop's cut weighs
    # The next step after a sibling was accepted: the cache is rolled back to the chain it holds.
    accepted = [chain[0], ranked[1][1], 7]
    again = proposer.propose([DraftRequest(1, ids + accepted, 4, num_new=3, num_accepted=2, num_nodes=7)])[0]
    fresh = make(512)
    fresh.token_tree = proposer.token_tree
    alone = fresh.propose([DraftRequest(2, ids + accepted, 4, num_nodes=7)])[0]
    assert (again.token_ids, again.parents) == (alone.token_ids, alone.parents)
    assert again.scores == pytest.approx(alone.scores, rel=1e-3)
    assert cached_length(proposer, 1) == cached_length(fresh, 2)


def test_draft_model_trees_branch_off_the_chain_only(tiny_draft_dir, tiny_model_dir):
    with pytest.raises(SpeculativeConfigError, match=r"path \(1, 0\): draft_model's tree branches off its chain"):
        draft_config(tiny_draft_dir, tiny_model_dir, speculative_token_tree="[(0,), (1,), (1, 0)]")


def test_speculating_with_a_draft_model_tree_equals_target_greedy(runner, tokenizer, tiny_model_dir, tiny_draft_dir):
    config = draft_config(tiny_draft_dir, tiny_model_dir, speculative_token_tree=CHAIN_TREE)
    proposer = build_proposer(config, max_model_len=512, dtype="float32")
    for prompt in PROMPTS:
        out, stats = generate_local(prompt, tokenizer, runner, DraftService(proposer, config), {0}, max_tokens=40)
        assert tuple(out) == hf_greedy(str(tiny_model_dir), prompt, 40)
        assert stats.acceptance.num_draft_tokens > 4 * stats.acceptance.num_drafts  # trees, not chains
        assert stats.acceptance.num_accepted_tokens > 0
