"""The draft -> verify loop in process (no Triton): exactness of accept/rollback."""
from __future__ import annotations

import random

import pytest
import torch

from backends.config import SpeculativeConfig
from backends.serving.detokenize import TextStream
from backends.serving.drafting import DraftCall, DraftService
from backends.serving.orchestrator import GenerationStats, generate
from backends.serving.proposer import Draft, Proposer, build_proposer
from backends.serving.request import GenerationRequest, RequestError
from backends.serving.target import SequenceError, TargetRunner, VerifyRequest
from tests.helpers import hf_greedy


class LocalVerifier:
    def __init__(self, runner: TargetRunner) -> None:
        self.runner = runner

    def verify(self, seq_id, new_token_ids, draft_token_ids, draft_probs, sampling, max_new_tokens=None,
               hidden_layer_ids=()):
        r = self.runner.verify(VerifyRequest(seq_id, new_token_ids, draft_token_ids, sampling, hidden_layer_ids,
                                             draft_probs=draft_probs, max_new_tokens=max_new_tokens))
        return r.token_ids, r.forward_s, r.hidden_states

    def release(self, seq_id):
        self.runner.release(seq_id)


class LocalDrafter:
    def __init__(self, service: DraftService) -> None:
        self.service = service
        self.num_speculative_tokens = service.config.num_speculative_tokens
        self.hidden_layer_ids = service.proposer.hidden_layer_ids

    def draft(self, seq_id, new_token_ids, max_tokens, requested, hidden_states=None, temperature=1.0):
        draft = self.service.draft([DraftCall(seq_id, new_token_ids, max_tokens, requested, hidden_states,
                                              temperature)])[0]
        return draft.token_ids, draft.probs, 0.0

    def release(self, seq_id):
        self.service.release(seq_id)


class OracleProposer(Proposer):
    """Proposes the target's own greedy continuation, optionally corrupting one position."""

    def __init__(self, reference: list[int], prompt_len: int, corrupt_every: int = 0) -> None:
        self.reference, self.prompt_len, self.corrupt_every = reference, prompt_len, corrupt_every

    def propose(self, batch):
        out = []
        for r in batch:
            done = len(r.token_ids) - self.prompt_len
            drafts = list(self.reference[done:done + r.num_tokens])
            if self.corrupt_every and drafts and done % self.corrupt_every == 0:
                drafts[len(drafts) // 2] = (drafts[len(drafts) // 2] + 1) % 50
            out.append(Draft(drafts))
        return out


def run(runner, tokenizer, prompt, proposer, max_tokens=40, k=4, num_draft_tokens=None):
    config = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": k})
    drafter = LocalDrafter(DraftService(proposer, config)) if proposer else None
    req = GenerationRequest(prompt=prompt, max_tokens=max_tokens, num_draft_tokens=num_draft_tokens)
    stats = GenerationStats()
    ids = tokenizer(prompt)["input_ids"]
    seq_id = random.getrandbits(32)
    out = []
    # A fixed k: the adaptive policy follows step timings, which a loaded machine skews.
    for step in generate(req, ids, seq_id, LocalVerifier(runner), drafter, TextStream(tokenizer), {0},
                         runner.max_model_len, stats, adaptive=False):
        out += step.token_ids
    runner.release(seq_id)
    return out, stats


PROMPT = "def add(a, b):\n    return a + b\ndef add(a, b):"


def test_plain_loop_equals_hf(runner, tokenizer, tiny_model_dir):
    out, stats = run(runner, tokenizer, PROMPT, None)
    assert tuple(out) == hf_greedy(str(tiny_model_dir), PROMPT, 40)
    assert stats.acceptance.num_draft_tokens == 0


def test_ngram_loop_equals_hf(runner, tokenizer, tiny_model_dir):
    config = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 4,
                                          "prompt_lookup_min": 1, "prompt_lookup_max": 3})
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


def test_wrong_drafts_roll_back_exactly(runner, tokenizer, tiny_model_dir):
    reference = list(hf_greedy(str(tiny_model_dir), PROMPT, 40))
    prompt_len = len(tokenizer(PROMPT)["input_ids"])
    out, stats = run(runner, tokenizer, PROMPT, OracleProposer(reference, prompt_len, corrupt_every=1), k=5)
    assert out == reference
    assert 0 < stats.acceptance.acceptance_rate < 1
    assert not runner.sequences  # released


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


def test_hidden_states_match_a_plain_forward(runner, tokenizer):
    """Id i is the residual stream entering decoder layer i; -1 is the final normed state."""
    ids = tokenizer(PROMPT)["input_ids"]
    captured = {}
    model = runner.model.model
    hooks = [model.layers[0].register_forward_hook(lambda m, i, o: captured.setdefault("layer0", o)),
             model.norm.register_forward_hook(lambda m, i, o: captured.setdefault("norm", o))]
    try:
        with torch.inference_mode():
            runner.model(input_ids=torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    result = runner.verify(VerifyRequest(777, ids, [], None, hidden_layer_ids=(1, -1)))
    runner.release(777)
    layer0 = captured["layer0"][0] if isinstance(captured["layer0"], tuple) else captured["layer0"]
    assert result.hidden_states.shape == (len(ids), 2, runner.model.config.hidden_size)
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
    with torch.inference_mode():
        logits = runner.model(input_ids=torch.tensor([ids + drafts])).logits[0, len(ids) - 1:-1]
    probs = logits.float().softmax(-1)
    sampling = SamplingParams(temperature=1.0, seed=3)
    result = runner.verify(VerifyRequest(99, ids, drafts, sampling, draft_probs=probs))
    runner.release(99)
    assert result.num_accepted == 3 and result.token_ids[:3] == drafts


def test_kv_budget_refuses_new_sequences_not_running_ones(tiny_model_dir, tokenizer):
    from backends.serving.target import KVCacheFullError, kv_bytes_per_token

    probe = TargetRunner(tiny_model_dir, dtype="float32")
    per_token = kv_bytes_per_token(probe.model.config, "float32")
    runner = TargetRunner(tiny_model_dir, dtype="float32", kv_cache_memory_gb=400 * per_token / 2**30)
    assert runner.kv_budget_tokens == 400
    ids = tokenizer(PROMPT)["input_ids"]
    runner.verify(VerifyRequest(1, ids, [], max_new_tokens=100))  # reserves prompt + 100 + 128
    with pytest.raises(KVCacheFullError, match="KV cache budget full"):
        runner.verify(VerifyRequest(2, ids, [], max_new_tokens=100))
    assert len(runner.verify(VerifyRequest(1, [], [1, 2])).token_ids) >= 1  # the running one goes on
    runner.release(1)
    runner.verify(VerifyRequest(2, ids, [], max_new_tokens=100))  # room again
