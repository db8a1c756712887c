"""Many sequences' verify steps in one verifier request (backends/triton_models/step_batch.py):
the wire format round-trips, and the orchestrator's StepBatcher gathers concurrent sequences'
steps into shared forwards whose results equal verifying each sequence alone."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from backends.config import SpeculativeConfig
from backends.serving.drafting import DraftCall, DraftService
from backends.serving.proposer import Draft, Proposer
from backends.serving.request import SamplingParams
from backends.serving.target import TargetRunner, VerifyRequest, VerifyResult
from backends.structured.mask import allowed_tokens, mask_words
from backends.triton_models.pbtxt import single_instance
from backends.triton_models.step_batch import (
    ROWS,
    GatheredDrafter,
    Release,
    StepBatcher,
    decode_results,
    decode_rows,
    encode_results,
    encode_rows,
    in_process,
    over_bls,
)

VERIFIER_CONFIG = (Path(__file__).parents[2] / "model_repository" / "verifier" / "config.pbtxt").read_text()


def _wire(rows: list) -> list:
    inputs, params = encode_rows(rows)
    return decode_rows(params[ROWS], inputs)


def _mask(rows: int, words: int = 2) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31, (rows, words), dtype=torch.int32)


def test_every_kind_of_row_survives_the_wire():
    """Constrained rows (a token mask) beside unconstrained ones: each gets its own mask rows
    back, a mask of the wrong row count too (the target runner refuses that step alone)."""
    probs = torch.softmax(torch.randn(3, 11), -1)
    rows = [
        VerifyRequest(7, [1, 2, 3], [], SamplingParams(temperature=0.7, seed=5), max_new_tokens=9, prefill_only=True),
        VerifyRequest(2**62 + 3, [4], [5, 6, 7], None, (1, 2), probs, token_mask=_mask(4)),
        Release(11),
        VerifyRequest(8, [], [9, 10, 11], None, draft_probs=probs * 0.5, draft_parents=[-1, 0, 0]),
        VerifyRequest(9, [12, 13], [14, 15], None, draft_parents=[-1, 0], token_mask=_mask(3)),
        VerifyRequest(10, [16], [], None),
        VerifyRequest(12, [], [17], None, token_mask=_mask(5)),
    ]
    decoded = _wire(rows)
    assert len(decoded) == len(rows)
    for sent, got in zip(rows, decoded):
        assert type(got) is type(sent)
        if isinstance(sent, Release):
            assert got.seq_id == sent.seq_id
            continue
        for field in ("seq_id", "new_token_ids", "draft_token_ids", "hidden_layer_ids", "max_new_tokens"):
            assert getattr(got, field) == getattr(sent, field), field
        assert got.draft_parents == sent.draft_parents
        assert got.prefill_only == sent.prefill_only
        assert (got.sampling is None) == (sent.sampling is None)
        if sent.sampling is not None:
            assert got.sampling.to_json() == sent.sampling.to_json()
        assert (got.draft_probs is None) == (sent.draft_probs is None)
        if sent.draft_probs is not None:
            assert torch.equal(got.draft_probs, sent.draft_probs)
        assert (got.token_mask is None) == (sent.token_mask is None)
        if sent.token_mask is not None:
            assert got.token_mask.dtype == torch.int32 and torch.equal(got.token_mask, sent.token_mask)


def test_a_batch_whose_parts_do_not_add_up_is_refused():
    inputs, params = encode_rows([VerifyRequest(1, [1, 2], [3])])
    with pytest.raises(ValueError, match="input_ids"):
        decode_rows(params[ROWS], {**inputs, "input_ids": inputs["input_ids"][:, :1]})
    probs_row = encode_rows([VerifyRequest(1, [1], [3], draft_probs=torch.ones(1, 4) / 4)])[1][ROWS]
    with pytest.raises(ValueError, match="draft probabilities"):
        decode_rows(probs_row, inputs)
    masked, mask_row = encode_rows([VerifyRequest(1, [1, 2], [3], token_mask=_mask(2))])
    with pytest.raises(ValueError, match="token mask"):
        decode_rows(mask_row[ROWS], inputs)
    with pytest.raises(ValueError, match="token_mask"):  # a row more than the rows count
        decode_rows(mask_row[ROWS], {**masked, "token_mask": _mask(3).numpy()[None]})
    with pytest.raises(ValueError, match="JSON list"):
        decode_rows('{"seq": 1}', inputs)


def test_results_survive_the_wire_each_with_its_own_hidden_rows_and_errors():
    hidden_a, hidden_c = torch.randn(3, 2, 4), torch.randn(1, 2, 4)
    results = [
        VerifyResult([5, 6, 7], 2, 0.012, hidden_a),
        RuntimeError("verifier: sequence 4: token id 999 is outside the vocabulary"),
        VerifyResult([8], 0, 0.011, hidden_c),
        None,  # a release
        VerifyResult([], 0, 0.002),  # a prefill chunk
    ]
    out = encode_results(results)
    decoded = decode_results(out, len(results))
    assert decoded[0].token_ids == [5, 6, 7] and decoded[0].num_accepted == 2
    assert torch.equal(decoded[0].hidden_states, hidden_a) and torch.equal(decoded[2].hidden_states, hidden_c)
    assert isinstance(decoded[1], RuntimeError) and "outside the vocabulary" in str(decoded[1])
    assert decoded[2].token_ids == [8] and decoded[2].forward_s == pytest.approx(0.011)
    assert decoded[3].token_ids == [] and decoded[4].token_ids == [] and decoded[4].hidden_states is None
    with pytest.raises(RuntimeError, match="answered 5 rows of 6"):
        decode_results(out, 6)


class WireVerifier:
    """What the verifier model does with a batch request, on a TargetRunner in this process
    (the server path runs in tests/e2e): the decoded rows verified as `in_process` verifies
    them, the results encoded."""

    def __init__(self, runner: TargetRunner) -> None:
        self.run_rows = in_process(runner)

    def __call__(self, inputs: dict, outputs: list[str], parameters: dict) -> dict:
        return encode_results(self.run_rows(decode_rows(parameters[ROWS], inputs)))


class RecordedVerifier:
    """A StepBatcher's run_rows over a TargetRunner, through the verifier model's wire format
    (`over_bls`) or in this process (`in_process`, the speculative model's verifier_in_process);
    records each batch's rows and the thread that ran it."""

    def __init__(self, runner: TargetRunner, transport: str) -> None:
        self.runner = runner
        self.run_rows = over_bls(WireVerifier(runner)) if transport == "wire" else in_process(runner)
        self.batches: list[list] = []
        self.threads: list[str] = []

    def __call__(self, rows: list) -> list:
        self.batches.append(rows)
        self.threads.append(threading.current_thread().name)
        return self.run_rows(rows)


TRANSPORTS = pytest.mark.parametrize("transport", ["wire", "in_process"])


def _greedy(verify, seq_id: int, prompt: list[int], steps: int, allowed: torch.Tensor | None = None) -> list[int]:
    """Decode `steps` steps, drafting the sequence's own last tokens (some accepted, some not);
    with `allowed` ([rows, words] int32) as every step's token mask, its first row repeated
    to one per verified position (`rows` other than 1: a mask of the wrong row count)."""
    out: list[int] = []
    for step in range(steps):
        drafts = out[-2:] if step % 2 else [seq_id % 7, 3]
        mask = None if allowed is None else allowed.repeat(len(drafts) + 1 if len(allowed) == 1 else 1, 1)
        result = verify(VerifyRequest(seq_id, prompt if step == 0 else [], drafts, token_mask=mask))
        out += result.token_ids
    return out


def _every_third(runner: TargetRunner, rows: int = 1) -> torch.Tensor:
    """A token mask that allows bits 0, 3, 6, ... of each int32 word."""
    return torch.full((rows, mask_words(runner.vocab_size)), 0x49249249, dtype=torch.int32)


def _gather_all(batcher: StepBatcher, seq_ids) -> None:
    """Make every step wait for all of `seq_ids` (timing-free tests): they count as running
    before any submits, so none goes alone however late its thread starts, and the gather window
    is wide from the first batch on."""
    batcher.max_wait_s, batcher.wait_fraction, batcher.last_round_trip_s = 5.0, 1e6, 1.0
    batcher.running.update(seq_ids)


@TRANSPORTS
def test_concurrent_sequences_share_forwards_and_get_what_each_gets_alone(tiny_model_dir, transport):
    """Sequences 1 and 3 constrained by a token mask (structured outputs), 2 and 4 not."""
    prompts = {seq_id: [1 + seq_id, 20 + seq_id, 3, 40 + seq_id][: 2 + seq_id % 3] for seq_id in range(1, 5)}
    alone = TargetRunner(tiny_model_dir, dtype="float32", runtime="lean")
    masks = {seq_id: _every_third(alone) if seq_id % 2 else None for seq_id in prompts}
    expected = {seq_id: _greedy(alone.verify, seq_id, prompt, 6, masks[seq_id]) for seq_id, prompt in prompts.items()}
    allowed = set(allowed_tokens(_every_third(alone), alone.vocab_size)[0].nonzero().flatten().tolist())
    assert set(expected[1]) | set(expected[3]) <= allowed
    assert not set(_greedy(alone.verify, 5, prompts[1], 6)) <= allowed  # the mask changes what sequence 1 gets

    verifier = RecordedVerifier(TargetRunner(tiny_model_dir, dtype="float32", runtime="lean"), transport)
    batcher = StepBatcher(verifier)
    _gather_all(batcher, prompts)
    got: dict[int, list[int]] = {}

    def run(seq_id: int) -> None:
        got[seq_id] = _greedy(batcher.verify, seq_id, prompts[seq_id], 6, masks[seq_id])
        batcher.release(seq_id)

    threads = [threading.Thread(target=run, args=(seq_id,)) for seq_id in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert got == expected
    sizes = [len(rows) for rows in verifier.batches]
    assert max(sizes) == len(prompts), sizes  # all four sequences in one forward
    assert len(verifier.batches) < 6 * len(prompts)  # far fewer requests than steps
    assert not verifier.runner.sequences  # every release arrived
    assert not batcher.running


@TRANSPORTS
def test_a_lone_sequence_sends_its_own_steps_at_once(tiny_model_dir, transport):
    verifier = RecordedVerifier(TargetRunner(tiny_model_dir, dtype="float32", runtime="lean"), transport)
    # The window would hold a step for 5 s if a lone sequence waited for it.
    batcher = StepBatcher(verifier, max_wait_s=5.0, wait_fraction=1e6)
    out = _greedy(batcher.verify, 1, [1, 2, 3], 4)
    batcher.release(1)
    assert len(out) >= 4
    assert [len(rows) for rows in verifier.batches] == [1] * 5  # 4 steps and the release
    assert set(verifier.threads) == {threading.current_thread().name}  # no hop through the batcher's thread
    assert not verifier.runner.sequences


@TRANSPORTS
def test_a_failing_row_fails_its_sequence_alone(tiny_model_dir, transport):
    verifier = RecordedVerifier(TargetRunner(tiny_model_dir, dtype="float32", runtime="lean"), transport)
    batcher = StepBatcher(verifier, max_wait_s=5.0, wait_fraction=1e6)
    vocab = verifier.runner.logits_size
    errors: dict[int, Exception] = {}
    got: dict[int, list[int]] = {}

    def run(seq_id: int, prompt: list[int], allowed: torch.Tensor | None = None) -> None:
        try:
            got[seq_id] = _greedy(batcher.verify, seq_id, prompt, 3, allowed)
        except Exception as e:
            errors[seq_id] = e
        batcher.release(seq_id)

    wrong_mask = _every_third(verifier.runner, rows=2)  # two rows for a step that verifies three
    threads = [
        threading.Thread(target=run, args=(1, [1, 2, 3])),
        threading.Thread(target=run, args=(2, [vocab + 5])),
        threading.Thread(target=run, args=(3, [4, 5], wrong_mask)),
        threading.Thread(target=run, args=(4, [6, 7], _every_third(verifier.runner))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert set(errors) == {2, 3} and str(vocab + 5) in str(errors[2])
    assert "sequence 3: token_mask must be an int32 bitmask of 3 rows" in str(errors[3])
    assert len(got[1]) >= 3 and len(got[4]) >= 3
    assert not verifier.runner.sequences and not batcher.running


def test_in_process_steps_carry_logprobs_and_hidden_states(tiny_model_dir):
    """The wire leaves logprobs out (such sequences send their own steps); in process a
    batched step returns everything verifying alone returns."""
    alone = TargetRunner(tiny_model_dir, dtype="float32", runtime="lean")
    runner = TargetRunner(tiny_model_dir, dtype="float32", runtime="lean")
    batcher = StepBatcher(in_process(runner), carries_logprobs=True)
    sampling = SamplingParams(logprobs=2)
    steps = [VerifyRequest(1, [1, 2, 3], [4, 5], sampling, (1, -1)), VerifyRequest(1, [], [6], None, (1, -1))]
    for step in steps:
        want, got = alone.verify(step), batcher.verify(step)
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
        assert got.logprobs and len(got.logprobs) == len(got.token_ids)
        torch.testing.assert_close(got.hidden_states, want.hidden_states, rtol=0, atol=0)
    batcher.release(1)
    assert not runner.sequences


def test_a_failed_forward_fails_every_step_in_it_and_ends_their_sequences(tiny_model_dir):
    runner = TargetRunner(tiny_model_dir, dtype="float32", runtime="lean")
    run_rows = in_process(runner)
    assert [len(r.token_ids) for r in run_rows([VerifyRequest(1, [1, 2], []), VerifyRequest(2, [3, 4], [])])] == [1, 1]

    def broken(steps):
        raise RuntimeError("out of memory in the forward")

    runner.verify_batch = broken
    results = run_rows([VerifyRequest(1, [], [5]), Release(3), VerifyRequest(2, [], [])])
    assert results[1] is None
    for result in (results[0], results[2]):
        assert isinstance(result, RuntimeError) and "verifier: out of memory in the forward" in str(result)
    assert not runner.sequences  # both sequences released, their KV blocks returned


def test_batching_is_off_for_a_verifier_with_several_instances():
    assert single_instance(VERIFIER_CONFIG, num_gpus=0)
    assert not single_instance(VERIFIER_CONFIG.replace("count: 1", "count: 2"), num_gpus=0)
    gpu = VERIFIER_CONFIG.replace("kind: KIND_CPU", "kind: KIND_GPU")
    assert single_instance(gpu, num_gpus=1) and not single_instance(gpu, num_gpus=2)
    assert single_instance(gpu.replace("KIND_GPU", "KIND_GPU gpus: [ 1 ]"), num_gpus=4)
    assert not single_instance(gpu.replace("KIND_GPU", "KIND_GPU gpus: [ 0, 1 ]"), num_gpus=4)


def test_gpus_are_counted_only_for_a_gpu_group_that_lists_none():
    """Counting GPUs imports torch, which a standing-by verifier does not load."""
    asked = []

    def count() -> int:
        asked.append(1)
        return 2

    gpu = VERIFIER_CONFIG.replace("kind: KIND_CPU", "kind: KIND_GPU")
    assert single_instance(VERIFIER_CONFIG, count) and not asked
    assert single_instance(gpu.replace("KIND_GPU", "KIND_GPU gpus: [ 1 ]"), count) and not asked
    assert not single_instance(gpu, count) and asked == [1]


class CountingProposer(Proposer):
    """Drafts each sequence's last token + 1, k times; records each propose's batch; fails
    while `fail` is set."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.released: list[int] = []
        self.fail = False

    def propose(self, batch: list) -> list[Draft]:
        if self.fail:
            raise RuntimeError("injected")
        self.batches.append([req.seq_id for req in batch])
        return [Draft([req.token_ids[-1] + 1] * req.num_draft_tokens) for req in batch]

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)


def test_a_gathered_drafter_drafts_concurrent_sequences_in_one_propose_on_its_thread():
    proposer = CountingProposer()
    service = DraftService(proposer, SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2}'))
    thread = ThreadPoolExecutor(1, thread_name_prefix="verify")
    drafter = GatheredDrafter(service, lambda work: thread.submit(work).result())
    _gather_all(drafter.batcher, (1, 2, 3))
    got: dict[int, list[list[int]]] = {}

    def run(seq_id: int) -> None:
        got[seq_id] = [drafter.draft(DraftCall(seq_id, [10 * seq_id + step], 2))[0].token_ids for step in range(3)]
        drafter.release(seq_id)

    threads = [threading.Thread(target=run, args=(seq_id,)) for seq_id in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert got == {s: [[10 * s + step + 1] * 2 for step in range(3)] for s in (1, 2, 3)}
    assert max(len(batch) for batch in proposer.batches) == 3  # the three sequences in one propose
    assert sorted(proposer.released) == [1, 2, 3] and not service.num_sequences and not drafter.batcher.running

    proposer.fail = True  # a failed propose fails its calls and forgets their sequences
    with pytest.raises(RuntimeError, match="drafter: injected"):
        drafter.draft(DraftCall(4, [7], 2))
    assert not service.num_sequences and 4 in proposer.released and not drafter.batcher.running
