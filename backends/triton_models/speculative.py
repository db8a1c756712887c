"""`speculative` model: the client-facing, decoupled orchestrator. Each request runs the
draft -> verify loop of `backends.serving.orchestrator` in its own worker thread, calling the
`drafter` and `verifier` models through (non-decoupled) BLS, and streams text back."""
from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from backends.serving.detokenize import TextStream
from backends.methods.extract_hidden_states import save_hidden_states
from backends.runtime.model_store import DEFAULT_MODEL, context_window, load_config, load_tokenizer, resolve_model
from backends.serving.orchestrator import GenerationStats, StepOutput, generate
from backends.serving.request import GenerationRequest, RequestError, parse_request
from backends.triton_models.common import (
    SpecDecodeCounters, error_response, input_scalar, model_parameters, setup_logging,
)
from backends.triton_models.peers import BlsDrafter, BlsVerifier

log = logging.getLogger("tritonspec.speculative")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
TENSOR_INPUTS = ("text_input", "stream", "exclude_input_in_output", "max_tokens", "temperature",
                 "top_k", "top_p", "random_seed", "num_draft_tokens", "ignore_eos")


class CancellationPoll:
    """`sender.is_cancelled()` is a round trip to the server process (0.05-0.5 ms on a busy
    CPU); asking at most every `interval_s` keeps it out of each step's overhead."""

    def __init__(self, sender, interval_s: float = 0.1) -> None:
        self.sender = sender
        self.interval_s = interval_s
        self.next_check = 0.0

    def __call__(self) -> bool:
        now = time.monotonic()
        if now < self.next_check:
            return False
        self.next_check = now + self.interval_s
        return self.sender.is_cancelled()


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        setup_logging()
        params = model_parameters(args)
        model_path = resolve_model(params.get("model") or DEFAULT_MODEL)
        self.tokenizer = load_tokenizer(model_path)
        config = load_config(model_path)
        self.max_model_len = context_window(config, int(params.get("max_model_len") or 0))
        eos = getattr(config, "eos_token_id", None)
        eos = self.tokenizer.eos_token_id if eos is None else eos
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.verifier_name = params.get("verifier_model_name", "verifier")
        self.drafter_name = params.get("drafter_model_name", "")
        self.adaptive = params.get("adaptive_draft_length", "true").lower() == "true"
        # With an extract_hidden_states drafter: also write each request's hidden states here.
        self.hidden_states_dir = params.get("hidden_states_dir", "")
        workers = int(params.get("max_concurrent_requests", "64"))
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="spec")
        # Correlation ids unique across instances and restarts of this process.
        self.seq_ids = itertools.count((os.getpid() << 32) + 1)
        self.lock = threading.Lock()
        self.counters = SpecDecodeCounters(args["model_name"])
        # Responses go out from one thread, in order, so a step's send overlaps the next
        # step's forward pass instead of adding to it.
        self.outbox: queue.Queue = queue.Queue()
        self.sender_thread = threading.Thread(target=self._drain_outbox, name="spec-send", daemon=True)
        self.sender_thread.start()
        log.info("speculative ready: verifier=%s drafter=%s context=%d",
                 self.verifier_name, self.drafter_name or "(none: plain decoding)", self.max_model_len)

    def _drain_outbox(self) -> None:
        while (item := self.outbox.get()) is not None:
            sender, response, flags = item
            try:
                sender.send(response, flags=flags)
            except Exception:  # a client that went away must not stop the others' responses
                log.exception("could not send a response")

    def _post(self, sender, response, final: bool) -> None:
        self.outbox.put((sender, response, FINAL if final else 0))

    def execute(self, requests: list) -> None:
        for request in requests:
            self.pool.submit(self._serve, request)
        return None

    def _serve(self, request) -> None:
        sender = request.get_response_sender()
        with self.lock:
            seq_id = next(self.seq_ids)
        verifier = BlsVerifier(self.verifier_name, seq_id)
        drafter = BlsDrafter(self.drafter_name, seq_id) if self.drafter_name else None
        stats = None
        counted = False
        try:
            req = self._parse(request)
            prompt_ids = self.tokenizer(req.prompt)["input_ids"]
            text = TextStream(self.tokenizer, req.stop)
            stats = GenerationStats()
            steps = generate(req, prompt_ids, seq_id, verifier, drafter, text, self.eos_token_ids,
                             self.max_model_len, stats, CancellationPoll(sender), self.adaptive)
            all_ids: list[int] = []
            hidden_parts: list[torch.Tensor] = []
            for step in steps:
                all_ids += step.token_ids
                if step.hidden_states is not None:
                    hidden_parts.append(step.hidden_states)
                if step.finish_reason == "cancelled":
                    log.info("request %d cancelled by the client", seq_id)
                    self._post(sender, error_response("request cancelled"), final=True)
                    return
                extra = {}
                if step.finish_reason is not None:
                    extra = self._hidden_outputs(seq_id, hidden_parts, prompt_ids, all_ids, drafter)
                    # Counted before the last response goes out, so a client that reads
                    # /metrics right after its request finished sees the request.
                    self._count(drafter, stats)
                    counted = True
                if req.stream and (step.text or step.token_ids or step.finish_reason):
                    self._post(sender, self._response(step, step.token_ids, step.text, len(prompt_ids),
                                                      len(all_ids), stats, extra), step.finish_reason is not None)
            if not req.stream:
                body = text.text if req.exclude_input_in_output else req.prompt + text.text
                self._post(sender, self._response(step, all_ids, body, len(prompt_ids), len(all_ids), stats, extra),
                           final=True)
        except RequestError as e:
            self._post(sender, error_response(str(e)), final=True)
        except Exception as e:  # never leave a decoupled client waiting
            log.exception("request %d failed", seq_id)
            self._post(sender, error_response(f"generation failed: {e}"), final=True)
        finally:
            if not counted:
                self._count(drafter, stats)
            for peer in (verifier, drafter):
                if peer is not None:
                    try:
                        peer.release()
                    except Exception:
                        log.exception("could not release sequence %d in %s", seq_id, peer.model_name)

    def _count(self, drafter: "BlsDrafter | None", stats: "GenerationStats | None") -> None:
        """Add a request's acceptance to the server-wide counters."""
        if drafter is not None and drafter.method and stats is not None:
            self.counters.add(drafter.method, stats.acceptance)

    @staticmethod
    def _parse(request) -> GenerationRequest:
        tensors = {name: input_scalar(request, name) for name in TENSOR_INPUTS}
        tensors = {k: v for k, v in tensors.items() if v is not None}
        stop = pb_utils.get_input_tensor_by_name(request, "stop_words")
        if stop is not None:
            tensors["stop_words"] = [s.decode() if isinstance(s, bytes) else str(s)
                                     for s in stop.as_numpy().reshape(-1)]
        sampling_json = input_scalar(request, "sampling_parameters") or ""
        return parse_request(tensors, request.parameters() or "", sampling_json)

    def _hidden_outputs(self, seq_id: int, parts: list[torch.Tensor], prompt_ids: list[int], output_ids: list[int],
                        drafter: "BlsDrafter | None") -> dict[str, np.ndarray]:
        """The extracted hidden states of the whole request (rows for positions 0 .. prompt +
        output - 2), their layer ids, and the file they were written to when asked."""
        if not parts:
            return {}
        token_ids = prompt_ids + output_ids
        hidden = torch.cat(parts)[: len(token_ids) - 1]  # never a position past the output
        outputs = {"hidden_states": hidden.float().numpy(),
                   "hidden_layer_ids": np.array(drafter.hidden_layer_ids, dtype=np.int32)}
        if self.hidden_states_dir:
            path = save_hidden_states(Path(self.hidden_states_dir) / f"{seq_id}.safetensors", hidden, token_ids,
                                      drafter.hidden_layer_ids, len(prompt_ids))
            outputs["hidden_states_file"] = np.array([str(path).encode()], dtype=np.object_)
        return outputs

    @staticmethod
    def _response(step: StepOutput, token_ids: list[int], text: str, num_input: int, num_output: int,
                  stats: GenerationStats, extra: dict[str, np.ndarray] | None = None) -> object:
        """A streamed step carries its text and ids; the last response also the statistics
        (and, from an extract_hidden_states drafter, the hidden states)."""
        outputs = {
            "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
            "output_ids": np.array(token_ids, dtype=np.int64),
        }
        if step.finish_reason is not None:
            acceptance = stats.acceptance
            outputs.update({
                "finish_reason": np.array([step.finish_reason.encode()], dtype=np.object_),
                "num_input_tokens": np.array([num_input], dtype=np.uint32),
                "num_output_tokens": np.array([num_output], dtype=np.uint32),
                "total_draft_tokens": np.array([acceptance.num_draft_tokens], dtype=np.int64),
                "total_accepted_draft_tokens": np.array([acceptance.num_accepted_tokens], dtype=np.int64),
                "acceptance_rate": np.array([acceptance.acceptance_rate or 0.0], dtype=np.float32),
                "perf_metrics": np.array([json.dumps(stats.to_dict()).encode()], dtype=np.object_),
                **(extra or {}),
            })
        return pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in outputs.items()])

    def finalize(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.outbox.put(None)
        self.sender_thread.join(timeout=10)
