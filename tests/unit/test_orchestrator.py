"""The draft -> verify loop in process (no Triton): exactness of accept/rollback."""

from __future__ import annotations

import random
import time

import pytest
import torch

from backends.config import SpeculativeConfig
from backends.runtime.model_store import load_causal_lm
from backends.serving.detokenize import TextStream
from backends.serving.drafting import DraftService
from backends.serving.local import LocalDrafter, LocalVerifier, generate_local
from backends.serving.orchestrator import Generation, ServingContext, draft_length, generate
from backends.serving.proposer import Draft, DrafterInfo, Proposer, build_proposer
from backends.serving.request import GenerationRequest, RequestError, SamplingParams
from backends.serving.target import SequenceError, TargetRunner, VerifyRequest
from tests.fixtures.helpers import hf_greedy, load_hf_model


class OracleProposer(Proposer):
    """Proposes the target's own greedy continuation, optionally corrupting one position."""

    def __init__(self, reference: list[int], prompt_len: int, corrupt_every: int = 0) -> None:
        self.reference, self.prompt_len, self.corrupt_every = reference, prompt_len, corrupt_every

    def propose(self, batch):
        out = []
        for r in batch:
            done = len(r.token_ids) - self.prompt_len
            drafts = list(self.reference[done : done + r.num_draft_tokens])
            if self.corrupt_every and drafts and done % self.corrupt_every == 0:
                drafts[len(drafts) // 2] = (drafts[len(drafts) // 2] + 1) % 50
            out.append(Draft(drafts))
        return out


class TreeOracleProposer(OracleProposer):
    """Asked for a tree: the target's continuation as the last child at each level, after wrong
    siblings (and with corrupt_every, a wrong token on that path now and then). With `scored`,
    the tree comes with node scores: 0 for the wrong siblings, 0.9 ** depth on the path."""

    def __init__(
        self, reference: list[int], prompt_len: int, corrupt_every: int = 0, scored: bool = False, vocab: int = 0
    ) -> None:
        super().__init__(reference, prompt_len, corrupt_every)
        self.scored, self.vocab = scored, vocab  # vocab: send one-hot draft probabilities over it
        self.asked: list[int] = []

    def propose(self, batch):
        chains = super().propose(batch)
        out = []
        for req, chain in zip(batch, chains):
            self.asked.append(req.num_nodes)
            tokens, parents, parent = [], [], -1
            for token in chain.token_ids:
                if len(tokens) + 2 > req.num_nodes:
                    break
                tokens += [(token + 7) % 50, token]
                parents += [parent, parent]
                parent = len(tokens) - 1
            scores = [0.0 if i % 2 == 0 else 0.9 ** (i // 2 + 1) for i in range(len(tokens))]
            probs = torch.eye(self.vocab)[tokens] if self.vocab else None
            out.append(Draft(tokens, probs, parents, scores if self.scored else None))
        return out


def run(
    runner,
    tokenizer,
    prompt,
    proposer,
    max_tokens=40,
    k=4,
    num_draft_tokens=None,
    tree=False,
    prefill_chunk=0,
    verifier=None,
    adaptive=False,
    ignore_eos=False,
    **sampling,
):
    spec = {"method": "ngram", "num_speculative_tokens": k}
    if tree:  # a config that drafts trees of k nodes (the proposer is the test's own)
        spec = {"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_use_tree_spec": True}
    config = SpeculativeConfig.from_json(spec)
    drafter = LocalDrafter(DraftService(proposer, config)) if proposer else None
    req = GenerationRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        num_draft_tokens=num_draft_tokens,
        sampling=SamplingParams(**sampling),
        ignore_eos=ignore_eos,
    )
    ids = tokenizer(prompt)["input_ids"]
    seq_id = random.getrandbits(32)
    out = []
    # A fixed k unless asked: the adaptive policy follows step timings, which a loaded machine skews.
    ctx = ServingContext({0}, runner.max_model_len, adaptive, prefill_chunk=prefill_chunk)
    gen = Generation(req, ids, seq_id, verifier or LocalVerifier(runner), drafter, TextStream(tokenizer), ctx)
    for step in generate(gen):
        out += step.token_ids
    runner.release(seq_id)
    return out, gen.stats


PROMPT = "def add(a, b):\n    return a + b\ndef add(a, b):"


def test_plain_loop_equals_hf(runner, tokenizer, tiny_model_dir):
    out, stats = run(runner, tokenizer, PROMPT, None)
    assert tuple(out) == hf_greedy(str(tiny_model_dir), PROMPT, 40)
    assert stats.acceptance.num_draft_tokens == 0


def test_ngram_loop_equals_hf(runner, tokenizer, tiny_model_dir):
    config = SpeculativeConfig.from_json(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    )
    out, stats = run(runner, tokenizer, PROMPT, build_proposer(config, max_model_len=512))
    assert tuple(out) == hf_greedy(str(tiny_model_dir), PROMPT, 40)
    assert stats.acceptance.num_accepted_tokens > 0


def test_perfect_drafts_are_all_accepted(runner, tokenizer, tiny_model_dir):
    reference = list(hf_greedy(str(tiny_model_dir), PROMPT, 40))
    prompt_len = len(tokenizer(PROMPT)["input_ids"])
    out, stats = run(runner, tokenizer, PROMPT, OracleProposer(reference, prompt_len), k=4)
    assert out == reference
    if 0 not in reference:  # no early EOS: every step but the last emits k + 1 tokens
        assert stats.acceptance.acceptance_rate == 1.0
        assert stats.num_steps == -(-len(reference) // 5)


class SlowPromptProposer(OracleProposer):
    """The target's continuation, after a first call that takes long: a model drafter reading
    the whole prompt."""

    def propose(self, batch):
        if not getattr(self, "read_prompt", False):
            self.read_prompt = True
            time.sleep(0.3)
        return super().propose(batch)


def test_the_prompt_step_does_not_teach_the_draft_length_policy(runner, tokenizer, tiny_model_dir):
    """Steady steps decide the draft length: a drafter whose first call read a long prompt
    (here 0.3 s) keeps drafting when its steps are cheap and always accepted."""
    reference = list(hf_greedy(str(tiny_model_dir), PROMPT, 40))
    prompt_len = len(tokenizer(PROMPT)["input_ids"])
    out, stats = run(runner, tokenizer, PROMPT, SlowPromptProposer(reference, prompt_len), k=4, adaptive=True)
    assert out == reference
    assert stats.acceptance.num_drafts == stats.num_steps - 1  # every step drafted but the plain one it timed


def test_wrong_drafts_roll_back_exactly(runner, tokenizer, tiny_model_dir):
    reference = list(hf_greedy(str(tiny_model_dir), PROMPT, 40))
    prompt_len = len(tokenizer(PROMPT)["input_ids"])
    out, stats = run(runner, tokenizer, PROMPT, OracleProposer(reference, prompt_len, corrupt_every=1), k=5)
    assert out == reference
    assert 0 < stats.acceptance.acceptance_rate < 1
    assert not runner.sequences  # released


@pytest.mark.parametrize("corrupt_every", [0, 2])
def test_draft_trees_through_the_loop_give_the_target_greedy_output(runner, tokenizer, tiny_model_dir, corrupt_every):
    reference = list(hf_greedy(str(tiny_model_dir), PROMPT, 40))
    prompt_len = len(tokenizer(PROMPT)["input_ids"])
    proposer = TreeOracleProposer(reference, prompt_len, corrupt_every)
    out, stats = run(runner, tokenizer, PROMPT, proposer, k=8, tree=True)
    assert out == reference
    assert set(proposer.asked) - {0} and max(proposer.asked) <= 16  # the config's node budget: 2k
    assert stats.acceptance.num_accepted_tokens > 0 and 0 < stats.acceptance.acceptance_rate < 1
    if not corrupt_every:  # four levels, each the true token after a wrong sibling: all accepted
        assert stats.acceptance.mean_acceptance_length > 4


def test_scored_trees_are_cut_to_the_nodes_that_pay(runner, tokenizer, tiny_model_dir):
    """With adaptive drafting, a tree with node scores is verified in part (adaptive.DraftCut):
    the wrong siblings, scored 0, never are, so every node verified is accepted."""
    reference = list(hf_greedy(str(tiny_model_dir), PROMPT, 40))
    prompt_len = len(tokenizer(PROMPT)["input_ids"])
    proposer = TreeOracleProposer(reference, prompt_len, scored=True)
    out, stats = run(runner, tokenizer, PROMPT, proposer, k=8, tree=True, adaptive=True)
    assert out == reference
    assert stats.acceptance.num_draft_tokens > 0 and stats.acceptance.acceptance_rate == 1.0
    assert max(proposer.asked) == 16  # the drafter is asked for the whole tree; the cut is the loop's


class ScoredChainProposer(OracleProposer):
    """The target's continuation for the first half of each chain (scored 0.9 ** position),
    then wrong drafts scored 0: what a drafter knows it does not know."""

    def __init__(self, reference: list[int], prompt_len: int) -> None:
        super().__init__(reference, prompt_len)
        self.drafted = 0

    def propose(self, batch):
        out = []
        for chain in super().propose(batch):
            right = (len(chain.token_ids) + 1) // 2
            drafts = chain.token_ids[:right] + [(t + 1) % 50 for t in chain.token_ids[right:]]
            self.drafted += len(drafts)
            out.append(Draft(drafts, scores=[0.9 ** (i + 1) if i < right else 0.0 for i in range(len(drafts))]))
        return out


def test_scored_chains_are_cut_to_the_drafts_that_pay(runner, tokenizer, tiny_model_dir):
    """With adaptive drafting a chain with scores is verified up to the drafts that pay
    (adaptive.DraftCut): the wrong ones, scored 0, never are."""
    reference = list(hf_greedy(str(tiny_model_dir), PROMPT, 40))
    prompt_len = len(tokenizer(PROMPT)["input_ids"])
    proposer = ScoredChainProposer(reference, prompt_len)
    out, stats = run(runner, tokenizer, PROMPT, proposer, k=8, adaptive=True)
    assert out == reference
    assert stats.acceptance.num_draft_tokens > 0 and stats.acceptance.acceptance_rate == 1.0
    assert proposer.drafted > stats.acceptance.num_draft_tokens  # some were drafted and cut


def test_a_cut_sampled_tree_keeps_its_nodes_draft_probabilities(runner, tokenizer, tiny_model_dir):
    """An unseeded sampled request drafting scored trees with draft probabilities: the cut
    tree's probability rows stay those of its nodes (a row of another node would make the
    verifier's rejection sampling refuse or mis-weigh it), and the request runs to the end."""
    reference = list(hf_greedy(str(tiny_model_dir), PROMPT, 40))
    prompt_len = len(tokenizer(PROMPT)["input_ids"])
    proposer = TreeOracleProposer(reference, prompt_len, scored=True, vocab=runner.logits_size)
    seen = []
    verify = LocalVerifier(runner)
    original = verify.verify

    def checked(req):
        if req.draft_probs is not None:  # each row one-hot on its own node's token
            seen.append(req.draft_probs.argmax(-1).tolist() == req.draft_token_ids)
        return original(req)

    verify.verify = checked
    # ignore_eos: unseeded, the request may sample an EOS early and stop (it did in a suite run).
    out, stats = run(
        runner,
        tokenizer,
        PROMPT,
        proposer,
        k=8,
        tree=True,
        adaptive=True,
        verifier=verify,
        temperature=0.7,
        ignore_eos=True,
    )
    assert len(out) == 40 and seen and all(seen)
    assert stats.acceptance.num_draft_tokens > 0


def test_max_tokens_is_exact_with_drafts(runner, tokenizer, tiny_model_dir):
    reference = list(hf_greedy(str(tiny_model_dir), PROMPT, 7))
    prompt_len = len(tokenizer(PROMPT)["input_ids"])
    out, _ = run(runner, tokenizer, PROMPT, OracleProposer(reference + [1] * 10, prompt_len), max_tokens=7, k=4)
    assert out == reference


def test_context_window_limits(runner, tokenizer):
    long_prompt = "The quick brown fox " * 200
    with pytest.raises(RequestError, match="context window"):
        run(runner, tokenizer, long_prompt, None)
    with pytest.raises(SequenceError, match="unknown"):
        runner.verify(VerifyRequest(12345, [], [1, 2], None))


def test_hidden_states_match_a_plain_forward(runner, tokenizer, target_dir):
    """Id i is the residual stream entering decoder layer i; -1 is the final normed state."""
    ids = tokenizer(PROMPT)["input_ids"]
    captured = {}
    hf_model = load_hf_model(str(target_dir))[0]
    model = hf_model.model
    hooks = [
        model.layers[0].register_forward_hook(lambda m, i, o: captured.setdefault("layer0", o)),
        model.norm.register_forward_hook(lambda m, i, o: captured.setdefault("norm", o)),
    ]
    try:
        with torch.inference_mode():
            hf_model(input_ids=torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    result = runner.verify(VerifyRequest(777, ids, [], None, hidden_layer_ids=(1, -1)))
    runner.release(777)
    layer0 = captured["layer0"][0] if isinstance(captured["layer0"], tuple) else captured["layer0"]
    assert result.hidden_states.shape == (len(ids), 2, runner.config.hidden_size)
    torch.testing.assert_close(result.hidden_states[:, 0], layer0[0])
    torch.testing.assert_close(result.hidden_states[:, 1], captured["norm"][0])


def test_idle_sequences_are_released(runner, tokenizer):
    runner.verify(VerifyRequest(4242, tokenizer("hi")["input_ids"], [], None))
    assert runner.release_idle(idle_s=3600) == []
    assert runner.release_idle(idle_s=0) == [4242]


def test_drafts_drawn_from_the_target_distribution_are_always_accepted(runner, tokenizer, tiny_model_dir):
    """With q = p every draft passes (u <= p/q = 1): the draft_probs path is wired through."""
    from backends.serving.request import SamplingParams

    ids = tokenizer(PROMPT)["input_ids"]
    drafts = list(hf_greedy(str(tiny_model_dir), PROMPT, 3))
    hf_model = load_hf_model(str(tiny_model_dir))[0]
    with torch.inference_mode():
        logits = hf_model(input_ids=torch.tensor([ids + drafts])).logits[0, len(ids) - 1 : -1]
    probs = logits.float().softmax(-1)
    sampling = SamplingParams(temperature=1.0, seed=3)
    result = runner.verify(VerifyRequest(99, ids, drafts, sampling, draft_probs=probs))
    runner.release(99)
    assert result.num_accepted == 3 and result.token_ids[:3] == drafts


@pytest.mark.parametrize("engine", ["lean", "hf"])
def test_a_full_kv_budget_makes_new_sequences_wait_not_running_ones(tiny_model_dir, engine):
    """A sequence holds the tokens it has written: a second one that does not fit now waits
    (its step answered `waiting`, nothing kept) while the first goes on, and runs once the
    first is released (the queue and preemption: test_kv_admission.py)."""
    from backends.serving.target_engine import kv_bytes_per_token

    probe = TargetRunner(tiny_model_dir, dtype="float32", runtime="hf")
    per_token = kv_bytes_per_token(probe.config, "float32")
    runner = TargetRunner(tiny_model_dir, dtype="float32", kv_cache_memory_gb=400 * per_token / 2**30, runtime=engine)
    assert (
        runner.kv_budget_tokens == 400 and runner.engine.name == {"lean": "lean runtime", "hf": "transformers"}[engine]
    )
    ids = [(i * 7) % 90 + 3 for i in range(300)]
    runner.verify(VerifyRequest(1, ids, [], max_new_tokens=100))
    assert 300 <= runner.reserved_tokens < 320  # what it wrote, not prompt + max_new_tokens
    others = [(i * 11) % 90 + 3 for i in range(300)]  # not sharing the first one's cached blocks
    waiting = runner.verify(VerifyRequest(2, others, [], max_new_tokens=100))
    assert waiting.waiting and not waiting.token_ids and runner.kv_stats().num_waiting == 1
    assert len(runner.verify(VerifyRequest(1, [], [1, 2])).token_ids) >= 1  # the running one goes on
    runner.release(1)
    assert runner.verify(VerifyRequest(2, others, [])).token_ids  # room again


@pytest.mark.parametrize("engine", ["lean", "hf"])
def test_the_target_weights_are_held_once(tiny_model_dir, monkeypatch, engine):
    """The lean runtime reads the checkpoint itself and keeps only its own fused, packed copy:
    the tensors it read are let go, and transformers' model is never built. Through
    transformers the model is the engine and stays."""
    import weakref

    import backends.serving.target_engine as target

    sources = {}

    def recorded(name, load):
        def record(*args, **kwargs):
            source = load(*args, **kwargs)
            sources[name] = weakref.ref(source.model.layers[0].mlp.up_proj.weight)
            return source

        return record

    for name in ("load_causal_lm", "read_checkpoint"):
        monkeypatch.setattr(target, name, recorded(name, getattr(target, name)))
    handed_back = []  # whether the tensors read were gone when their memory was handed back
    monkeypatch.setattr(
        target, "hand_back_freed_memory", lambda: handed_back.append(sources["read_checkpoint"]() is None)
    )
    runner = TargetRunner(tiny_model_dir, dtype="float32", runtime=engine)
    if engine == "lean":
        assert list(sources) == ["read_checkpoint"] and handed_back == [True]
        assert not hasattr(runner.engine, "model")
        assert runner.engine.lm.weight_bytes() >= sum(
            p.nbytes for p in load_causal_lm(tiny_model_dir, "float32").parameters()
        )
    else:
        assert list(sources) == ["load_causal_lm"] and not hasattr(runner.engine, "lm") and not handed_back
        assert runner.engine.model.model.layers[0].mlp.up_proj.weight is sources["load_causal_lm"]()


class FailingProposer(Proposer):
    """Drafts nothing useful and fails on its `fail_on`-th call."""

    def __init__(self, fail_on: int) -> None:
        self.calls, self.fail_on = 0, fail_on

    def propose(self, batch):
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("injected drafter fault")
        return [Draft([1] * r.num_draft_tokens) for r in batch]


def test_a_failing_drafter_falls_back_to_plain_decoding(runner, tokenizer, tiny_model_dir):
    """The target decides every token, so a drafter fault costs speed, never the request."""
    out, stats = run(runner, tokenizer, PROMPT, FailingProposer(fail_on=2))
    assert tuple(out) == hf_greedy(str(tiny_model_dir), PROMPT, 40)
    assert stats.fallback.startswith("drafter failed: injected drafter fault")
    assert stats.to_dict()["fallback"] == stats.fallback


def _info(k: int, schedule=None) -> DrafterInfo:
    spec = {"method": "ngram", "num_speculative_tokens": k}
    if schedule:
        spec["num_speculative_tokens_per_batch_size"] = schedule
    return DrafterInfo(SpeculativeConfig.from_json(spec), ())


def test_draft_length_is_decided_in_one_place():
    info = _info(4, [[1, 8, 4], [9, 1024, 1]])
    greedy = GenerationRequest(prompt="x")
    assert draft_length(greedy, info, load=1, room=10) == 4
    assert draft_length(greedy, info, load=16, room=10) == 1  # the batch-size schedule
    assert draft_length(greedy, info, load=1, room=2) == 2  # the room left
    assert draft_length(GenerationRequest(prompt="x", num_draft_tokens=2), info, 1, 10) == 2
    # A seeded sampled request's k ignores the load: its text must not depend on other requests.
    seeded = GenerationRequest(prompt="x", sampling=SamplingParams(temperature=0.8, seed=7))
    assert draft_length(seeded, info, load=16, room=10) == 4


def test_too_many_requested_drafts_are_refused_by_name(runner, tokenizer):
    with pytest.raises(RequestError, match=r"num_draft_tokens=5 must be in \[0, 4\]"):
        run(runner, tokenizer, PROMPT, FailingProposer(fail_on=0), num_draft_tokens=5)


def test_generate_local_is_the_served_loop_in_process(runner, tokenizer, tiny_model_dir):
    config = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    service = DraftService(build_proposer(config, max_model_len=512), config)
    ids, stats = generate_local(PROMPT, tokenizer, runner, service, eos_token_ids={0}, max_tokens=30)
    assert tuple(ids) == hf_greedy(str(tiny_model_dir), PROMPT, 30)
    assert stats.acceptance.num_draft_tokens > 0 and service.num_sequences == 0 and not runner.sequences


def test_synthetic_acceptance_reaches_the_verifier(runner, tokenizer):
    """rejection_sample_method "synthetic" (benchmarking): drafts are accepted at the configured
    rates even when the target disagrees: rates of 1 accept every (wrong) draft."""
    config = SpeculativeConfig.from_json(
        {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": [1.0, 1.0, 1.0],
        }
    )
    service = DraftService(FailingProposer(fail_on=0), config)
    ids, stats = generate_local(PROMPT, tokenizer, runner, service, eos_token_ids=set(), max_tokens=8)
    assert ids[:3] == [1, 1, 1] and ids[4:7] == [1, 1, 1]
    assert stats.acceptance.num_accepted_tokens == stats.acceptance.num_draft_tokens > 0


def test_a_drafter_asked_for_nothing_still_hears_from_its_sequence(runner, tokenizer, monkeypatch):
    """Under a load that keeps k at 0, the drafter still gets a k = 0 call now and then, so
    Triton's sequence batcher does not forget the sequence (it would fail the next draft)."""
    import backends.serving.orchestrator as orchestrator

    monkeypatch.setattr(orchestrator, "DRAFTER_KEEPALIVE_S", 0.0)
    config = SpeculativeConfig.from_json(
        {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 1024, 0]]}
    )
    proposer = FailingProposer(fail_on=-1)
    service = DraftService(proposer, config)
    seen: list[int] = []
    real_draft = service.draft
    monkeypatch.setattr(
        service, "draft", lambda calls: seen.extend(c.num_draft_tokens for c in calls) or real_draft(calls)
    )
    ids, stats = generate_local(PROMPT, tokenizer, runner, service, eos_token_ids=set(), max_tokens=5)
    assert len(ids) == 5 and stats.acceptance.num_draft_tokens == 0 and proposer.calls == 0
    assert seen and set(seen) == {0}


BF16_PROMPTS = [PROMPT, "x = [1, 2, 3]\ny = [1, 2, 3]\nz =", "the cat sat on the mat. the cat"]


@pytest.mark.parametrize("mode", ["on", "off"])
def test_bfloat16_speculative_output_is_plain_output(target_dir, tokenizer, mode):
    """In bf16 a batch-invariant target gives drafts verified k+1 at a time exactly the tokens of
    1-token steps, wherever the drafts are rejected (a wrong draft every few steps). Without it,
    the same runs are allowed to differ (near-tie argmaxes flip), so only their length is checked."""
    runner = TargetRunner(target_dir, dtype="bfloat16", batch_invariant=mode)
    assert runner.batch_invariant == (mode == "on")
    for prompt in BF16_PROMPTS:
        plain, _ = run(runner, tokenizer, prompt, None, max_tokens=48)
        prompt_len = len(tokenizer(prompt)["input_ids"])
        for corrupt_every, oracle in ((0, OracleProposer), (3, OracleProposer), (3, TreeOracleProposer)):
            tree = oracle is TreeOracleProposer
            proposer = oracle(plain, prompt_len, corrupt_every)
            spec, stats = run(runner, tokenizer, prompt, proposer, 48, k=8 if tree else 4, tree=tree)
            assert stats.acceptance.num_accepted_tokens > 0
            if mode == "on":
                assert spec == plain
            else:
                assert len(spec) == len(plain)
        if mode == "on":  # a prompt prefilled in chunks gives the same tokens as in one step
            chunked, _ = run(runner, tokenizer, prompt, OracleProposer(plain, prompt_len, 3), 48, prefill_chunk=3)
            assert chunked == plain


def test_batch_invariance_on_needs_the_lean_runtime(target_dir):
    with pytest.raises(ValueError, match="needs the lean runtime"):
        TargetRunner(target_dir, dtype="bfloat16", runtime="hf", batch_invariant="on")
    with pytest.raises(ValueError, match="batch_invariant must be one of"):
        TargetRunner(target_dir, batch_invariant="yes")


class RecordingVerifier(LocalVerifier):
    def __init__(self, runner) -> None:
        super().__init__(runner)
        self.requests: list[VerifyRequest] = []

    def verify(self, req: VerifyRequest):
        self.requests.append(req)
        return super().verify(req)


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_a_prompt_prefilled_in_chunks_gives_the_same_output(runner, tokenizer, tiny_model_dir, chunk):
    """Chunks of the prompt go to the verifier as steps of their own that emit nothing; the
    output, the steps that emit tokens and the acceptance are those of a one-step prefill."""
    config = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    results = []
    for prefill_chunk in (0, chunk):
        verifier = RecordingVerifier(runner)
        proposer = build_proposer(config, max_model_len=512)
        out, stats = run(runner, tokenizer, PROMPT, proposer, prefill_chunk=prefill_chunk, verifier=verifier)
        results.append((out, stats.num_steps, stats.acceptance.num_accepted_tokens))
        chunks = [r.new_token_ids for r in verifier.requests if r.prefill_only]
        if prefill_chunk:
            # every chunk but the last, each at most `chunk` long, the first with the sampling
            assert len(chunks) == (len(prompt_ids) - 1) // chunk and all(len(c) == chunk for c in chunks)
            first = verifier.requests[0]
            assert (
                first.prefill_only
                and first.sampling is not None
                and first.max_new_tokens == 40 + len(prompt_ids) - chunk
            )
            assert sum(chunks, []) + verifier.requests[len(chunks)].new_token_ids == prompt_ids
        else:
            assert not chunks
    assert results[0] == results[1]
    assert results[0][0] == list(hf_greedy(str(tiny_model_dir), PROMPT, 40))


def test_penalties_count_a_chunked_prompt_as_prompt(runner, tokenizer):
    """presence/frequency penalties count output tokens only: a prompt that came in chunks is
    all prompt (and the penalties do change this output, so the check can fail)."""
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3}
    plain, _ = run(runner, tokenizer, PROMPT, None, max_tokens=24)
    whole, _ = run(runner, tokenizer, PROMPT, None, max_tokens=24, **penalties)
    chunked, _ = run(runner, tokenizer, PROMPT, None, max_tokens=24, prefill_chunk=2, **penalties)
    assert whole != plain
    assert chunked == whole


def test_a_prefill_chunk_emits_nothing_and_holds_only_what_it_wrote(runner, tokenizer, tiny_model_dir):
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    first = runner.verify(VerifyRequest(11, prompt_ids[:4], [], SamplingParams(), max_new_tokens=40, prefill_only=True))
    try:
        assert first.token_ids == [] and first.num_accepted == 0
        assert runner.cached_tokens(11) == 4
        with pytest.raises(SequenceError, match="a prefill chunk carries prompt tokens and no drafts"):
            runner.verify(VerifyRequest(11, prompt_ids[4:6], [5, 6], prefill_only=True))
    finally:
        runner.release(11)
    # the KV blocks of the chunk alone: the rest are taken as later steps write them
    pooled = TargetRunner(tiny_model_dir, dtype="float32", runtime="lean")
    pooled.verify(VerifyRequest(12, prompt_ids[:4], [], SamplingParams(), max_new_tokens=40, prefill_only=True))
    assert pooled.engine.pool.reserved(12) == 16
    last = pooled.verify(VerifyRequest(12, prompt_ids[4:], []))
    assert last.token_ids == list(hf_greedy(str(tiny_model_dir), PROMPT, 1))
    pooled.release(12)
