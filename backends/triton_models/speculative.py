"""`speculative` model: the client-facing, decoupled orchestrator. Each request is served in
its own worker thread: its input tensors are read into a GenerationRequest, a
`backends.serving.session.Session` runs the draft -> verify loop over it with the verifier and
drafter handles of `peers.Peers` (the `verifier` and `drafter` models over (non-decoupled) BLS,
or, where the placement plan says so (topology.py: `verifier_in_process`, `drafter_in_process`),
the verifier's target and the drafter in this process), and its replies go back as Triton
responses."""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.config import SpeculativeConfig
from backends.runtime.gc_heap import freeze_startup_heap
from backends.runtime.model_store import context_window, load_tokenizer, model_config
from backends.runtime.threads import serial_elsewhere, started_pool
from backends.serving.cancellation import CancellationWatch
from backends.serving.orchestrator import Drafter, GenerationStats, ServingContext, Verifier
from backends.serving.parameters import DEFAULT_PREFILL_CHUNK, max_queue_time_s, prefill_chunk_tokens, stream_interval
from backends.serving.proposer import DrafterInfo, describe_drafter
from backends.serving.request import RETURN_OUTPUTS, GenerationRequest, RequestError, parse_request
from backends.serving.session import ServedModel, Session
from backends.structured.grammar import GrammarCompiler
from backends.triton_models.admission import UNAVAILABLE, Admission, drain_file
from backends.triton_models.common import error_response, initialize_model, input_scalar, model_repository, parse_flag
from backends.triton_models.metrics import ServingMetrics, SpecDecodeCounters
from backends.triton_models.outbox import Outbox
from backends.triton_models.pbtxt import get_parameter
from backends.triton_models.peers import Peers
from backends.triton_models.topology import Placement

log = logging.getLogger("tritonspec.speculative")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
TENSOR_INPUTS = (
    "text_input",
    "stream",
    "stream_interval",
    "exclude_input_in_output",
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "random_seed",
    "num_draft_tokens",
    "ignore_eos",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "min_length",
    *(f"return_{name}" for name in RETURN_OUTPUTS),
)
LIST_INPUTS = ("stop_words", "bad_words")  # STRING [-1]


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        settings = initialize_model(args)
        # Forwards run on the verify thread (in process) or in the verifier's process: torch
        # on this process's other threads must not start OpenMP teams of its own (threads.py).
        serial_elsewhere()
        params, self.target = settings.params, settings.target
        self._load_tokenizer(settings.max_model_len)
        self._read_request_settings(params)
        self._start_workers(params)
        # Who verifies and who drafts, where: the plan the verifier and drafter models read too.
        plan = Placement.read(model_repository(args))
        route = plan.route(args["model_name"])  # a placement parameter none of its values fails the load
        self.verifier_name, self.drafter_name = route.verifier, route.drafter
        version = str(args.get("model_version", "1"))
        self.metrics = ServingMetrics(args["model_name"], version, self.max_model_len)
        self.metrics.writer.wait_for_step = self.outbox.wait_for_step  # writes while a forward runs
        self.peers = self._peers(args["model_name"], plan, params)
        # extract_hidden_states drafts nothing: each step asks the verifier for its layers instead.
        info = self.peers.drafter_info  # None when a drafter standing by cannot draft here either
        self.extract_layer_ids = info.hidden_layer_ids if info and not info.proposes_drafts else ()
        self.served = self._served()
        method, k = (info.method, info.num_speculative_tokens) if info else (None, 0)
        self.counters = SpecDecodeCounters(args["model_name"], version, method, k)
        self.cancellation = CancellationWatch()
        log.info(
            "speculative ready: verifier=%s drafter=%s context=%d",
            self.verifier_name,
            self.drafter_name or "(none: plain decoding)",
            self.max_model_len,
        )
        freeze_startup_heap(args["model_name"])  # the loop (and an in-process forward) never waits on a full collection

    def _load_tokenizer(self, max_model_len: int | None) -> None:
        """The target's tokenizer, context window, EOS ids and vocabulary size."""
        self.tokenizer = load_tokenizer(self.target)
        config = model_config(self.target)
        self.max_model_len = context_window(config, max_model_len)
        eos = getattr(config, "eos_token_id", None)
        eos = self.tokenizer.eos_token_id if eos is None else eos
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.vocab_size = config.vocab_size  # what token ids in a request may name
        self.decode_token = functools.lru_cache(maxsize=1 << 16)(lambda t: self.tokenizer.decode([t]))

    def _read_request_settings(self, params: dict[str, str]) -> None:
        """The config.pbtxt parameters every request is served with."""
        self.adaptive = parse_flag(params, "adaptive_draft_length", True)
        # With an extract_hidden_states drafter: also write each request's hidden states here.
        self.hidden_states_dir = params.get("hidden_states_dir", "")
        self.prefill_chunk = prefill_chunk_tokens(params.get("prefill_chunk_tokens", str(DEFAULT_PREFILL_CHUNK)))
        # Streamed responses carry at least this many tokens (a request may set its own).
        self.stream_interval = stream_interval(params.get("stream_interval", "1"))
        # How long a request may wait for room in the target's KV pool (then 503-like error).
        self.max_queue_time_s = max_queue_time_s(params.get("max_queue_time_s", ""))

    def _start_workers(self, params: dict[str, str]) -> None:
        """The request workers, the admission in front of them and the response outbox."""
        self.active_requests = 0
        workers = int(params.get("max_concurrent_requests", "64"))
        self.pool = started_pool(workers, "spec")
        # Requests beyond the workers wait, up to max_queued_requests; more are refused as
        # retryable, as are new requests while the server shuts down (admission.py).
        self.admission = Admission(workers, int(params.get("max_queued_requests", "256")), drain_file())
        self.lock = threading.Lock()
        # Responses are built and sent from one thread, in order, once the next step is under
        # way: that work overlaps the forward pass instead of delaying it (outbox.py).
        self.outbox = Outbox(lambda e: error_response(f"generation failed: could not build the response: {e}"))

    def _peers(self, model_name: str, plan: Placement, params: dict[str, str]) -> Peers:
        """The verifier and drafter handles each request gets: over BLS, or in this process. A
        drafter call past drafter_timeout_s is abandoned (that request decodes plainly from
        there); a verify step past step_timeout_s fails its requests and leaves the server
        refusing new ones: it is not ready any more."""
        drafter_config, drafter_info = self._describe_drafter(plan) if self.drafter_name else (None, None)
        return Peers(
            model_name,
            plan,
            drafter_config,
            drafter_info,
            self.max_model_len,
            self.outbox,
            float(params.get("drafter_timeout_s", "30")) or None,
            float(params.get("step_timeout_s", "300")) or None,
            self.admission.fail,
            self.metrics,
        )

    def _describe_drafter(self, plan: Placement) -> tuple[SpeculativeConfig | None, DrafterInfo | None]:
        """The drafter's config and what it is (method, k, layers), from its config.pbtxt in
        this repository, resolved against this model's target. A config that cannot be read
        leaves this model serving plain decoding (the drafter's own load fails with the reason)."""
        try:
            pbtxt = plan.configs.get(self.drafter_name)
            if pbtxt is None:
                raise FileNotFoundError("the model repository has no readable config.pbtxt of it")
            config = SpeculativeConfig.from_json(
                get_parameter(pbtxt, "speculative_config") or "",
                target_model=str(self.target),
                target_max_model_len=self.max_model_len,
            )
            info = describe_drafter(config, self.target)
        except Exception as e:
            log.error("drafter %r: %s; serving plain decoding", self.drafter_name, e)
            return None, None
        log.info(
            "drafter %r: method=%s k=%d layers=%s",
            self.drafter_name,
            info.method,
            info.num_speculative_tokens,
            list(info.hidden_layer_ids),
        )
        return config, info

    def _post(self, sender, build: Callable[[], object], final: bool) -> None:
        """Queue a response for the sending thread; `build` makes it there."""
        if final:  # the server frees what a cancellation poll reads once this is sent
            self.cancellation.forget(sender)
        self.outbox.post(sender, build, FINAL if final else 0)

    def execute(self, requests: list) -> None:
        for request in requests:
            refusal = self.admission.admit()
            if refusal is not None:
                error = functools.partial(error_response, refusal, retryable=True)
                self._post(request.get_response_sender(), error, final=True)
                continue
            self.metrics.arrived()
            self.pool.submit(self._serve, request, time.perf_counter())
        return None

    def _serve(self, request, arrived: float) -> None:
        """One request on a worker thread: its session's replies become Triton responses."""
        clock = self.metrics.started(arrived)
        sender = request.get_response_sender()
        # Random 63-bit correlation ids: nobody can guess another request's (they used to be
        # pid << 32 + n), and no restart or replica repeats one.
        seq_id = secrets.randbits(63) or 1
        with self.lock:
            self.active_requests += 1  # the load the batch-size schedule follows
        verifier, drafter = self.peers.verifier(seq_id), self.peers.drafter(seq_id)
        session, counted, answered = None, False, False
        client_left = self.cancellation.watch(sender)

        def answer(build: Callable[[], object]) -> None:
            """The request's last response: its admission slot is free from here."""
            nonlocal answered
            if not answered:
                answered = True
                self.admission.answered()
            self._post(sender, build, final=True)

        try:
            session = Session(self.served, self._parse(request), seq_id)
            # A shutdown's grace period that runs out ends the request as its client leaving would.
            for reply in session.replies(verifier, drafter, lambda: client_left() or self.admission.past_grace()):
                if reply.step.token_ids:
                    clock.tokens(len(reply.step.token_ids))
                clock.finish_reason = reply.step.finish_reason or clock.finish_reason
                if reply.step.finish_reason == "cancelled":
                    answer(self._cancelled(seq_id, client_left()))
                    return
                if reply.final:
                    # Counted before the last response goes out, so a client that reads
                    # /metrics right after its request finished sees the request.
                    self._count(drafter, session.stats)
                    counted = True
                if reply.outputs is not None:
                    if reply.final:
                        answer(functools.partial(_response, reply.outputs))
                    else:
                        self._post(sender, functools.partial(_response, reply.outputs), final=False)
        except RequestError as e:
            answer(functools.partial(error_response, str(e)))
        except Exception as e:  # never leave a decoupled client waiting
            log.exception("request %d failed", seq_id)
            answer(functools.partial(error_response, f"generation failed: {e}"))
        finally:
            clock.finished(len(session.prompt_ids) if session else 0, session.req.params_n if session else 1)
            with self.lock:
                self.active_requests -= 1
            if not counted and session is not None:
                self._count(drafter, session.stats)
            self._release(seq_id, verifier, drafter)
            # Last: a stop waiting for this request (admission.py) unloads the peers released above.
            self.admission.finished(answered)

    def _cancelled(self, seq_id: int, by_client: bool) -> Callable[[], object]:
        """The last response of a request ended early: by its client, or by the shutdown."""
        if by_client:
            log.info("request %d cancelled by the client", seq_id)
            return functools.partial(error_response, "request cancelled")
        log.warning("request %d cut: the shutdown's grace period ran out", seq_id)
        message = f"{UNAVAILABLE}the server shut down before this request finished (its grace period ran out); retry"
        return functools.partial(error_response, message, retryable=True)

    @staticmethod
    def _release(seq_id: int, *peers: Verifier | Drafter | None) -> None:
        for peer in peers:
            if peer is not None:
                try:
                    peer.release(seq_id)
                except Exception:
                    log.exception("could not release sequence %d in %s", seq_id, peer.model_name)

    def _served(self) -> ServedModel:
        """What every request to this model shares, as its Session reads it."""
        context = ServingContext(
            self.eos_token_ids,
            self.max_model_len,
            self.adaptive,
            self.extract_layer_ids,
            lambda: self.active_requests,
            self.prefill_chunk,
            # Structured outputs: masks go to the target in this process or over BLS alike.
            GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids),
            self.max_queue_time_s,
        )
        return ServedModel(
            self.tokenizer, self.vocab_size, self.decode_token, context, self.stream_interval, self.hidden_states_dir
        )

    def _count(self, drafter: Drafter | None, stats: GenerationStats) -> None:
        """Add a request's acceptance (and a drafter fallback) to the server-wide counters."""
        if drafter is not None:
            self.counters.add(drafter.info.method, stats.acceptance, bool(stats.fallback))

    @staticmethod
    def _parse(request) -> GenerationRequest:
        """The request's input tensors and parameters, checked (RequestError names the input)."""
        try:
            tensors = {name: input_scalar(request, name) for name in TENSOR_INPUTS}
            tensors = {k: v for k, v in tensors.items() if v is not None}
            for name in LIST_INPUTS:
                strings = pb_utils.get_input_tensor_by_name(request, name)
                if strings is not None:
                    tensors[name] = [
                        s.decode() if isinstance(s, bytes) else str(s) for s in strings.as_numpy().reshape(-1)
                    ]
            sampling_json = input_scalar(request, "sampling_parameters") or ""
        except UnicodeDecodeError as e:  # BYTES tensors may hold anything
            raise RequestError(
                f"text_input, stop_words and sampling_parameters must be UTF-8 text: {e.reason} at byte {e.start}"
            ) from None
        return parse_request(tensors, request.parameters() or "", sampling_json)

    def finalize(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.admission.close()  # cancelled requests never finished
        self.outbox.close()
        self.metrics.close()


def _response(outputs: Callable[[], dict[str, np.ndarray]]) -> object:
    return pb_utils.InferenceResponse([pb_utils.Tensor(name, value) for name, value in outputs().items()])
