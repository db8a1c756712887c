"""The orchestrator's peers: its handles on the verifier and the drafter, where the placement
plan (topology.py) puts them. `Peers` builds at load what every request shares (the step
batcher, over BLS or on the verifier's target loaded in this process; a drafter drafting in this
process, or beside that target) and hands each request its handles: a `BlsVerifier` (the
verifier model over BLS, one request a step, or the step batcher, step_batch.py), and a
`BlsDrafter` (the drafter model over BLS: START on the first call, END on release) or the
drafter in this process. They implement the `Drafter` / `Verifier` protocols of
backends.serving.orchestrator."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np
import torch

from backends.config import SpeculativeConfig
from backends.runtime.device import resolve_device
from backends.runtime.threads import forward_thread, started_pool
from backends.serving.drafting import DraftCall, DraftService
from backends.serving.local import LocalDrafter
from backends.serving.logits import LOGPROB_OUTPUTS, PROMPT, PROMPT_LOGPROB_OUTPUTS, logprobs_from_arrays
from backends.serving.orchestrator import Drafter
from backends.serving.proposer import Draft, DrafterInfo, build_proposer, check_layers
from backends.serving.target import VerifyRequest, VerifyResult
from backends.triton_models.common import SEQUENCE_END, SEQUENCE_START, ActiveSequencesGauge, bls
from backends.triton_models.metrics import EngineMetrics, ServingMetrics
from backends.triton_models.outbox import Outbox
from backends.triton_models.pbtxt import ModelSettings, instance_group, model_settings, parameters
from backends.triton_models.peer_token import server_token, with_token
from backends.triton_models.step_batch import GatheredDrafter, StepBatcher, batch_correlation_id, in_process, over_bls
from backends.triton_models.topology import DraftAt, Placement, PlacementError, VerifyAt
from backends.triton_models.verifier_serving import target_runner

log = logging.getLogger("tritonspec.speculative")


class DrafterBuildError(RuntimeError):
    """A head that drafts beside this process's verifier, with nothing else to draft, cannot be
    built: the model's load fails with this."""


class PeerTimeoutError(TimeoutError):
    """A peer model did not answer a call in time (the orchestrator then decodes plainly)."""


@functools.cache
def _bounded_calls() -> ThreadPoolExecutor:
    """Where bounded BLS calls (drafter calls, and verify steps under step_timeout_s) run: room
    for each of the `speculative` model's 64 workers to have one of each in flight, started at
    load (Peers) where a bound is set."""
    return started_pool(128, "bls-bounded")


class SequencePeer:
    """A sequence-batched BLS peer: START on the first call, END on release. Every call carries
    `token`, this server's internal token (peer_token.py): the peers refuse requests without it.
    A call that takes longer than `timeout_s` (None: no bound) is abandoned: a BLS call cannot
    be cancelled in this Triton, so a bounded one runs on a helper thread that is left to
    finish on its own."""

    def __init__(self, model_name: str, seq_id: int, token: str, timeout_s: float | None = None) -> None:
        self.model_name = model_name
        self.seq_id = seq_id
        self.token = token
        self.timeout_s = timeout_s
        self.started = False

    def call(self, inputs: dict, outputs: list[str], parameters: dict | None = None) -> dict:
        flags = 0 if self.started else SEQUENCE_START
        self.started = True
        return self._exec(inputs, outputs, flags, parameters)

    def release(self, empty_inputs: dict) -> None:
        if self.started:
            self.started = False
            self._exec(empty_inputs, [], SEQUENCE_END, None)

    def _exec(self, inputs: dict, outputs: list[str], flags: int, parameters: dict | None) -> dict:
        args = (self.model_name, inputs, outputs, self.seq_id, flags, with_token(parameters, self.token))
        return bounded_bls(args, self.timeout_s)


def bounded_bls(args: tuple, timeout_s: float | None) -> dict:
    """common.bls(*args), abandoned after `timeout_s` (None: no bound) with PeerTimeoutError:
    a BLS call cannot be cancelled in this Triton, so a bounded one runs on a helper thread
    that is left to finish on its own."""
    if timeout_s is None:
        return bls(*args)
    try:
        return _bounded_calls().submit(bls, *args).result(timeout=timeout_s)
    except FutureTimeout:
        raise PeerTimeoutError(f"{args[0]} did not answer within {timeout_s:g} s") from None


def watchdog(run_rows: Callable[[list], list], on_hang: Callable[[str], None]) -> Callable[[list], list]:
    """`run_rows` that reports a verify step past its timeout to `on_hang` (the server is then
    not ready: every later step would wait behind the hung one) before its rows fail."""

    def run(rows: list) -> list:
        try:
            return run_rows(rows)
        except PeerTimeoutError as e:
            on_hang(hung(e))
            raise

    return run


def hung(e: PeerTimeoutError) -> str:
    return f"a verify step hung: {e} (parameter step_timeout_s)"


class BlsDrafter(SequencePeer):
    def __init__(self, model_name: str, seq_id: int, info: DrafterInfo, token: str, timeout_s: float | None) -> None:
        super().__init__(model_name, seq_id, token, timeout_s)
        self.info = info

    def draft(self, call: DraftCall) -> tuple[Draft, float]:
        inputs = self._inputs(call.new_token_ids, call.num_draft_tokens)
        inputs["num_accepted_drafts"] = np.array([[call.num_accepted]], dtype=np.int32)
        inputs["temperature"] = np.array([[call.temperature]], dtype=np.float32)
        if call.seed is not None:
            inputs["random_seed"] = np.array([[call.seed]], dtype=np.int64)
        if call.hidden_states is not None:
            inputs["hidden_states"] = call.hidden_states.numpy()[None]
        if call.num_nodes:
            inputs["num_draft_nodes"] = np.array([[call.num_nodes]], dtype=np.int32)
        out = self.call(inputs, ["draft_ids", "propose_ms", "draft_probs", "draft_parents", "draft_scores"])
        probs, parents, scores = out.get("draft_probs"), out.get("draft_parents"), out.get("draft_scores")
        draft = Draft(
            out["draft_ids"].reshape(-1).tolist(),
            None if probs is None else torch.from_numpy(probs.reshape(probs.shape[-2:])),
            None if parents is None else parents.reshape(-1).tolist(),
            None if scores is None else scores.reshape(-1).tolist(),
        )
        return draft, float(out["propose_ms"].item()) / 1e3

    @staticmethod
    def _inputs(token_ids: list[int], num_draft_tokens: int) -> dict:
        return {
            "input_ids": np.array([token_ids], dtype=np.int64),
            "num_draft_tokens": np.array([[num_draft_tokens]], dtype=np.int32),
        }

    def release(self, seq_id: int | None = None) -> None:
        super().release(self._inputs([], 0))


class BlsVerifier(SequencePeer):
    """The verifier model over BLS, one request a step, or `batcher` (step_batch.py): its steps
    with other sequences', to the verifier model or to the target in this process. A sequence
    that asks for logprobs (of its output or its prompt) makes one request a step, unless the
    batcher carries them."""

    def __init__(
        self,
        model_name: str,
        seq_id: int,
        token: str,
        batcher: StepBatcher | None,
        timeout_s: float | None = None,
        on_hang: Callable[[str], None] = lambda reason: None,
    ) -> None:
        super().__init__(model_name, seq_id, token, timeout_s)
        self.on_hang = on_hang
        self.batcher = batcher
        self.batched: bool | None = None  # this sequence's steps go through the batcher (set by its first)
        self.logprobs = False  # the sequence asked for logprobs (its first step's sampling parameters)
        self.prompt_logprobs = False  # ... and for prompt logprobs

    def verify(self, req: VerifyRequest) -> VerifyResult:
        if self.batched is None:
            sampling = req.sampling
            logprobs = sampling is not None and (sampling.logprobs is not None or sampling.prompt_logprobs is not None)
            self.batched = self.batcher is not None and (self.batcher.carries_logprobs or not logprobs)
        if self.batched:
            return self.batcher.verify(req)
        # The first step carries the sequence's sampling parameters and its KV reservation.
        sampling = req.sampling
        params = {"sampling": sampling.to_json(), "max_new_tokens": req.max_new_tokens} if sampling else {}
        if req.prefill_only:
            params["prefill_only"] = True
        if sampling:
            self.logprobs = sampling.logprobs is not None
            self.prompt_logprobs = sampling.prompt_logprobs is not None
        inputs = self._inputs(req.new_token_ids, req.draft_token_ids)
        if req.draft_probs is not None:
            inputs["draft_probs"] = req.draft_probs.numpy()[None]
        if req.draft_parents is not None:
            inputs["draft_parents"] = np.array([req.draft_parents], dtype=np.int64)
        if req.token_mask is not None:
            inputs["token_mask"] = req.token_mask.numpy()[None]
        outputs = ["output_ids", "forward_ms"]
        if req.hidden_layer_ids:
            inputs["hidden_layer_ids"] = np.array([req.hidden_layer_ids], dtype=np.int32)
            outputs.append("hidden_states")
        if self.logprobs:
            outputs += LOGPROB_OUTPUTS
        if self.prompt_logprobs:
            outputs += PROMPT_LOGPROB_OUTPUTS
        try:
            out = self.call(inputs, outputs + ["waiting"], params or None)
        except PeerTimeoutError as e:
            self.on_hang(hung(e))
            raise
        if "waiting" in out and out["waiting"].any():  # no KV room now: send the step again later
            return VerifyResult([], 0, 0.0, waiting=True)
        hidden = out.get("hidden_states")
        token_ids = out["output_ids"].reshape(-1).tolist()
        scored = out.get("prompt_token_ids")  # only from a prompt step that scored tokens
        return VerifyResult(
            token_ids,
            max(len(token_ids) - 1, 0),  # a prefill chunk emits nothing
            float(out["forward_ms"].item()) / 1e3,
            None if hidden is None else torch.from_numpy(hidden.reshape(hidden.shape[-3:])),
            logprobs_from_arrays(token_ids, out) if self.logprobs else None,
            None if scored is None else logprobs_from_arrays(scored.reshape(-1).tolist(), out, PROMPT),
        )

    @staticmethod
    def _inputs(token_ids: list[int], draft_ids: list[int]) -> dict:
        return {"input_ids": np.array([token_ids], dtype=np.int64), "draft_ids": np.array([draft_ids], dtype=np.int64)}

    def release(self, seq_id: int | None = None) -> None:
        if self.batched:
            self.batcher.release(self.seq_id)
        else:
            super().release(self._inputs([], []))


class Peers:
    """The handles of orchestrator `model_name` on its verifier and drafter, where the plan puts
    them: built once at load, handed to each request (`verifier`, `drafter`). `drafter_info`
    may become None here (plain decoding) when the drafter model stands by for this process
    and its proposer cannot be built in it either."""

    def __init__(
        self,
        model_name: str,
        plan: Placement,
        drafter_config: SpeculativeConfig | None,
        drafter_info: DrafterInfo | None,
        max_model_len: int,
        outbox: Outbox,
        drafter_timeout_s: float | None,
        step_timeout_s: float | None = None,
        on_hang: Callable[[str], None] = lambda reason: None,
        serving_metrics: ServingMetrics | None = None,
    ) -> None:
        """A drafter call past `drafter_timeout_s` is abandoned (its request decodes plainly);
        a verify step past `step_timeout_s` fails its requests and is reported to `on_hang`;
        a verifier here reports its KV queue and preemptions to `serving_metrics`."""
        self.serving_metrics = serving_metrics
        self.model_name, self.plan, self.route = model_name, plan, plan.route(model_name)
        self.step_timeout_s, self.on_hang = step_timeout_s, on_hang
        self.drafter_config, self.drafter_info = drafter_config, drafter_info
        self.max_model_len = max_model_len
        self.outbox = outbox
        self.drafter_timeout_s = drafter_timeout_s  # a call that takes longer: the request decodes plainly
        self.token = server_token()  # proves our BLS calls to verifier and drafter
        if drafter_timeout_s is not None or step_timeout_s is not None:
            _bounded_calls()
        # The drafter in this process (ngram, suffix; or a head beside the in-process verifier).
        self.local_drafter: Drafter | None = None
        if drafter_info and self.route.draft_at is DraftAt.IN_PROCESS:
            self.local_drafter = self._drafting_here()
        self.batcher = self._step_batcher()

    def verifier(self, seq_id: int) -> BlsVerifier:
        return BlsVerifier(self.route.verifier, seq_id, self.token, self.batcher, self.step_timeout_s, self.on_hang)

    def drafter(self, seq_id: int) -> Drafter | None:
        """The request's drafter; None when there is none, or it drafts nothing (extract_hidden_states)."""
        info = self.drafter_info
        if info is None or not info.proposes_drafts:
            return None
        return self.local_drafter or BlsDrafter(self.route.drafter, seq_id, info, self.token, self.drafter_timeout_s)

    def _drafting_here(self) -> LocalDrafter | None:
        """The drafter's proposer (ngram, suffix) built in this process. When the drafter model
        stands by for this orchestrator alone, this one reports the sequences it holds under the
        drafter's name; if the proposer cannot be built here, `_not_drafting_here`."""
        name = self.route.drafter
        callers = self.plan.stands_by_for(name)
        try:
            proposer = build_proposer(self.drafter_config, max_model_len=self.max_model_len)
        except Exception as e:
            return self._not_drafting_here(name, e, callers)
        log.info("drafter %r drafts in this process (drafter_in_process)", name)
        active = ActiveSequencesGauge(name) if callers == (self.model_name,) else None
        return LocalDrafter(DraftService(proposer, self.drafter_config), None if active is None else active.set)

    def _not_drafting_here(self, name: str, error: Exception, callers: tuple[str, ...]) -> None:
        """The drafter cannot be built in this process: requests decode plainly when the drafter
        model stands by (it would not answer either), else they call it."""
        fallback = "serving plain decoding" if callers else "calling the drafter model"
        log.error("drafter %r cannot draft in this process (%s); %s", name, error, fallback)
        if callers:
            self.drafter_config, self.drafter_info = None, None

    def _step_batcher(self) -> StepBatcher | None:
        """Concurrent sequences' verify steps go as one batch (one forward): to the target in
        this process, or to the verifier model over BLS; None: one verifier request a step."""
        route = self.route
        if route.verify_at is VerifyAt.IN_PROCESS:
            return self._verifying_here()
        if route.verify_at is VerifyAt.PER_STEP:
            log.info("verify steps go to %r one request a step (%s)", route.verifier, route.why)
            return None

        def send(inputs: dict, outputs: list[str], parameters: dict) -> dict:
            flags = SEQUENCE_START | SEQUENCE_END  # a batch is a sequence of one request
            self.outbox.step_started()
            args = (route.verifier, inputs, outputs, batch_correlation_id(), flags, with_token(parameters, self.token))
            return bounded_bls(args, self.step_timeout_s)

        log.info("verify steps of concurrent sequences go to %r in batches", route.verifier)
        return StepBatcher(watchdog(over_bls(send), self.on_hang))

    def _verifying_here(self) -> StepBatcher:
        """The verifier's target, as its config.pbtxt describes it, loaded in this process: steps
        run here, one batch at a time (the batcher is the runner's only caller), with no BLS
        round trip. The verifier model stands by (topology.py)."""
        name = self.route.verifier
        pbtxt = self.plan.configs.get(name)
        if pbtxt is None:
            raise PlacementError(f"verifier_in_process: the model repository has no readable config of {name!r}")
        settings, device, why = peer_settings(pbtxt)
        log.info("verifying in this process (verifier_in_process): the target of %r on %s (%s)", name, device, why)
        # One thread loads the target and runs every forward, the process's only parallel
        # thread: OpenMP keeps a team of worker threads per calling thread, and with more of
        # them than cores its workers stop spinning between parallel regions (threads.py).
        verify_thread = forward_thread("spec-verify")
        runner = verify_thread.submit(target_runner, settings, device).result()
        active = ActiveSequencesGauge(name)
        engine_metrics = EngineMetrics(name, "1", runner, self.serving_metrics)
        engine_metrics.writer.wait_for_step = self.outbox.wait_for_step

        def update_metrics(steps: list) -> None:  # what the verifier model reports of its own sequences
            active.set(len(runner.sequences))
            engine_metrics.stepped(steps)
            engine_metrics.update()

        run_rows = in_process(runner, update_metrics)

        def verify_here(rows: list) -> list:  # on the verify thread, so responses wait until it runs
            self.outbox.step_started()
            return run_rows(rows)

        def draft_here(work: Callable[[], Any]) -> Any:  # responses due meanwhile wait for the verify
            with self.outbox.holding():
                return work()

        if self.drafter_info and self.route.draft_at is DraftAt.BESIDE_VERIFIER:
            self.local_drafter = self._drafting_beside(lambda work: verify_thread.submit(draft_here, work).result())

        def verify(rows: list) -> list:
            try:
                return verify_thread.submit(verify_here, rows).result(timeout=self.step_timeout_s)
            except FutureTimeout:
                raise PeerTimeoutError(f"the forward of {name!r}'s target ran past {self.step_timeout_s:g} s") from None

        return StepBatcher(watchdog(verify, self.on_hang), carries_logprobs=True)

    def _drafting_beside(self, run: Callable[[Callable[[], Any]], Any]) -> GatheredDrafter | None:
        """The drafter's head loaded in this process, as its config.pbtxt describes it, drafting
        on the verify thread (`run` puts work there): a step then makes no BLS round trip at all
        (~1 ms each here). If it cannot be built, this model's load fails with the reason when
        the drafter model stands by (nothing else would draft), else `_not_drafting_here`."""
        name = self.route.drafter
        callers = self.plan.stands_by_for(name)
        try:
            settings, device, _ = peer_settings(self.plan.configs[name])
            proposer = run(
                lambda: build_proposer(
                    self.drafter_config,
                    max_model_len=self.max_model_len,
                    target_model=settings.target,
                    dtype=settings.dtype,
                    device=device,
                )
            )
            check_layers(proposer, self.drafter_info)
        except Exception as e:
            if callers:  # a bad head is refused by name, as the drafter model's own load did
                raise DrafterBuildError(
                    f"drafter {name!r}: its head cannot be built in this process, where it drafts beside "
                    f"the verifier (the drafter model stands by): {e}"
                ) from e
            return self._not_drafting_here(name, e, callers)
        log.info("drafter %r drafts in this process, beside the verifier, on %s (drafter_in_process)", name, device)
        return GatheredDrafter(DraftService(proposer, self.drafter_config), run)


def peer_settings(pbtxt: str) -> tuple[ModelSettings, str, str]:
    """A peer model's settings from its config.pbtxt, and the device it would run on (and why):
    what the orchestrator loads when it verifies or drafts in its own process."""
    settings = model_settings(parameters(pbtxt))
    kind, gpu = instance_group(pbtxt)
    device, why = resolve_device(kind, gpu, settings.params.get("device", ""))
    return settings, device, why
