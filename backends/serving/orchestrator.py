"""The speculative decoding loop: draft -> verify -> accept -> emit, until EOS, a stop
string, max_tokens or the end of the context window.

It only sees two small interfaces, so the same loop runs over Triton BLS calls in the
server and over in-process objects in tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from backends.serving.adaptive import AdaptiveDraftLength, StepCost, TreeCut
from backends.serving.detokenize import TextStream
from backends.serving.drafting import DraftCall
from backends.serving.logits import TokenLogprob
from backends.serving.proposer import Draft, DrafterInfo
from backends.serving.rejection import AcceptanceStats
from backends.serving.request import GenerationRequest, RequestError, SamplingParams
from backends.serving.target import VerifyRequest, VerifyResult

log = logging.getLogger("tritonspec.orchestrator")
DRAFTER_KEEPALIVE_S = 30.0  # a quarter of the peers' max_sequence_idle_microseconds (120 s)


class Drafter(Protocol):
    """The drafter side of the step contract: a DraftCall in (the tokens since the last call,
    the final k and tree size, how many drafts of the last answer were accepted, the target's
    hidden rows, the request's temperature and seed), the drafts out."""

    info: DrafterInfo  # what it is (method, k, layers), known before the first request

    def draft(self, call: DraftCall) -> tuple[Draft, float]:
        """Up to `call.num_tokens` levels of drafts (a chain, or a tree of at most
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


def _whole_tokens(name: str, value: str, least: int, meaning: str) -> int:
    """A config parameter that counts tokens: a whole number >= `least` (ValueError naming it)."""
    try:
        tokens = int(value)
    except ValueError:
        tokens = least - 1
    if tokens < least:
        raise ValueError(f"{name} must be a whole number of tokens >= {least} ({meaning}), got {value!r}")
    return tokens


def stream_interval(value: str) -> int:
    """The `stream_interval` parameter: tokens per streamed response, a whole number >= 1."""
    return _whole_tokens("stream_interval", value, 1, "1: every step")


def coalesce(steps: Iterable[StepOutput], interval: int) -> Iterator[StepOutput]:
    """Steps merged so that each carries at least `interval` tokens (vLLM's and SGLang's
    `--stream-interval`): the first tokens and the last step go out as soon as they come, the
    rest waits for company. Each streamed response costs the server process work of its own
    (gRPC/HTTP encoding, the Python backend's IPC) beside the forward on the same cores, so
    fewer, fuller responses leave more of them to decoding. 1: every step with tokens as it
    comes (steps without any, a prompt chunk's, join the next)."""
    held: list[StepOutput] = []
    held_tokens, started = 0, False
    for step in steps:
        held.append(step)
        held_tokens += len(step.token_ids)
        if step.finish_reason is not None or held_tokens >= interval or (held_tokens and not started):
            yield held[0] if len(held) == 1 else _merge(held)
            started = started or held_tokens > 0
            held, held_tokens = [], 0


def _merge(steps: list[StepOutput]) -> StepOutput:
    hidden = [s.hidden_states for s in steps if s.hidden_states is not None]
    with_logprobs = any(s.logprobs is not None for s in steps)
    return StepOutput(
        [token for s in steps for token in s.token_ids],
        "".join(s.text for s in steps),
        steps[-1].finish_reason,
        torch.cat(hidden) if hidden else None,
        [entry for s in steps for entry in s.logprobs or []] if with_logprobs else None,
    )


# Prompt tokens per verifier step when prefilling a long prompt. Served on SmolLM2-135M bf16
# here (scripts/bench_prefill_stall.py), a 2450-token prompt stalled a running stream for
# 9.2-9.6 s in one step, 1.1-1.9 s with 256-token chunks and 0.7-0.8 s with 128, and itself
# took 9.7-10.1 s, 7.8 s and 7.6-7.9 s: chunks cost nothing (attention over one long pass
# costs more than the extra weight passes).
DEFAULT_PREFILL_CHUNK = 128


def prefill_chunk_tokens(value: str) -> int:
    """The `prefill_chunk_tokens` parameter: a positive number of tokens, or 0 (no chunking)."""
    return _whole_tokens("prefill_chunk_tokens", value, 0, "0: no chunking")


def check_lengths(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens >= max_model_len:
        raise RequestError(
            f"the prompt has {num_prompt_tokens} tokens, but the context window is "
            f"{max_model_len} tokens (room is needed for at least one output token)"
        )
    if max_tokens > max_model_len:
        raise RequestError(f"max_tokens={max_tokens} is above the model's limit of {max_model_len}")


def draft_length(
    req: GenerationRequest, info: DrafterInfo, load: int, room: int, policy: AdaptiveDraftLength | None
) -> int:
    """The one place a step's k is decided: the client's num_draft_tokens (validated at the
    start of the request) or the configured k; the batch-size schedule at the current load,
    except for a seeded request, whose output must not depend on who else is served; the
    adaptive policy; the room left in max_tokens and the context window."""
    k = info.config.num_tokens_for_request(req.num_draft_tokens)
    if not seeded(req):
        k = min(k, info.config.num_tokens_for_batch_size(max(1, load)))
    room = min(room, k)
    return policy.next_k(room) if policy else room


def seeded(req: GenerationRequest) -> bool:
    return not req.sampling.greedy and req.sampling.seed is not None


def prefill(
    verifier: Verifier,
    seq_id: int,
    chunk: list[int],
    sampling: SamplingParams | None,
    max_new_tokens: int | None,
    layer_ids: tuple[int, ...],
    stats: GenerationStats,
) -> torch.Tensor | None:
    """Send one chunk of a long prompt (not its last) to the verifier; its hidden states.
    The first chunk starts the sequence (`sampling` and `max_new_tokens`: everything after it,
    the rest of the prompt included, which its KV reservation must cover)."""
    result = verifier.verify(
        VerifyRequest(seq_id, chunk, [], sampling, layer_ids, max_new_tokens=max_new_tokens, prefill_only=True)
    )
    stats.verify_s += result.forward_s
    return result.hidden_states


def generate(
    req: GenerationRequest,
    prompt_ids: list[int],
    seq_id: int,
    verifier: Verifier,
    drafter: Drafter | None,
    text: TextStream,
    eos_token_ids: set[int],
    max_model_len: int,
    stats: GenerationStats,
    is_cancelled: Callable[[], bool] = lambda: False,
    adaptive: bool = True,
    extract_layer_ids: tuple[int, ...] = (),
    load: Callable[[], int] = lambda: 1,
    prefill_chunk: int = 0,
) -> Iterator[StepOutput]:
    """Yield one StepOutput per speculative step; the last one has a finish_reason.
    The caller releases the sequence in the drafter and verifier afterwards.

    With `adaptive`, each step's draft length follows this sequence's acceptance and
    measured step times (backends.serving.adaptive); a client's explicit num_draft_tokens, and
    any seeded sampled request, use a fixed length instead. `extract_layer_ids`: each step
    also yields the target's hidden states of these layers (extract_hidden_states). `load`:
    the number of requests being served now (the batch-size schedule). `prefill_chunk`: a
    prompt longer than this goes to the verifier in chunks of at most this many tokens, one
    verifier step each, so other sequences' steps run in between (0: in one step). A drafter that fails
    turns speculation off for the rest of the request (`stats.fallback` says why): the
    output is the target's either way."""
    check_lengths(len(prompt_ids), req.max_tokens, max_model_len)
    speculate = drafter is not None and drafter.info.proposes_drafts and req.num_draft_tokens != 0
    if req.num_draft_tokens == 0:  # plain decoding for this request: nothing extracted either
        extract_layer_ids = ()
    if speculate and req.num_draft_tokens is not None:
        try:
            drafter.info.config.num_tokens_for_request(req.num_draft_tokens)
        except ValueError as e:
            raise RequestError(str(e)) from e
    num_tokens = len(prompt_ids)
    num_generated = 0
    unseen_by_verifier = list(prompt_ids)
    unseen_by_drafter = list(prompt_ids)
    num_accepted = 0  # of the drafter's last answer
    sampling: SamplingParams | None = req.sampling
    if speculate and drafter.info.config.rejection_sample_method == "synthetic":
        sampling = replace(sampling, synthetic_acceptance_rates=tuple(drafter.info.config.synthetic_acceptance_rates))
    # A seeded sampled request keeps a fixed draft length: adaptive k follows timings, and a
    # different k would change which random draws each token uses (no reproducibility).
    adapt = speculate and adaptive and req.num_draft_tokens is None and not seeded(req)
    # A tree-drafting config keeps its depth (k); each step verifies the part of its tree that pays.
    max_nodes = drafter.info.config.max_tree_nodes(drafter.info.num_speculative_tokens) if speculate else 0
    policy = AdaptiveDraftLength(drafter.info.num_speculative_tokens) if adapt and not max_nodes else None
    tree_policy = TreeCut() if adapt and max_nodes else None
    layer_ids = extract_layer_ids or (drafter.info.hidden_layer_ids if speculate else ())
    hidden_rows: list[torch.Tensor] = []  # target hidden states the drafter has not seen yet
    # Wall time runs from step to step, so the caller's streaming of a step's output counts
    # toward the next step's overhead.
    clock = time.perf_counter()
    last_drafter_call = time.monotonic()
    drafter_caught_up = False  # the drafter's first call reads the whole prompt
    step_cost = StepCost()
    while True:
        if is_cancelled():
            yield StepOutput([], "", "cancelled")
            return
        if 0 < prefill_chunk < len(unseen_by_verifier):
            chunk, unseen_by_verifier = unseen_by_verifier[:prefill_chunk], unseen_by_verifier[prefill_chunk:]
            max_new = req.max_tokens + len(unseen_by_verifier) if sampling else None
            hidden = prefill(verifier, seq_id, chunk, sampling, max_new, layer_ids, stats)
            if hidden is not None and speculate:
                hidden_rows.append(hidden)
            sampling = None
            now = time.perf_counter()
            stats.total_s += now - clock
            clock = now
            yield StepOutput([], "", None, hidden if extract_layer_ids else None)
            continue
        # One verify step emits up to k + 1 tokens; never past max_tokens or the window.
        room = min(req.max_tokens - num_generated, max_model_len - num_tokens) - 1
        k = draft_length(req, drafter.info, load(), room, policy) if speculate else 0
        nodes = 0  # tree nodes asked for (0: a chain); the tree must fit the window too
        if k > 0 and max_nodes:
            nodes = min(drafter.info.config.max_tree_nodes(k), max_model_len - num_tokens - 1)
        draft, draft_s, draft_wall = Draft(), 0.0, 0.0
        # A k = 0 call now and then keeps the drafter's sequence alive in Triton's sequence
        # batcher (it forgets a sequence idle for max_sequence_idle_microseconds).
        call_drafter = k > 0 or (speculate and time.monotonic() - last_drafter_call > DRAFTER_KEEPALIVE_S)
        # A step that also reads the prompt (the verifier's last chunk, the drafter's first
        # call) costs what the prompt costs: its times would teach the draft-length policy
        # that drafting never pays, so only steady steps are recorded.
        steady = not unseen_by_verifier and (drafter_caught_up or not call_drafter)
        if call_drafter:
            last_drafter_call = time.monotonic()
            start = time.perf_counter()
            # Until the prompt's last chunk is verified, earlier chunks' hidden states wait: the
            # drafter gets the whole prompt's at once, as when it is prefilled in one step.
            hidden_in = torch.cat(hidden_rows) if hidden_rows and not unseen_by_verifier else None
            try:
                draft, draft_s = drafter.draft(
                    DraftCall(
                        seq_id,
                        unseen_by_drafter,
                        k,
                        hidden_in,
                        req.sampling.temperature,
                        num_accepted,
                        req.sampling.seed,
                        nodes,
                    )
                )
            except Exception as e:  # the target decides every token: carry on without drafts
                log.warning("sequence %d: drafter failed, decoding plainly from here: %s", seq_id, e)
                stats.fallback, speculate, layer_ids = f"drafter failed: {e}", False, extract_layer_ids
                draft, draft_s = Draft(), 0.0
            draft_wall = time.perf_counter() - start
            unseen_by_drafter = []
            drafter_caught_up = True
            if hidden_in is not None:
                hidden_rows = []
        if tree_policy and draft.scores:  # verify the best-scored nodes that pay
            draft = draft.best(tree_policy.cut(draft.scores, draft_wall))
        start = time.perf_counter()
        drafts = draft.token_ids
        result = verifier.verify(
            VerifyRequest(
                seq_id,
                unseen_by_verifier,
                drafts,
                sampling,
                layer_ids,
                draft.probs,
                req.max_tokens if sampling else None,
                draft.parents if drafts else None,
            )
        )
        emitted, verify_s, hidden, logprobs = result.token_ids, result.forward_s, result.hidden_states, result.logprobs
        verify_wall = time.perf_counter() - start
        verify_cost = step_cost(verify_s, verify_wall, load())
        if hidden is not None and speculate:
            hidden_rows.append(hidden)
        if call_drafter:
            num_accepted = len(emitted) - 1 if drafts else 0
        unseen_by_verifier, sampling = [], None
        stats.record(len(drafts), len(emitted), draft_s, verify_s)
        if policy and steady:
            policy.record(k, len(drafts), len(emitted) - 1, verify_cost, draft_wall)
        if tree_policy and steady:
            tree_policy.record(len(drafts), verify_cost)

        finish = None
        taken: list[int] = []
        for token in emitted:
            taken.append(token)
            num_generated += 1
            num_tokens += 1
            if (token in eos_token_ids and not req.ignore_eos) or token in req.stop_token_ids:
                finish = "stop"
                break
            text.add(token)
            if text.stopped:
                finish = "stop"
                break
            if num_generated >= req.max_tokens or num_tokens >= max_model_len:
                finish = "length"
                break
        unseen_by_drafter += taken
        now = time.perf_counter()
        stats.total_s += now - clock
        clock = now
        yield StepOutput(
            taken,
            text.take(final=finish is not None),
            finish,
            hidden if extract_layer_ids else None,
            logprobs and logprobs[: len(taken)],
        )
        if finish:
            return
