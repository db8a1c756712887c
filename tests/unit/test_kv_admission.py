"""Admission that queues and preemption by recompute (backends/serving/kv_scheduler.py), blocks
taken as tokens are written (runtime/kv_cache.py), and prefix-cache isolation: a request's
cache_salt and the deployment's namespace go into the first block's key.

The pool's bookkeeping is checked on its own; the verifier's output under preemption is checked
against a verifier whose pool never runs short, token for token (greedy, with drafts rejected
and rolled back), and the prefix cache's sharing by its hit counters (no timing).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from backends.runtime.kv_cache import KVCacheFullError, KVCachePool
from backends.runtime.model_store import load_config
from backends.serving.detokenize import TextStream
from backends.serving.local import LocalVerifier, generate_local
from backends.serving.orchestrator import AdmissionTimeoutError, Generation, ServingContext, generate
from backends.serving.request import GenerationRequest, RequestError, SamplingParams, parse_request
from backends.serving.target import TargetRunner, VerifyRequest, VerifyResult
from backends.serving.target_engine import kv_bytes_per_token

BS = 4


def pool(blocks: int = 8, namespace: str = "") -> KVCachePool:
    return KVCachePool(
        1,
        1,
        4,
        capacity_tokens=blocks * BS,
        block_size=BS,
        dtype=torch.float32,
        prefix_caching=True,
        namespace=namespace,
    )


def computed(p: KVCachePool, seq_id: str, token_ids: list[int], salt: str = "") -> None:
    """Admit a sequence with nothing reserved, grow it for its tokens, 'compute' them and make
    them final, as the verifier does."""
    p.admit(seq_id, cache_salt=salt)
    p.grow(seq_id, len(token_ids))
    p.extend(seq_id, len(token_ids))
    p.commit(seq_id, token_ids)


# -- the pool --------------------------------------------------------------------------------


def test_blocks_are_taken_as_tokens_are_written_and_follow_on_when_free():
    p = pool(blocks=8)
    p.admit("a")
    assert p.reserved_tokens == 0 and p.reserved("a") == 0
    p.grow("a", 5)
    p.extend("a", 5)
    p.grow("a", 9)  # alone: its next block follows its last, the keys stay one view
    assert p.blocks("a") == [0, 1, 2] and p.contiguous_start("a") == 0
    p.admit("b", 4)  # block 3, right after a's
    p.grow("a", 13)
    assert p.blocks("a") == [0, 1, 2, 4] and p.contiguous_start("a") is None
    assert p.usage == 5 / 8
    with pytest.raises(KVCacheFullError, match="KV cache budget full"):
        p.grow("b", 5 * BS)  # 4 more blocks, 3 free


def test_admissible_counts_a_prefix_another_sequence_holds():
    p = pool(blocks=8)
    prompt = list(range(24))  # six blocks
    computed(p, "a", prompt)  # a runs on, holding them
    assert p.admissible(25, prompt)  # six shared + one of the two free
    assert not p.admissible(25, [99] + prompt[1:])  # nothing shared: seven blocks, two free
    assert not p.admissible(25, prompt, cache_salt="other tenant")


def test_a_salt_or_a_namespace_keys_the_same_tokens_apart():
    prompt = list(range(10))
    p = pool(blocks=16)
    computed(p, "plain", prompt)
    computed(p, "t1", prompt, salt="t1")
    for seq_id, salt, attached in (("t1 again", "t1", 8), ("t2", "t2", 0), ("none", "", 8)):
        p.admit(seq_id, cache_salt=salt)
        assert p.share_prefix(seq_id, prompt) == attached, seq_id
    assert p.prefix_hits == 16
    keys = {}
    for namespace in ("", "n1", "n2", "n1"):
        q = pool(16, namespace)
        computed(q, "a", prompt)
        assert keys.setdefault(namespace, set(q._key_block)) == set(q._key_block)  # the same namespace: the same keys
    assert keys["n1"].isdisjoint(keys["n2"]) and keys["n1"].isdisjoint(keys[""])


# -- the verifier ----------------------------------------------------------------------------


def small_runner(model_dir, blocks: int, **options) -> TargetRunner:
    """The tiny model on the lean runtime (batch-invariant) with a pool of `blocks` blocks of 16."""
    per_token = kv_bytes_per_token(load_config(model_dir), "bfloat16")
    runner = TargetRunner(
        model_dir,
        dtype="bfloat16",
        runtime="lean",
        kv_cache_memory_gb=(blocks * 16 + 0.5) * per_token / 2**30,
        **options,
    )
    assert runner.kv_budget_tokens == blocks * 16 and runner.batch_invariant
    return runner


@pytest.fixture(scope="module")
def roomy(tiny_model_dir):
    return TargetRunner(tiny_model_dir, dtype="bfloat16", runtime="lean")


def prompt(seed: int, n: int) -> list[int]:
    return [(i * 37 + seed * 11) % 90 + 3 for i in range(n)]


def test_a_sequence_that_does_not_fit_waits_and_none_overtakes_it(tiny_model_dir):
    runner = small_runner(tiny_model_dir, blocks=8)
    first = runner.verify(VerifyRequest(1, prompt(1, 100), []))  # 7 of the 8 blocks
    assert first.token_ids and not first.waiting
    waiting = runner.verify(VerifyRequest(2, prompt(2, 40), [], SamplingParams()))
    assert waiting.waiting and waiting.token_ids == []
    assert runner.sequences[2].token_ids == []  # its tokens come again with the step
    small = runner.verify(VerifyRequest(3, prompt(3, 5), []))  # would fit, but 2 came first
    assert small.waiting
    assert runner.kv_stats().num_waiting == 2 and runner.kv_stats().num_running == 1
    assert runner.kv_stats().kv_usage == 7 / 8
    assert runner.verify(VerifyRequest(1, [], [5, 6])).token_ids  # the running one goes on
    runner.release(1)
    assert runner.verify(VerifyRequest(3, prompt(3, 5), [])).waiting  # 2 heads the queue
    assert runner.verify(VerifyRequest(2, prompt(2, 40), [])).token_ids
    assert runner.verify(VerifyRequest(3, prompt(3, 5), [])).token_ids
    assert runner.kv_stats().num_waiting == 0 and runner.kv_stats().num_preemptions == 0


def test_a_step_that_can_never_fit_fails_with_the_reason(tiny_model_dir):
    runner = small_runner(tiny_model_dir, blocks=8)
    with pytest.raises(KVCacheFullError, match="more than the whole pool"):
        runner.verify(VerifyRequest(1, prompt(1, 140), []))
    assert not runner.sequences and runner.kv_stats().num_waiting == 0


def decode(runner: TargetRunner, prompts: dict[int, list[int]], steps: int, reference=None) -> dict[int, list[int]]:
    """The sequences' greedy outputs, stepped in turn as their requests' threads would: a step
    answered `waiting` comes again on the next turn. With `reference` outputs, each step drafts
    the next three reference tokens, the second wrong every other step (rejections roll back)."""
    out = {seq_id: [] for seq_id in prompts}
    new = dict(prompts)
    count = {seq_id: 0 for seq_id in prompts}
    while any(c < steps for c in count.values()):
        for seq_id in prompts:
            if count[seq_id] >= steps:
                continue
            drafts = []
            if reference is not None:
                drafts = list(reference[seq_id][len(out[seq_id]) : len(out[seq_id]) + 3])
                if count[seq_id] % 2 and len(drafts) > 1:
                    drafts[1] = (drafts[1] + 1) % 90
            result = runner.verify(VerifyRequest(seq_id, new[seq_id], drafts))
            if result.waiting:
                continue
            out[seq_id] += result.token_ids
            new[seq_id], count[seq_id] = [], count[seq_id] + 1
            if count[seq_id] == steps:
                runner.release(seq_id)
    return out


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preempted_sequences_resume_by_recompute_with_the_same_output(tiny_model_dir, roomy, prefix_caching):
    """Three sequences of 40 prompt tokens growing by up to 4 tokens a step need 15 blocks or
    more together; the pool has 9: the newest are preempted and resumed, and every token is
    the one the roomy verifier gives (plain greedy steps), drafts rolled back on the way."""
    prompts = {seq_id: prompt(seq_id, 40) for seq_id in (11, 12, 13)}
    reference = decode(roomy, prompts, steps=60)
    assert roomy.kv_stats().num_preemptions == 0
    runner = small_runner(tiny_model_dir, blocks=9, prefix_caching=prefix_caching)
    speculative = decode(runner, prompts, steps=12, reference=reference)
    stats = runner.kv_stats()
    assert stats.num_preemptions > 0 and stats.num_running == stats.num_waiting == 0
    for seq_id, ids in speculative.items():
        assert ids == reference[seq_id][: len(ids)] and len(ids) > 12, seq_id
    assert runner.reserved_tokens == 0


def test_a_resumed_sequence_returns_hidden_states_of_its_new_positions_only(tiny_model_dir, roomy):
    """A drafter that reads the target's hidden states has had those of the positions computed
    before a preemption: the recomputing step returns the rows it would have returned anyway."""
    runner = small_runner(tiny_model_dir, blocks=8)
    layers = (1, -1)
    steps = [VerifyRequest(30, prompt(30, 60), []), VerifyRequest(31, prompt(31, 60), [], hidden_layer_ids=layers)]
    steps += [VerifyRequest(30, [], [5, 6, 7, 8, 9])]  # 30 grows past the pool: 31, the newest, is preempted
    for req in steps:
        assert not runner.verify(req).waiting
    assert runner.kv_stats().num_preemptions == 1 and runner.kv_stats().num_waiting == 1
    runner.release(30)
    roomy.verify(VerifyRequest(31, prompt(31, 60), [], hidden_layer_ids=layers))
    resumed = runner.verify(VerifyRequest(31, [], [8, 9], hidden_layer_ids=layers))
    expected = roomy.verify(VerifyRequest(31, [], [8, 9], hidden_layer_ids=layers))
    roomy.release(31)
    assert resumed.token_ids == expected.token_ids
    assert resumed.hidden_states.shape[0] == 1 + resumed.num_accepted  # the last token and the accepted drafts
    assert torch.equal(resumed.hidden_states, expected.hidden_states)


def test_a_nearly_full_pool_finds_a_prompt_s_cached_blocks_before_evicting(tiny_model_dir):
    """Finding 7: a prompt's own cached blocks must be looked up before blocks are taken for
    it (taking first evicted them: 0 hits instead of all of them)."""
    runner = small_runner(tiny_model_dir, blocks=9)
    p = prompt(5, 96)  # six blocks
    runner.verify(VerifyRequest(1, p, []))
    runner.release(1)  # six cached blocks, nobody holds them
    runner.verify(VerifyRequest(2, prompt(6, 30), []))  # two blocks: one left free
    hits = runner.engine.prefix_hits
    again = runner.verify(VerifyRequest(3, p, []))
    assert not again.waiting
    assert runner.engine.prefix_hits - hits == 80  # all but the block of the last token, recomputed
    assert runner.kv_stats().num_preemptions == 0


def test_cache_salt_shares_only_within_the_same_salt(roomy):
    """Finding 6, timing-free: the same prompt under another salt finds nothing cached."""
    p = prompt(7, 40)

    def hits(seq_id: int, salt: str) -> int:
        before = roomy.engine.prefix_hits
        roomy.verify(VerifyRequest(seq_id, p, [], SamplingParams(cache_salt=salt)))
        roomy.release(seq_id)
        return roomy.engine.prefix_hits - before

    assert hits(21, "tenant a") == 0
    assert hits(22, "tenant b") == 0
    assert hits(23, "") == 0
    assert hits(24, "tenant a") == 32
    assert hits(25, "") == 32


def test_cache_salt_is_read_from_sampling_parameters():
    req = parse_request({"text_input": "hi"}, sampling_json='{"cache_salt": "tenant-7"}')
    assert req.sampling.cache_salt == "tenant-7"
    assert SamplingParams.from_json(req.sampling.to_json()).cache_salt == "tenant-7"
    for bad in ('{"cache_salt": ""}', '{"cache_salt": 5}'):
        with pytest.raises(RequestError, match="cache_salt must be a non-empty string"):
            parse_request({"text_input": "hi"}, sampling_json=bad)


# -- the loop: waiting, then running or timing out -------------------------------------------


def test_a_waiting_request_runs_once_there_is_room(tiny_model_dir, tokenizer, roomy):
    runner = small_runner(tiny_model_dir, blocks=8)
    runner.verify(VerifyRequest(1, prompt(1, 100), []))  # 7 of the 8 blocks
    text = "The quick brown fox jumps over the lazy dog and " * 2
    with ThreadPoolExecutor(1) as pool_:
        waiting = pool_.submit(generate_local, text, tokenizer, runner, max_tokens=12)
        time.sleep(0.3)
        assert not waiting.done() and runner.kv_stats().num_waiting == 1
        runner.release(1)
        ids, _ = waiting.result(timeout=60)
    assert ids == generate_local(text, tokenizer, roomy, max_tokens=12)[0]


def test_a_request_that_waits_past_the_queue_timeout_fails_retryably(tiny_model_dir, tokenizer):
    from client.api.openai_frontend import generation_error

    runner = small_runner(tiny_model_dir, blocks=8)
    runner.verify(VerifyRequest(1, prompt(1, 100), []))  # 7 of the 8 blocks, never released
    ids = prompt(2, 40)
    ctx = ServingContext({tokenizer.eos_token_id}, runner.max_model_len, adaptive=False, max_queue_time_s=0.3)
    gen = Generation(
        GenerationRequest("x", max_tokens=4), ids, 2, LocalVerifier(runner), None, TextStream(tokenizer), ctx
    )
    start = time.monotonic()
    with pytest.raises(AdmissionTimeoutError, match="KV cache budget full") as err:
        list(generate(gen))
    assert 0.3 <= time.monotonic() - start < 10
    answer = generation_error(RuntimeError(f"generation failed: {err.value}"))  # as the model words it
    assert answer.status == 503 and answer.response().headers["retry-after"]


def test_a_waiting_row_crosses_the_wire_and_its_release_still_goes():
    """Over BLS a waiting step is the `waiting` output; the step batcher stops holding batches
    for a waiting sequence, yet still tells the verifier when it ends."""
    from backends.triton_models.step_batch import Release, StepBatcher, decode_results, encode_results

    results = [VerifyResult([5], 0, 0.01), VerifyResult([], 0, 0.0, waiting=True)]
    decoded = decode_results(encode_results(results), 2)
    assert [r.waiting for r in decoded] == [False, True] and decoded[0].token_ids == [5]
    assert "waiting" not in encode_results(results[:1])
    sent = []

    def run_rows(rows):
        sent.extend(rows)
        return [None if isinstance(row, Release) else VerifyResult([], 0, 0.0, waiting=True) for row in rows]

    batcher = StepBatcher(run_rows)
    assert batcher.verify(VerifyRequest(1, [1, 2], [])).waiting
    assert 1 not in batcher.running  # the next batches do not wait for its step
    batcher.release(1)
    assert sent[-1] == Release(1)


def test_the_openai_body_s_cache_salt_goes_into_sampling_parameters():
    from client.api.openai_http import OpenAIError
    from client.api.openai_params import sampling_inputs

    inputs = sampling_inputs({"cache_salt": "tenant-7"}, 16, "chat")
    assert inputs["sampling_parameters"] == {"cache_salt": "tenant-7"}
    assert "sampling_parameters" not in sampling_inputs({}, 16, "chat")
    for bad in ("", 5):
        with pytest.raises(OpenAIError, match="cache_salt") as err:
            sampling_inputs({"cache_salt": bad}, 16, "completion")
        assert err.value.status == 400


def test_serve_max_queue_time_s_sets_the_orchestrator_parameter(tiny_model_dir):
    from client.cli.main import build_parser
    from client.cli.serve_command import _serve_overrides

    args = build_parser().parse_args(["serve", "--model", str(tiny_model_dir), "--max-queue-time-s", "7.5"])
    assert _serve_overrides(args, tiny_model_dir).per_model["speculative"]["max_queue_time_s"] == "7.5"
    args = build_parser().parse_args(["serve", "--model", str(tiny_model_dir), "--max-queue-time-s", "0"])
    with pytest.raises(ValueError, match="--max-queue-time-s: max_queue_time_s must be a number of seconds > 0"):
        _serve_overrides(args, tiny_model_dir)


def test_a_waiting_head_that_stops_asking_does_not_hold_the_queue(tiny_model_dir):
    runner = small_runner(tiny_model_dir, blocks=8)
    now = [100.0]
    runner.clock = lambda: now[0]
    assert runner.verify(VerifyRequest(1, prompt(1, 100), [])).token_ids  # 7 of the 8 blocks
    assert runner.verify(VerifyRequest(2, prompt(2, 40), [])).waiting  # 2 heads the queue
    now[0] += 0.5  # 2 asked half a second ago: still holds its place
    assert runner.verify(VerifyRequest(3, prompt(3, 5), [])).waiting
    now[0] += 1.0  # 2 has not asked for 1.5 s (its client vanished); 3 asked 1 s ago
    assert runner.verify(VerifyRequest(3, prompt(3, 5), [])).token_ids  # admitted past it
    assert list(runner.scheduler.waiting) == [2]  # 2 keeps its place for when it comes back
