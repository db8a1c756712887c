"""The target model: one forward over a sequence's uncached tokens plus its drafts, then
accept/reject right here so logits never leave the process.

The forward runs on an engine (backends/runtime/engine.py). The lean runtime (one preallocated
paged KV pool, a ragged batched forward; Llama, Qwen2, Qwen3, Mistral) runs every step of a
batch, prompts and verifications together, in one call, and verifies draft trees. Other models
and devices go through transformers (runtime/hf_engine.py: a DynamicCache per sequence, running
sequences batched with padding, a tree cut to its first chain); the load log says which.

After a step the cache covers every token but the last emitted one (that token has not been
through the model yet); rejected drafts are cut off (the pool: a shorter length, no copy),
so the cache never holds a token that is not part of the output.

A sequence's KV blocks are taken as its steps write them; which sequences hold blocks, which
wait, and which are preempted when the pool runs short is the scheduler's (serving/kv_scheduler.py).
A step that cannot run now is answered `waiting`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from backends.runtime import BATCH_INVARIANT_MODES
from backends.runtime.kv_cache import KVCacheFullError, SequenceError
from backends.runtime.lean_lm import Row
from backends.runtime.model_store import context_window
from backends.serving.idle import release_idle
from backends.serving.kv_scheduler import KVStats, Scheduler
from backends.serving.logits import TokenLogprob, check_controls_fit, process_logits, token_logprobs
from backends.serving.rejection import MAX_SPEC_LEN, new_generator, rejection_sample, synthetic_sample
from backends.serving.request import GREEDY, SamplingParams
from backends.serving.step_cost import StepCostCurve, measure_step_cost, step_shares
from backends.serving.target_engine import check_sliding_window, load_target_engine
from backends.serving.tree import DraftTree, TreeError, accept_tree
from backends.structured.mask import apply_token_mask

log = logging.getLogger("tritonspec.target")
# A waiting sequence asks again every ADMISSION_POLL_S (serving/orchestrator.py); one that has not
# asked for this long (its client vanished without END, or is slow over BLS) no longer holds the
# head of the queue until the idle timeout frees it: others are admitted past it meanwhile.
ABSENT_HEAD_S = 1.0


@dataclass
class VerifyRequest:
    seq_id: int
    new_token_ids: list[int]  # tokens the target has not seen: the prompt on the first step
    draft_token_ids: list[int]
    sampling: SamplingParams | None = None  # given on the first step, kept for the sequence
    hidden_layer_ids: tuple[int, ...] = ()
    draft_probs: torch.Tensor | None = None  # [len(drafts), V] from drafters that have them
    max_new_tokens: int | None = None  # on the first step: the most it may emit (checked; blocks are taken as written)
    # The drafts as a tree: each one's parent (-1: the last emitted token); None: a chain.
    draft_parents: list[int] | None = None
    # A chunk of a long prompt: its tokens go into the cache and nothing is emitted (chunked
    # prefill; the orchestrator sends the prompt's last chunk as an ordinary step).
    prefill_only: bool = False
    # Structured outputs: what the grammar allows at each row ([len(drafts) + 1, words] int32
    # bitmask, backends/structured/mask.py; a tree's rows: the root's, then each node's); the
    # row is sampled from the target's distribution under it. None: unconstrained.
    token_mask: torch.Tensor | None = None


@dataclass
class VerifyResult:
    token_ids: list[int]  # accepted drafts + one more token (recovered or bonus); none after a prefill chunk
    num_accepted: int
    forward_s: float  # this sequence's share of the forward's time (step_shares)
    hidden_states: torch.Tensor | None = None  # [kept positions, layers, hidden]
    logprobs: list[TokenLogprob] | None = None  # per emitted token, when the sequence asked for them
    # prompt_logprobs: one per prompt token this step scored (a prompt step's; None on others)
    prompt_logprobs: list[TokenLogprob] | None = None
    waiting: bool = False  # no room in the KV pool now: the step did not run; send it again


@dataclass
class _Sequence:
    sampling: SamplingParams
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    last_used: float = 0.0  # on TargetRunner.clock, when its last step ended
    num_prompt_tokens: int = 0  # token_ids after these are output (penalties count only those)
    # Tokens cached before its latest preemption: recomputed for the cache alone (their hidden
    # states went out already).
    resume_at: int = 0
    # prompt_logprobs: prompt tokens scored so far (the first has no logprob), and the raw logits
    # of a prefill chunk's last position, whose token comes with the next chunk.
    prompt_scored: int = 1
    held_row: torch.Tensor | None = None  # [V]


@dataclass
class _Step:
    """One sequence's part of a verify call."""

    req: VerifyRequest
    seq: _Sequence
    pending: list[int]  # tokens not yet through the model: the prompt, or the last emitted one
    tree: DraftTree | None = None  # the drafts when they form a tree (not a chain)
    accepted: list[int] = field(default_factory=list)  # tree nodes kept, set by acceptance
    recomputed: int = 0  # leading pending tokens computed again after a preemption

    def row(self) -> Row:
        """The step as the engine's row: a tree runs with its mask and depth positions."""
        if self.tree is None:
            return Row(self.req.seq_id, self.input_ids)
        start, p = self.seq.num_cached, len(self.pending)
        return Row(self.req.seq_id, self.input_ids, self.tree.attention_mask(p), self.tree.positions(start, p))

    def kept_rows(self, result: VerifyResult) -> torch.Tensor | slice:
        """Input rows whose KV (and hidden states) stay: the pending tokens, then the accepted drafts."""
        p, r = len(self.pending), self.recomputed
        if self.tree is None:
            return slice(r, p + result.num_accepted)
        return torch.tensor(list(range(r, p)) + [p + node for node in self.accepted])

    @property
    def input_ids(self) -> list[int]:
        return self.pending + self.req.draft_token_ids

    @property
    def num_rows(self) -> int:
        """Logit rows that matter: one per draft plus the bonus row (none for a prefill chunk)."""
        return 0 if self.req.prefill_only else len(self.req.draft_token_ids) + 1

    @property
    def prompt_span(self) -> tuple[int, int] | None:
        """prompt_logprobs: the prompt positions [first, end) whose logit rows this step scores
        with (row t - 1 scores token t: from the first token not yet scored on); None when it
        reaches no prompt token."""
        seq = self.seq
        end = min(seq.num_cached + len(self.pending), seq.num_prompt_tokens)
        if seq.sampling.prompt_logprobs is None or seq.num_cached >= end:
            return None
        return max(seq.num_cached, seq.prompt_scored - 1), end

    @property
    def num_prompt_rows(self) -> int:
        """Logit rows of prompt positions ahead of num_rows (on the prompt's last step its last
        position is num_rows' first; a prefill chunk's last row is kept for the next chunk)."""
        span = self.prompt_span
        return 0 if span is None else max(0, span[1] - span[0] - (0 if self.req.prefill_only else 1))

    def num_kept(self, result: VerifyResult) -> int:
        """Input positions whose KV stays: the pending tokens and the accepted drafts."""
        return len(self.pending) + result.num_accepted


class TargetRunner:
    def __init__(
        self,
        model_path: Path,
        dtype: str = "bfloat16",
        device: str = "cpu",
        max_model_len: int | None = None,
        kv_cache_memory_gb: float | None = None,
        runtime: str = "auto",
        batch_invariant: str = "auto",
        prefix_caching: bool = True,
        prefix_cache_namespace: str = "",
    ) -> None:
        """`runtime`: "auto" (the lean runtime where it runs, else transformers), "lean" (fail
        where it does not), "hf" (transformers). `batch_invariant`: "auto" (on where the lean
        runtime runs: a token's logits do not depend on what shares its step, so speculative
        output is exactly plain output in bf16 too), "on" (fail where it cannot be), "off".
        `prefix_caching`: on the lean runtime, a prompt that starts like an earlier one reuses
        the K/V blocks computed for it (runtime/kv_cache.py), only within the same
        `prefix_cache_namespace` (this deployment's) and request cache_salt."""
        if batch_invariant not in BATCH_INVARIANT_MODES:
            raise ValueError(
                f"batch_invariant must be one of {', '.join(BATCH_INVARIANT_MODES)}, got {batch_invariant!r}"
            )
        if batch_invariant == "on" and runtime == "hf":
            raise ValueError("batch_invariant 'on' needs the lean runtime (runtime 'hf' was asked)")
        self.device = torch.device(device)
        self.engine = load_target_engine(
            model_path,
            dtype,
            self.device,
            max_model_len,
            kv_cache_memory_gb,
            runtime,
            batch_invariant,
            prefix_caching,
            prefix_cache_namespace,
        )
        self.config = self.engine.config
        self.max_model_len = context_window(self.config, max_model_len)
        check_sliding_window(self.config, self.max_model_len)
        self.num_layers = self.config.num_hidden_layers
        self.sequences: dict[int, _Sequence] = {}
        self.scheduler = Scheduler(self.engine, self._preempted)
        self._warned_trees = False
        # What idleness is measured on; the Triton verifier counts only the time it waits for
        # work (sequence_model.IdleClock), so a step queued behind others never looks idle.
        self.clock: Callable[[], float] = time.monotonic
        # What a step may name: ids the embedding has (an id past it is a device assert on
        # CUDA, which poisons the process), probabilities over the logits' vocabulary, and
        # hidden-state layers 0..L (-1: the final normed state).
        self.vocab_size, self.logits_size = self.engine.vocab_size, self.engine.logits_size
        self.batch_invariant = self.engine.batch_invariant
        self.kv_budget_tokens = self.engine.capacity_tokens
        # What a step costs by its new tokens: how a batched step's time is shared among its
        # rows (step_shares). Measured where a step's time follows its tokens (a ragged
        # engine); a padded batch's time is split evenly.
        self.step_cost: StepCostCurve | None = None
        if self.engine.ragged:
            self.step_cost = measure_step_cost(self.engine)
            log.info("a step's cost by its new tokens: %s", self.step_cost)

    @property
    def reserved_tokens(self) -> int:
        return self.engine.reserved_tokens

    def kv_stats(self) -> KVStats:
        """KV usage, running and waiting sequences, preemptions so far (the metrics read these)."""
        return self.scheduler.stats()

    def cached_tokens(self, seq_id: int) -> int:
        """Tokens of the sequence held in the KV cache."""
        return self.engine.length(seq_id)

    def verify(self, req: VerifyRequest) -> VerifyResult:
        result = self.verify_batch([req])[0]
        if isinstance(result, Exception):
            raise result
        return result

    @torch.inference_mode()
    def verify_batch(self, batch: list[VerifyRequest]) -> list[VerifyResult | SequenceError]:
        """Verify many sequences' steps; one result (or the request's own error) each.

        The steps share one forward pass; on an engine that pads its rows (not ragged) a first
        step (the prompt) runs alone, since padding 1-token steps to a prompt's length wastes
        more than a second pass costs.

        One request never fails another: each step is checked before any forward (its ids,
        draft probabilities and layers), a batched forward that still fails is retried one
        step at a time so only the culprit fails, and accept/reject runs per step. A failed
        step ends its sequence (its cache may hold part of the step). A step the KV pool has
        no room for now is answered `waiting` (`_schedule`).
        """
        results: list[VerifyResult | SequenceError | None] = [None] * len(batch)
        steps: list[tuple[int, _Step]] = []
        for i, req in enumerate(batch):
            try:
                steps.append((i, self._prepare(req)))
            except Exception as e:
                results[i] = self._fail(req.seq_id, e)
        steps, answers = self._schedule(steps)
        for i, answer in answers.items():
            results[i] = answer
        for i, step in steps:
            if not step.input_ids:  # a prompt chunk found whole in the prefix cache: nothing to compute
                results[i] = self._accept(step, None, 0.0)
        pending = [(i, step) for i, step in steps if results[i] is None]
        # A ragged engine runs prompts and verifications in one forward; a padded one batches
        # running sequences only.
        running = pending if self.engine.ragged else [(i, s) for i, s in pending if s.seq.num_cached > 0]
        if len(running) > 1:
            try:
                batched = self._forward([step for _, step in running])
            except Exception:
                log.exception(
                    "a batched verification of %d sequences failed; verifying them one at a time", len(running)
                )
            else:
                for (i, step), result in zip(running, batched):
                    results[i] = self._fail(step.req.seq_id, result) if isinstance(result, Exception) else result
        for i, step in steps:
            if results[i] is None:
                try:
                    results[i] = self._forward_one(step)
                except Exception as e:
                    results[i] = self._fail(step.req.seq_id, e)
        now = self.clock()
        for req in batch:  # idleness counts from the end of a step (or of a wait)
            if (seq := self.sequences.get(req.seq_id)) is not None:
                seq.last_used = now
        return results

    def _fail(self, seq_id: int, error: Exception) -> SequenceError:
        """End a sequence whose step failed; the error as that request's own."""
        self.release(seq_id)
        if isinstance(error, SequenceError):
            return error
        log.warning("sequence %d: verification failed", seq_id, exc_info=error)
        return SequenceError(f"sequence {seq_id}: verification failed: {type(error).__name__}: {error}")

    def _prepare(self, req: VerifyRequest) -> _Step:
        seq = self.sequences.get(req.seq_id)
        if seq is None and not req.new_token_ids:
            raise SequenceError(f"sequence {req.seq_id} is unknown (ended or timed out)")
        num_tokens = (len(seq.token_ids) if seq else 0) + len(req.new_token_ids)
        if num_tokens + len(req.draft_token_ids) > self.max_model_len:
            raise SequenceError(
                f"sequence {req.seq_id}: {num_tokens} tokens + {len(req.draft_token_ids)} drafts "
                f"exceed the context window of {self.max_model_len}"
            )
        self._check(req)
        tree = None
        if req.draft_parents is not None:
            try:
                tree = DraftTree(tuple(req.draft_token_ids), tuple(req.draft_parents))
            except TreeError as e:
                raise SequenceError(f"sequence {req.seq_id}: draft_parents: {e}") from None
            if tree.is_chain:
                tree = None
            elif not self.engine.tree_attention:
                req, tree = self._first_chain(req, tree), None
        if seq is None:
            seq = self._start(req)
        if len(seq.token_ids) == seq.num_prompt_tokens:  # nothing emitted yet: all of it is prompt
            seq.num_prompt_tokens += len(req.new_token_ids)
        seq.token_ids.extend(req.new_token_ids)
        if len(seq.token_ids) == seq.num_prompt_tokens and self.scheduler.is_running(req.seq_id):
            seq.num_cached += self.engine.share_prefix(req.seq_id, self._shareable(req, seq))
        return _Step(req, seq, seq.token_ids[seq.num_cached :], tree)

    def _shareable(self, req: VerifyRequest, seq: _Sequence) -> list[int]:
        """The sequence's tokens whose K/V may come from the prefix cache (blocks an earlier
        sequence with the same prefix computed): a step that emits a token still computes its
        last one, and one that asks for hidden states computes those the drafter has not had."""
        if seq.sampling.prompt_logprobs is not None:  # every prompt row is computed (vLLM's rule too)
            return []
        known = len(seq.token_ids) - (0 if req.prefill_only else 1)
        return seq.token_ids[: min(known, seq.resume_at) if req.hidden_layer_ids else known]

    def _schedule(
        self, steps: list[tuple[int, _Step]]
    ) -> tuple[list[tuple[int, _Step]], dict[int, VerifyResult | SequenceError]]:
        """The steps that run now, each with room for its tokens (kv_scheduler.py: running
        sequences oldest first, preempting the newest when the pool is short; then waiting
        ones in arrival order while they fit), and the answers of the others: waiting, or the
        error of one that can never fit."""
        by_seq = {step.req.seq_id: (i, step) for i, step in steps}
        run: set[int] = set()
        answers: dict[int, VerifyResult | SequenceError] = {}
        scheduler = self.scheduler
        for seq_id in list(scheduler.running):
            if seq_id in by_seq and scheduler.is_running(seq_id):  # not preempted meanwhile
                i, step = by_seq[seq_id]
                try:
                    if scheduler.make_room(seq_id, step.seq.num_cached + len(step.input_ids)):
                        run.add(i)
                except KVCacheFullError as e:
                    answers[i] = self._fail(seq_id, e)
        now, absent = self.clock(), set()
        for seq_id in list(scheduler.waiting):
            if seq_id not in by_seq:
                if now - self.sequences[seq_id].last_used > ABSENT_HEAD_S:
                    absent.add(seq_id)  # its client stopped asking (vanished, or away): it keeps its place
                    continue
                break  # the head of the queue is not stepping now: nobody overtakes it
            i, step = by_seq[seq_id]
            try:
                if not self._admit(step, absent):
                    break
                run.add(i)
            except KVCacheFullError as e:
                answers[i] = self._fail(seq_id, e)
        for i, step in steps:
            if i not in run and i not in answers:
                answers[i] = self._wait(step)
        return [(i, step) for i, step in steps if i in run], answers

    def _admit(self, step: _Step, absent: set[int]) -> bool:
        """Admit a waiting sequence for this step when it may (Scheduler.admit, passing over the
        `absent`): its cached prefix is looked up before any block is taken, then blocks for the rest."""
        req, seq = step.req, step.seq
        need = len(seq.token_ids) + len(req.draft_token_ids)  # its cache starts over
        shareable = self._shareable(req, seq)
        if not self.scheduler.admit(req.seq_id, need, shareable, seq.sampling.cache_salt, absent):
            return False
        seq.num_cached = self.engine.share_prefix(req.seq_id, shareable)
        self.engine.grow(req.seq_id, need)
        step.pending = seq.token_ids[seq.num_cached :]
        step.recomputed = max(0, seq.resume_at - seq.num_cached)
        return True

    def _wait(self, step: _Step) -> VerifyResult:
        """A step that cannot run now: its tokens are taken back, to come again with it."""
        seq, n = step.seq, len(step.req.new_token_ids)
        if n:
            del seq.token_ids[-n:]
            seq.num_prompt_tokens = min(seq.num_prompt_tokens, len(seq.token_ids))
        return VerifyResult([], 0, 0.0, waiting=True)

    def _preempted(self, seq_id: int) -> None:
        """The scheduler freed the sequence's blocks: its cache starts over."""
        seq = self.sequences[seq_id]
        seq.resume_at = max(seq.resume_at, seq.num_cached)
        seq.num_cached = 0
        log.info("sequence %d preempted (KV pool short): it resumes by recomputing %d tokens", seq_id, seq.resume_at)

    def _first_chain(self, req: VerifyRequest, tree: DraftTree) -> VerifyRequest:
        """An engine without tree attention verifies chains: a tree is cut to its chain of first children."""
        if not self._warned_trees:
            log.warning("the target's engine has no tree attention: draft trees are verified as their first chain")
            self._warned_trees = True
        nodes = tree.first_path()
        probs = None if req.draft_probs is None else req.draft_probs[nodes]
        mask = None if req.token_mask is None else req.token_mask[[0] + [i + 1 for i in nodes]]
        return replace(
            req,
            draft_token_ids=[tree.token_ids[i] for i in nodes],
            draft_probs=probs,
            draft_parents=None,
            token_mask=mask,
        )

    def _check(self, req: VerifyRequest) -> None:
        """What the step names must exist: SequenceError (this request's alone) otherwise."""
        where = f"sequence {req.seq_id}"
        for name, ids in (("token", req.new_token_ids), ("draft", req.draft_token_ids)):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise SequenceError(f"{where}: {name} id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if req.prefill_only and (req.draft_token_ids or not req.new_token_ids):
            raise SequenceError(f"{where}: a prefill chunk carries prompt tokens and no drafts")
        if len(req.draft_token_ids) > MAX_SPEC_LEN:
            raise SequenceError(f"{where}: {len(req.draft_token_ids)} drafts; at most {MAX_SPEC_LEN} per step")
        probs = req.draft_probs
        if probs is not None:
            expected = (len(req.draft_token_ids), self.logits_size)
            if tuple(probs.shape) != expected:
                raise SequenceError(
                    f"{where}: draft_probs must have shape {list(expected)} (one row over the "
                    f"vocabulary per draft), got {list(probs.shape)}"
                )
            if not probs.dtype.is_floating_point or not torch.isfinite(probs).all() or (probs < 0).any():
                raise SequenceError(f"{where}: draft_probs must be finite, non-negative probabilities")
        mask, rows = req.token_mask, 0 if req.prefill_only else len(req.draft_token_ids) + 1
        if mask is not None and (mask.dim() != 2 or mask.shape[0] != rows or mask.dtype != torch.int32):
            raise SequenceError(
                f"{where}: token_mask must be an int32 bitmask of {rows} rows (one per verified "
                f"position), got {mask.dtype} {list(mask.shape)}"
            )
        bad_layers = [i for i in req.hidden_layer_ids if not -1 <= i <= self.num_layers]
        if bad_layers:
            raise SequenceError(f"{where}: hidden layer id {bad_layers[0]} is not in [-1, {self.num_layers}]")
        if len(req.hidden_layer_ids) > self.num_layers + 2:
            raise SequenceError(
                f"{where}: {len(req.hidden_layer_ids)} hidden layer ids; this target has "
                f"{self.num_layers + 2} (-1 and 0..{self.num_layers})"
            )
        max_new = req.max_new_tokens
        if max_new is not None and (isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1):
            raise SequenceError(f"{where}: max_new_tokens must be a positive integer, got {max_new!r}")

    def _forward_one(self, step: _Step) -> VerifyResult:
        result = self._forward([step])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def _forward(self, steps: list[_Step]) -> list[VerifyResult | Exception]:
        """One forward over every step; each sequence's cache then drops back to what it keeps
        (its pending tokens and accepted drafts)."""
        layers = sorted({i for step in steps for i in step.req.hidden_layer_ids})
        rows = [step.row() for step in steps]
        for step in steps:  # a retried step starts from what the sequence keeps
            self.engine.truncate(step.req.seq_id, step.seq.num_cached)
        start = time.perf_counter()
        out = self.engine.forward(rows, [step.num_prompt_rows + step.num_rows for step in steps], layers)
        shares = self._shares(time.perf_counter() - start, [len(r.token_ids) for r in rows])
        results: list[VerifyResult | Exception] = []
        for row, (step, forward_s) in enumerate(zip(steps, shares)):
            try:  # from here on each row is its own sequence's business
                prompt_rows, logits = out.logits[row].split([step.num_prompt_rows, step.num_rows])
                scored = self._score_prompt(step, prompt_rows)
                result = self._accept(step, logits, forward_s)
                result.prompt_logprobs = scored
                if step.accepted:  # move the accepted path's KV into place behind the pending tokens
                    base = step.seq.num_cached - len(step.accepted)
                    self.engine.compact(step.req.seq_id, [base + node for node in step.accepted], base)
                self.engine.truncate(step.req.seq_id, step.seq.num_cached)
                self.engine.commit(step.req.seq_id, step.seq.token_ids)
                if step.req.hidden_layer_ids:
                    kept = step.kept_rows(result)
                    hidden = [out.hidden[row][i][kept] for i in step.req.hidden_layer_ids]  # each [kept, hidden]
                    result.hidden_states = torch.stack(hidden, dim=1).float().cpu()
            except Exception as e:
                result = e
            results.append(result)
        return results

    def _score_prompt(self, step: _Step, rows: torch.Tensor) -> list[TokenLogprob] | None:
        """prompt_logprobs of the prompt tokens this step reached (`rows`: the raw logits of
        positions prompt_span[0] on; each token's from the position before it, which for the
        step's first token may be the previous chunk's last). None: not a prompt step."""
        span, seq = step.prompt_span, step.seq
        if span is None:
            return None
        first, end = span
        if seq.prompt_scored == seq.num_cached > 0:  # this step goes on right after a chunk
            rows, first = torch.cat([seq.held_row[None], rows]), first - 1
        targets = seq.token_ids[seq.prompt_scored : end]  # token t from row t - 1 - first (0 on)
        scored = token_logprobs(rows, targets, seq.sampling.prompt_logprobs) if targets else []
        seq.held_row = rows[end - 1 - first].clone() if step.req.prefill_only else None
        seq.prompt_scored = max(seq.prompt_scored, end)
        return scored

    def _shares(self, step_s: float, tokens: list[int]) -> list[float]:
        """Each row's share of the step (step_shares), a token priced at this step's size."""
        cost = self.step_cost.token_cost(len(tokens), sum(tokens)) if self.step_cost else 0.0
        return step_shares(step_s, tokens, cost)

    def _accept(self, step: _Step, logits: torch.Tensor | None, forward_s: float) -> VerifyResult:
        """Accept/reject the step's drafts against its logit rows; commit the tokens."""
        seq, drafts = step.seq, step.req.draft_token_ids
        if step.req.prefill_only:  # every token of the chunk stays cached; none is emitted
            seq.num_cached = len(seq.token_ids)
            return VerifyResult([], 0, forward_s)
        raw = logits
        if step.req.token_mask is not None:  # the grammar's tokens only, at every row (first, as vLLM)
            logits = apply_token_mask(logits, step.req.token_mask)
        if seq.sampling.processes_logits:  # each row with the history before its position
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            prefixes = step.tree.row_prefixes() if step.tree else [drafts[:j] for j in range(len(drafts) + 1)]
            logits = process_logits(logits, seq.sampling, seq.token_ids[seq.num_prompt_tokens :], prefixes, prompt)
        if step.tree is not None:
            step.accepted, token = accept_tree(step.tree, logits, step.req.draft_probs, seq.sampling, seq.generator)
            emitted = [drafts[node] for node in step.accepted] + [token]
            raw = raw[[0] + [node + 1 for node in step.accepted]]  # the rows of the emitted tokens
        elif seq.sampling.synthetic_acceptance_rates and drafts:
            rates = list(seq.sampling.synthetic_acceptance_rates)
            emitted = synthetic_sample(drafts, logits, rates, seq.sampling, seq.generator)
        else:
            emitted = rejection_sample(drafts, logits, step.req.draft_probs, seq.sampling, seq.generator)
        seq.token_ids.extend(emitted)
        seq.num_cached = len(seq.token_ids) - 1
        logprobs = None if seq.sampling.logprobs is None else token_logprobs(raw, emitted, seq.sampling.logprobs)
        return VerifyResult(emitted, len(emitted) - 1, forward_s, logprobs=logprobs)

    def _start(self, req: VerifyRequest) -> _Sequence:
        """A new sequence, waiting for room for its first step (the scheduler admits it)."""
        sampling = req.sampling or GREEDY
        check_controls_fit(sampling, self.logits_size)
        seq = _Sequence(sampling, new_generator(self.device, sampling.seed))
        self.sequences[req.seq_id] = seq
        self.scheduler.enqueue(req.seq_id)
        log.debug("sequence %d started (%d known)", req.seq_id, len(self.sequences))
        return seq

    def release(self, seq_id: int) -> bool:
        """Drop a sequence's KV cache (or its place in the queue); True when it existed."""
        self.scheduler.forget(seq_id)
        self.engine.release(seq_id)
        return self.sequences.pop(seq_id, None) is not None

    def release_idle(self, idle_s: float, keep: Collection[int] = ()) -> list[int]:
        """Drop sequences idle for `idle_s` since their last step ended (a client vanished
        without END); `keep`: those with a step in hand (never idle, however long it waited)."""
        return release_idle(self.sequences, self.clock(), idle_s, keep, self.release, log)
