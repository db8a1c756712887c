"""The speculative decoding loop: plan -> draft -> verify -> emit, until EOS, a stop
string, max_tokens or the end of the context window.

A request's state between steps is a `Generation`; `generate` runs its steps. It only sees two
small interfaces, Drafter and Verifier, so the same loop runs over Triton BLS calls in the
server and over in-process objects in tests:

    gen = Generation(req, prompt_ids, seq_id, verifier, drafter, TextStream(tokenizer), ctx)
    for step in generate(gen):
        print(step.text, end="")
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import torch

from backends.runtime.kv_cache import KVCacheFullError
from backends.serving.adaptive import DraftCut, DraftHistory, DraftPolicy, Shape, StepCost
from backends.serving.detokenize import TextStream
from backends.serving.drafting import DraftCall
from backends.serving.logits import TokenLogprob
from backends.serving.parameters import DEFAULT_MAX_QUEUE_TIME_S
from backends.serving.proposer import Draft, DrafterInfo
from backends.serving.rejection import MAX_SPEC_LEN, AcceptanceStats
from backends.serving.request import GenerationRequest, RequestError, SamplingParams
from backends.serving.target import VerifyRequest, VerifyResult
from backends.serving.tree import DraftTree

if TYPE_CHECKING:
    from backends.structured.grammar import GrammarCompiler
    from backends.structured.matcher import GrammarMatcher

log = logging.getLogger("tritonspec.orchestrator")
DRAFTER_KEEPALIVE_S = 30.0  # a quarter of the peers' max_sequence_idle_microseconds (120 s)
# A step the verifier has no KV room for now is sent again after this long (a waiting step
# costs the verifier a lookup, no forward), for at most the queue timeout in all.
ADMISSION_POLL_S = 0.02


class AdmissionTimeoutError(KVCacheFullError):
    """A request waited the queue timeout for room in the target's KV pool. Retryable: the
    OpenAI front end answers 503 with Retry-After (it maps "KV cache budget full")."""


class Drafter(Protocol):
    """The drafter side of the step contract: a DraftCall in (the tokens since the last call,
    the final k and tree size, how many drafts of the last answer were accepted, the target's
    hidden rows, the request's temperature and seed), the drafts out."""

    info: DrafterInfo  # what it is (method, k, layers), known before the first request

    def draft(self, call: DraftCall) -> tuple[Draft, float]:
        """Up to `call.num_draft_tokens` levels of drafts (a chain, or a tree of at most
        `call.num_nodes` nodes) with their probabilities where sampled, and the seconds
        spent proposing."""

    def release(self, seq_id: int) -> None: ...


class Verifier(Protocol):
    """The verifier side: a VerifyRequest in (new tokens, drafts and their probabilities,
    on the first step the sampling parameters and the KV reservation), a VerifyResult out
    (the emitted ids, forward seconds, hidden states of the kept positions, logprobs)."""

    def verify(self, req: VerifyRequest) -> VerifyResult: ...

    def release(self, seq_id: int) -> None: ...


@dataclass
class GenerationStats:
    """One request's acceptance counters (vLLM's definitions) and where its time went."""

    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    num_steps: int = 0  # target forward passes, with or without drafts
    num_output_tokens: int = 0
    draft_s: float = 0.0  # inside the proposer
    verify_s: float = 0.0  # inside the target's forward pass
    grammar_s: float = 0.0  # structured outputs: checking drafts and building masks (part of the overhead)
    total_s: float = 0.0  # wall time of all steps, streaming included
    fallback: str = ""  # why this request stopped speculating and decoded plainly (drafter failure)

    def record(self, num_drafts: int, num_emitted: int, draft_s: float, verify_s: float) -> None:
        self.num_steps += 1
        self.num_output_tokens += num_emitted
        self.acceptance.update(num_drafts, num_emitted - 1)
        self.draft_s += draft_s
        self.verify_s += verify_s

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.total_s - self.draft_s - self.verify_s)

    def to_dict(self) -> dict:
        return {
            **self.acceptance.to_dict(),
            "num_steps": self.num_steps,
            "tokens_per_step": self.num_output_tokens / self.num_steps if self.num_steps else 0.0,
            "draft_ms": self.draft_s * 1e3,
            "verify_ms": self.verify_s * 1e3,
            "overhead_ms": self.overhead_s * 1e3,
            "grammar_ms": self.grammar_s * 1e3,
            "total_ms": self.total_s * 1e3,
            **({"fallback": self.fallback} if self.fallback else {}),
        }


@dataclass
class StepOutput:
    token_ids: list[int]  # new output tokens of this step
    text: str  # new text of this step (complete characters only)
    finish_reason: str | None = None  # "stop", "length", "cancelled" on the last step
    # With extraction on: the target's rows for the positions this step ran ([rows, layers,
    # hidden], in order; see backends/methods/extract_hidden_states.py).
    hidden_states: torch.Tensor | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens the step scored (prompt_logprobs)


def check_lengths(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens >= max_model_len:
        raise RequestError(
            f"the prompt has {num_prompt_tokens} tokens, but the context window is "
            f"{max_model_len} tokens (room is needed for at least one output token)"
        )
    if max_tokens > max_model_len:
        raise RequestError(f"max_tokens={max_tokens} is above the model's limit of {max_model_len}")


def draft_length(req: GenerationRequest, info: DrafterInfo, load: int, room: int) -> int:
    """The one place a step's most draft levels are decided (the adaptive policy picks within
    them, Generation.plan): the client's num_draft_tokens (validated at the start of the
    request) or the configured k; the batch-size schedule at the current load, except for a
    seeded request, whose output must not depend on who else is served; the room left in
    max_tokens and the context window."""
    k = info.config.num_draft_tokens_for_request(req.num_draft_tokens)
    if not seeded(req):
        k = min(k, info.config.num_draft_tokens_for_batch_size(max(1, load)))
    return min(room, k)


def seeded(req: GenerationRequest) -> bool:
    return not req.sampling.greedy and req.sampling.seed is not None


@dataclass(frozen=True)
class ServingContext:
    """What the loop needs of the server around it, the same for every request it serves."""

    eos_token_ids: Collection[int]
    max_model_len: int
    # Each step's draft length follows the sequence's acceptance and measured step times
    # (backends.serving.adaptive); a client's num_draft_tokens, or a seeded sampled request, fixes it.
    adaptive: bool = True
    # extract_hidden_states: each step also returns the target's hidden states of these layers.
    extract_layer_ids: tuple[int, ...] = ()
    load: Callable[[], int] = lambda: 1  # requests being served now (the batch-size schedule)
    # A longer prompt goes to the verifier in chunks of at most this many tokens, one verifier
    # step each, so other sequences' steps run in between (0: in one step).
    prefill_chunk: int = 0
    # Structured outputs' compiled grammars over the target's tokenizer; None: a constrained
    # request is refused (a loop run without them, generate_local's default).
    grammars: GrammarCompiler | None = None
    # How long a request may wait, in all, for room in the target's KV pool (admission queue,
    # or resuming after a preemption) before it fails with AdmissionTimeoutError.
    max_queue_time_s: float = DEFAULT_MAX_QUEUE_TIME_S
    # What the drafter's steps cost and how often its drafts were accepted, as every request
    # measures them: where each new request's draft-shape policy starts (adaptive.DraftHistory).
    draft_history: DraftHistory = field(default_factory=DraftHistory)


@dataclass(slots=True)
class StepPlan:
    """What one step asks of the drafter (the part of vLLM's SpecDecodeMetadata known before
    drafting)."""

    num_draft_tokens: int  # k: levels of drafts (0: none)
    room: int  # the most drafts the step may carry (max_tokens and the context window)
    num_nodes: int  # tree nodes asked for (0: a chain)
    call_drafter: bool  # k > 0, or a keepalive call
    # Reads no prompt (neither the verifier's last chunk nor the drafter's first call): only such
    # steps' times teach the draft-length policies (a prompt step would teach that drafting never pays).
    steady: bool


@dataclass(slots=True)
class Drafted:
    """The drafter's answer to a StepPlan: the drafts to verify and what they cost."""

    draft: Draft = field(default_factory=Draft)
    draft_s: float = 0.0  # inside the proposer
    wall_s: float = 0.0  # the drafter call as the loop waited for it
    num_new: int = 0  # tokens the drafter read in the call (many after a pause: it caught up)
    chain: list[int] = field(default_factory=list)  # a tree's chain of first children, before the cut
    num_cut: int = 0  # drafts the cut dropped (DraftCut)


class Generation:
    """One request's decoding state between steps (vLLM's CachedRequestState): the tokens the
    verifier and the drafter have not seen yet, the counts, the draft-length policies, the
    target's hidden rows waiting for the drafter, the statistics. A step is plan -> draft ->
    verify -> emit (llama.cpp's common/speculative.h: begin, draft, accept); `generate` runs
    them. The caller releases the sequence in the drafter and verifier afterwards.

    A drafter that fails turns speculation off for the rest of the request (`stats.fallback`
    says why): the output is the target's either way."""

    def __init__(
        self,
        req: GenerationRequest,
        prompt_ids: list[int],
        seq_id: int,
        verifier: Verifier,
        drafter: Drafter | None,
        text: TextStream,
        ctx: ServingContext,
        stats: GenerationStats | None = None,
    ) -> None:
        check_lengths(len(prompt_ids), req.max_tokens, ctx.max_model_len)
        self.req, self.seq_id, self.text, self.ctx = req, seq_id, text, ctx
        self.verifier, self.drafter = verifier, drafter
        self.stats = GenerationStats() if stats is None else stats
        self.speculate = drafter is not None and drafter.info.proposes_drafts and req.num_draft_tokens != 0
        # num_draft_tokens 0 asks for plain decoding: nothing extracted either
        self.extract_layer_ids = () if req.num_draft_tokens == 0 else ctx.extract_layer_ids
        self.layer_ids = self.extract_layer_ids or (drafter.info.hidden_layer_ids if self.speculate else ())
        self.num_seq_tokens = len(prompt_ids)  # prompt + output so far
        self.num_generated = 0
        self.unseen_by_verifier = list(prompt_ids)
        self.unseen_by_drafter = list(prompt_ids)
        self.num_accepted = 0  # of the drafter's last answer
        self.hidden_rows: list[torch.Tensor] = []  # target hidden states the drafter has not seen yet
        self.sampling: SamplingParams | None = self._first_sampling()  # goes with the first verify only
        self.max_nodes, self.policy, self.draft_cut = self._policies()
        # Wall time runs from step to step, so the caller's streaming of a step's output counts
        # toward the next step's overhead.
        self.clock = time.perf_counter()
        self.last_drafter_call = time.monotonic()
        self.drafter_caught_up = False  # the drafter's first call reads the whole prompt
        self.step_cost = StepCost()
        self.grammar = self._grammar()
        self.waiting_since: float | None = None  # when the verifier first had no room for the current step

    def _first_sampling(self) -> SamplingParams:
        """The request's sampling, which the verifier keeps from the sequence's first step; a
        client's num_draft_tokens is checked against the drafter's config here."""
        sampling, config = self.req.sampling, self.drafter.info.config if self.speculate else None
        if config is not None and self.req.num_draft_tokens is not None:
            try:
                config.num_draft_tokens_for_request(self.req.num_draft_tokens)
            except ValueError as e:
                raise RequestError(str(e)) from e
        if config is not None and config.rejection_sample_method == "synthetic":
            sampling = replace(sampling, synthetic_acceptance_rates=tuple(config.synthetic_acceptance_rates))
        return sampling

    def _grammar(self) -> GrammarMatcher | None:
        """The request's grammar at the start of its output (compiled once per constraint, off
        this thread; a constraint that cannot be compiled is this request's GrammarError)."""
        spec = self.req.structured
        if spec is None:
            return None
        if self.ctx.grammars is None:
            raise RequestError(f"structured outputs ({spec.kind}) are not served here: no grammar compiler")
        return self.ctx.grammars.matcher(spec, self.req.forced_drafts)

    def _policies(self) -> tuple[int, DraftPolicy | None, DraftCut | None]:
        """A tree-drafting config's node budget, the draft-shape policy (plain, a chain or a
        tree, and its depth) and the cut of each scored draft to the nodes that pay. A seeded
        sampled request keeps a fixed shape: the policy follows timings, and a different k
        would change which random draws each token uses (no reproducibility)."""
        if not self.speculate:
            return 0, None, None
        info = self.drafter.info
        max_nodes = info.config.max_tree_nodes(info.num_speculative_tokens)
        if not (self.ctx.adaptive and self.req.num_draft_tokens is None and not seeded(self.req)):
            return max_nodes, None, None
        tree_nodes = info.config.max_tree_nodes if max_nodes else None
        policy = DraftPolicy(info.num_speculative_tokens, tree_nodes, history=self.ctx.draft_history)
        return max_nodes, policy, DraftCut(policy.verify)

    @property
    def prefilling(self) -> bool:
        """A chunk of a long prompt (not its last) is due: it goes to the verifier alone."""
        return 0 < self.ctx.prefill_chunk < len(self.unseen_by_verifier)

    def prefill(self) -> StepOutput | None:
        """Send the next chunk of the prompt to the verifier: a step that emits nothing. The
        first chunk starts the sequence (the sampling, and the most it may emit after it, the
        rest of the prompt included). None: the verifier has no room for it now (`wait`)."""
        chunk = self.unseen_by_verifier[: self.ctx.prefill_chunk]
        max_new = self.req.max_tokens + len(self.unseen_by_verifier) - len(chunk) if self.sampling else None
        result = self.verifier.verify(
            VerifyRequest(
                self.seq_id, chunk, [], self.sampling, self.layer_ids, max_new_tokens=max_new, prefill_only=True
            )
        )
        if result.waiting:
            return None
        self.waiting_since = None
        self.unseen_by_verifier = self.unseen_by_verifier[self.ctx.prefill_chunk :]
        self.stats.verify_s += result.forward_s
        if result.hidden_states is not None and self.speculate:
            self.hidden_rows.append(result.hidden_states)
        self.sampling = None
        self._lap()
        hidden = result.hidden_states if self.extract_layer_ids else None
        return StepOutput([], "", None, hidden, prompt_logprobs=result.prompt_logprobs)

    def plan(self) -> StepPlan:
        """This step's k (draft_length) and tree size, and whether the drafter is called."""
        # One verify step emits up to k + 1 tokens; never past max_tokens or the window.
        window = self.ctx.max_model_len - self.num_seq_tokens
        room = min(self.req.max_tokens - self.num_generated, window) - 1
        limit = draft_length(self.req, self.drafter.info, self.ctx.load(), room) if self.speculate else 0
        shape = self.policy.next_shape(limit) if self.policy else Shape(limit, tree=bool(self.max_nodes))
        k = shape.depth
        # the tree must fit the window too
        nodes = min(self.drafter.info.config.max_tree_nodes(k), window - 1) if k > 0 and shape.tree else 0
        # A k = 0 call now and then keeps the drafter's sequence alive in Triton's sequence
        # batcher (it forgets a sequence idle for max_sequence_idle_microseconds).
        call_drafter = k > 0 or (self.speculate and time.monotonic() - self.last_drafter_call > DRAFTER_KEEPALIVE_S)
        steady = not self.unseen_by_verifier and (self.drafter_caught_up or not call_drafter)
        return StepPlan(k, min(max(room, 0), MAX_SPEC_LEN), nodes, call_drafter, steady)

    def draft(self, plan: StepPlan) -> Drafted:
        """The drafts of this step (none without a drafter call), cut to the part of a scored
        tree that pays."""
        drafted = Drafted()
        if not plan.call_drafter:
            return drafted
        self.last_drafter_call = time.monotonic()
        start = time.perf_counter()
        # Until the prompt's last chunk is verified, earlier chunks' hidden states wait: the
        # drafter gets the whole prompt's at once, as when it is prefilled in one step.
        hidden = torch.cat(self.hidden_rows) if self.hidden_rows and not self.unseen_by_verifier else None
        sampling = self.req.sampling
        call = DraftCall(
            self.seq_id,
            self.unseen_by_drafter,
            plan.num_draft_tokens,
            hidden,
            sampling.temperature,
            self.num_accepted,
            sampling.seed,
            plan.num_nodes,
        )
        try:
            drafted.draft, drafted.draft_s = self.drafter.draft(call)
        except Exception as e:  # the target decides every token: carry on without drafts
            log.warning("sequence %d: drafter failed, decoding plainly from here: %s", self.seq_id, e)
            self.stats.fallback, self.speculate, self.layer_ids = f"drafter failed: {e}", False, self.extract_layer_ids
        drafted.wall_s = time.perf_counter() - start
        drafted.num_new = len(self.unseen_by_drafter)
        self.unseen_by_drafter, self.drafter_caught_up = [], True
        if hidden is not None:
            self.hidden_rows = []
        draft = drafted.draft
        if self.policy and draft.parents is not None:  # what the tree's chain would have drafted
            drafted.chain = [
                draft.token_ids[i] for i in DraftTree(tuple(draft.token_ids), tuple(draft.parents)).first_path()
            ]
        if self.draft_cut and draft.scores:  # verify the best-scored nodes that pay
            drafted.draft = draft.best(self.draft_cut.cut(draft.scores, drafted.wall_s))
            drafted.num_cut = len(draft.token_ids) - len(drafted.draft.token_ids)
        return drafted

    def verify(self, plan: StepPlan, drafted: Drafted) -> VerifyResult:
        """The verifier's answer to the new tokens and the drafts; the step goes into the
        statistics and, if steady, the draft-length policies. A `waiting` answer changes
        nothing: `wait`, then send the same step again."""
        draft, mask, from_drafter = self._constrain(plan, drafted.draft)
        start = time.perf_counter()
        result = self.verifier.verify(
            VerifyRequest(
                self.seq_id,
                self.unseen_by_verifier,
                draft.token_ids,
                self.sampling,
                self.layer_ids,
                draft.probs,
                self.req.max_tokens if self.sampling else None,
                draft.parents if draft.token_ids else None,
                token_mask=mask,
            )
        )
        if result.waiting:
            return result
        self.waiting_since = None
        verify_cost = self.step_cost(result.forward_s, time.perf_counter() - start, self.ctx.load())
        if result.hidden_states is not None and self.speculate:
            self.hidden_rows.append(result.hidden_states)
        num_drafts, num_emitted = len(draft.token_ids), len(result.token_ids)
        accepted_from_drafter = self._accepted_from_drafter(draft, result.token_ids, from_drafter)
        if plan.call_drafter:
            self.num_accepted = accepted_from_drafter
        self.unseen_by_verifier, self.sampling = [], None
        self.stats.record(num_drafts, num_emitted, drafted.draft_s, result.forward_s)
        if self.policy and plan.steady:
            self._teach(plan, drafted, result.token_ids, from_drafter, accepted_from_drafter, verify_cost)
        return result

    @staticmethod
    def _accepted_from_drafter(draft: Draft, emitted: list[int], from_drafter: int) -> int:
        """How many accepted drafts the drafter made: forced tokens come after its drafts (a
        chain's last, a tree's last nodes), so the accepted ones among its first nodes."""
        if draft.parents is None or from_drafter == len(draft.token_ids):
            return min(len(emitted) - 1, from_drafter)
        path = DraftTree(tuple(draft.token_ids), tuple(draft.parents)).walk(emitted[:-1])
        return sum(node < from_drafter for node in path)

    def _teach(
        self, plan: StepPlan, drafted: Drafted, emitted: list[int], drafts: int, accepted: int, verify_s: float
    ) -> None:
        """A steady step into the draft-shape policy. A drafter call that caught up on a pause
        (more new tokens than a step emits) is not timed: its extra rows are the pause's, paid
        once, not what drafting costs a step."""
        draft_s = drafted.wall_s if drafted.num_new <= self.policy.max_k + 1 else None
        if not plan.num_nodes or drafted.draft.parents is None:
            self.policy.record(plan.num_draft_tokens, drafts, accepted, verify_s, draft_s, drafted.num_cut)
            return
        # The chain of first children, as far as the emitted tokens tell: where every emitted
        # token matched it, its later drafts were never tried.
        chain = drafted.chain
        matched = next((i for i, (a, b) in enumerate(zip(chain, emitted)) if a != b), min(len(chain), len(emitted)))
        tried = matched + 1 if matched < min(len(chain), len(emitted)) else matched
        self.policy.record_tree(plan.num_draft_tokens, drafts, len(emitted), (tried, matched), verify_s, draft_s)

    def _constrain(self, plan: StepPlan, draft: Draft) -> tuple[Draft, torch.Tensor | None, int]:
        """Under a grammar: the drafts it allows, then the tokens it forces (free drafts), and
        the mask of every row the verifier samples. Also how many drafts are the drafter's."""
        if self.grammar is None:
            return draft, None, len(draft.token_ids)
        start = time.perf_counter()
        draft, from_drafter = self.grammar.constrain(draft, plan.room)
        mask = self.grammar.masks(draft)
        self.stats.grammar_s += time.perf_counter() - start
        return draft, mask, from_drafter

    def emit(self, result: VerifyResult) -> StepOutput:
        """The verified tokens that go out, up to the first that ends the output, with their text."""
        finish, taken = None, []
        for token in result.token_ids:
            taken.append(token)
            finish = self._append(token)
            if finish:
                break
        self.unseen_by_drafter += taken
        if self.grammar is not None:
            self.grammar.advance(taken)
        self._lap()
        return StepOutput(
            taken,
            self.text.take(final=finish is not None),
            finish,
            result.hidden_states if self.extract_layer_ids else None,
            result.logprobs and result.logprobs[: len(taken)],
            result.prompt_logprobs,
        )

    def _append(self, token: int) -> str | None:
        """Add one verified token to the output; why the output ends with it, if it does: EOS
        or a stop token (neither in the text), a stop string, max_tokens, the context window."""
        req = self.req
        self.num_generated += 1
        self.num_seq_tokens += 1
        if (token in self.ctx.eos_token_ids and not req.ignore_eos) or token in req.stop_token_ids:
            return "stop"
        self.text.add(token)
        if self.text.stopped:
            return "stop"
        if self.num_generated >= req.max_tokens or self.num_seq_tokens >= self.ctx.max_model_len:
            return "length"
        return None

    def wait(self) -> None:
        """The verifier has no room in its KV pool for this sequence's step now (it waits in
        the admission queue, or to resume after a preemption): pause before sending it again;
        AdmissionTimeoutError once it has waited max_queue_time_s."""
        now = time.monotonic()
        if self.waiting_since is None:
            self.waiting_since = now
        elif now - self.waiting_since >= self.ctx.max_queue_time_s:
            raise AdmissionTimeoutError(
                f"KV cache budget full: the request waited {now - self.waiting_since:.1f} s (max_queue_time_s) "
                "for room in the target's KV pool, busy with other requests; retry later, or raise "
                "kv_cache_memory_gb / max_queue_time_s"
            )
        time.sleep(ADMISSION_POLL_S)

    def _lap(self) -> None:
        now = time.perf_counter()
        self.stats.total_s += now - self.clock
        self.clock = now


def generate(gen: Generation, is_cancelled: Callable[[], bool] = lambda: False) -> Iterator[StepOutput]:
    """One StepOutput per step, until one has a finish_reason: draft -> verify -> emit, after
    the prompt's chunks when it is long (ServingContext.prefill_chunk)."""
    while True:
        if is_cancelled():
            yield StepOutput([], "", "cancelled")
            return
        if gen.prefilling:
            chunk = gen.prefill()
            if chunk is None:
                gen.wait()
            else:
                yield chunk
            continue
        plan = gen.plan()
        drafted = gen.draft(plan)
        while (result := gen.verify(plan, drafted)).waiting:  # the same step again, once there is room
            if is_cancelled():
                yield StepOutput([], "", "cancelled")
                return
            gen.wait()
        step = gen.emit(result)
        yield step
        if step.finish_reason:
            return
