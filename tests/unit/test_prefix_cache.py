"""Prefix caching: sequences whose tokens start alike share the KV blocks of that prefix.

The pool's bookkeeping (references, eviction, admission) is checked on its own; the verifier's
output with shared blocks is checked against a verifier that computes everything, bit for bit
(the batch-invariant runtime gives a token the same K/V whichever step computed it).
"""

from __future__ import annotations

import pytest
import torch

from backends.runtime.kv_cache import KVCacheFullError, KVCachePool, SequenceError
from backends.serving.request import SamplingParams
from backends.serving.target import TargetRunner, VerifyRequest

BS = 4


def pool(blocks: int = 16, caching: bool = True) -> KVCachePool:
    return KVCachePool(1, 1, 4, capacity_tokens=blocks * BS, block_size=BS, dtype=torch.float32, prefix_caching=caching)


def computed(p: KVCachePool, seq_id: str, token_ids: list[int], reserve: int = 16) -> None:
    """Admit a sequence, 'compute' its tokens and make them final, as the verifier does."""
    p.admit(seq_id, reserve)
    p.extend(seq_id, len(token_ids))
    p.commit(seq_id, token_ids)


PROMPT = list(range(100, 110))  # two whole blocks and two tokens


def test_a_sequence_shares_the_registered_blocks_of_its_prefix():
    p = pool()
    computed(p, "a", PROMPT, reserve=12)
    p.admit("b", 12)
    assert p.reserved_tokens == 24
    assert p.share_prefix("b", PROMPT + [7, 8]) == 8  # whole blocks only: the third differs
    assert p.length("b") == 8 and p.blocks("b")[:2] == p.blocks("a")[:2]
    assert p.reserved_tokens == 16  # b's own first two blocks went back: the prefix is held once
    assert p.prefix_queries == 12 and p.prefix_hits == 8
    torch.testing.assert_close(p.slots("b")[:8], p.slots("a")[:8])
    assert p.blocks("b")[2] not in p.blocks("a")


def test_shared_blocks_outlive_their_first_owner_and_stay_cached_after_the_last():
    p = pool()
    computed(p, "a", PROMPT, reserve=12)
    p.admit("b", 12)
    p.share_prefix("b", PROMPT)
    p.release("a")  # b still holds the two shared blocks; a's third block is free
    assert p.reserved_tokens == 12 and p.prefix_cached_tokens == 0
    shared = p.blocks("b")[:2]
    p.release("b")
    assert p.reserved_tokens == 0 and p.free_tokens == p.capacity_tokens  # cached blocks count as free
    assert p.prefix_cached_tokens == 8
    p.admit("c", 12)
    assert p.share_prefix("c", PROMPT) == 8 and p.blocks("c")[:2] == shared
    assert p.prefix_cached_tokens == 0


def test_admission_evicts_cached_prefixes_least_recently_released_first():
    p = pool(blocks=8)
    computed(p, "old", [1] * 4, reserve=4)
    computed(p, "new", [2] * 4, reserve=4)
    p.release("old")
    p.release("new")
    p.admit("big", 7 * BS)  # 6 free blocks + one evicted: the one released first
    with pytest.raises(KVCacheFullError):
        p.admit("z", 2 * BS)
    p.release("big")
    for seq_id, token_ids, attached in (("x", [1] * 4 + [0], 0), ("y", [2] * 4 + [0], 4)):
        p.admit(seq_id, 8)
        assert p.share_prefix(seq_id, token_ids) == attached, seq_id


def test_a_prefix_matches_only_after_the_same_tokens():
    p = pool(blocks=32)
    computed(p, "a", PROMPT)
    for seq_id, token_ids, attached in (
        ("other first block", [0] + PROMPT[1:], 0),
        ("other second block", PROMPT[:5] + [0] + PROMPT[6:], 4),
        ("shorter", PROMPT[:7], 4),
    ):
        p.admit(seq_id, 16)
        assert p.share_prefix(seq_id, token_ids) == attached, seq_id
    p.admit("mid-block", 16)
    p.extend("mid-block", 2)
    assert p.share_prefix("mid-block", PROMPT) == 0  # not at a block boundary


def test_without_prefix_caching_nothing_is_registered_or_shared():
    p = pool(caching=False)
    computed(p, "a", PROMPT)
    p.admit("b", 16)
    assert p.share_prefix("b", PROMPT) == 0
    p.release("a")
    assert p.prefix_cached_tokens == 0


def test_final_tokens_cannot_be_rolled_back():
    """A registered block may be shared: the sequence must never write it again."""
    p = pool()
    computed(p, "a", PROMPT)
    p.truncate("a", 8)
    with pytest.raises(SequenceError, match="final"):
        p.truncate("a", 7)


def test_the_same_blocks_computed_twice_stay_private_to_the_second():
    p = pool()
    computed(p, "a", PROMPT)
    computed(p, "b", PROMPT)  # computed before a's were registered, e.g. in the same step
    p.release("b")
    assert p.prefix_cached_tokens == 0 and p.reserved_tokens == 16


# -- the verifier --------------------------------------------------------------------------


def run(runner: TargetRunner, seq_id: int, prompt: list[int], chunk: int, steps: int) -> tuple[list, list]:
    """A request as the orchestrator sends it: the prompt in prefill chunks, then greedy steps
    with drafts (the previous output, some of it wrong); its emitted ids and their logprobs."""
    chunks = [prompt[i : i + chunk] for i in range(0, len(prompt), chunk)]
    sampling = SamplingParams(logprobs=2)
    for i, part in enumerate(chunks[:-1]):
        runner.verify(VerifyRequest(seq_id, part, [], sampling if i == 0 else None, prefill_only=True))
    ids, logprobs = [], []
    pending = chunks[-1]
    for step in range(steps):
        drafts = [(t * 7 + step) % 90 for t in ids[-3:]]
        result = runner.verify(
            VerifyRequest(seq_id, pending, drafts, sampling if step == 0 and len(chunks) == 1 else None)
        )
        ids += result.token_ids
        logprobs += [(p.logprob, p.top) for p in result.logprobs]
        pending = []
    runner.release(seq_id)
    return ids, logprobs


@pytest.fixture(scope="module")
def runners(tiny_model_dir):
    return {
        caching: TargetRunner(tiny_model_dir, dtype="bfloat16", runtime="lean", prefix_caching=caching)
        for caching in (True, False)
    }


def test_a_next_turn_reuses_the_previous_turn_exactly(runners):
    """Turn 2 is turn 1's prompt and answer and a new question: its prefill finds turn 1's
    blocks (whole prefill chunks among them), and its output and logprobs are bit-identical to
    computing everything."""
    cached, fresh = runners[True], runners[False]
    assert cached.batch_invariant
    turn1 = [(i * 37) % 90 + 3 for i in range(45)]
    out1 = run(cached, 1, turn1, chunk=16, steps=6)
    assert out1 == run(fresh, 1, turn1, chunk=16, steps=6)
    turn2 = turn1 + out1[0] + [5, 6, 7, 8, 9]
    hits = cached.engine.prefix_hits
    out2 = run(cached, 2, turn2, chunk=16, steps=6)
    reused = cached.engine.prefix_hits - hits
    final = len(turn1) + len(out1[0]) - 1  # the last answer token was emitted, never computed
    assert reused == final // 16 * 16 and reused >= 32
    assert out2 == run(fresh, 2, turn2, chunk=16, steps=6)
    assert fresh.engine.prefix_hits == 0


def test_a_whole_cached_prompt_still_computes_its_last_token(runners):
    cached, fresh = runners[True], runners[False]
    prompt = [(i * 11) % 80 + 2 for i in range(32)]
    first = run(cached, 3, prompt, chunk=32, steps=3)
    hits = cached.engine.prefix_hits
    again = run(cached, 4, prompt, chunk=32, steps=3)
    assert cached.engine.prefix_hits - hits == 16  # the second block holds the last prompt token
    assert first == again == run(fresh, 3, prompt, chunk=32, steps=3)


def test_steps_that_need_hidden_states_compute_every_position(runners):
    cached = runners[True]
    prompt = [(i * 13) % 70 + 4 for i in range(40)]
    run(cached, 5, prompt, chunk=40, steps=1)
    hits = cached.engine.prefix_hits
    result = cached.verify(VerifyRequest(6, prompt, [], hidden_layer_ids=(1,)))
    assert cached.engine.prefix_hits == hits
    assert result.hidden_states.shape[0] == len(prompt)
    cached.release(6)
