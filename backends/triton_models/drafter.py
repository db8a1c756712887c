"""`drafter` model: the proposer that the `speculative_config` parameter names, behind
Triton's sequence batcher. Inputs per step: the tokens new since the last call, the room
left, the client's requested draft length and temperature; output: the draft ids."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from backends.config import SpeculativeConfig
from backends.serving.drafting import DraftCall, DraftService
from backends.runtime.model_store import DEFAULT_MODEL, context_window, load_config, resolve_model
from backends.serving.proposer import build_proposer
from backends.triton_models.common import (
    SEQUENCE_END, ActiveSequencesGauge, error_response, input_array, input_ids, input_scalar,
    instance_device, model_parameters, setup_logging,
)

log = logging.getLogger("tritonspec.drafter")


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        setup_logging()
        params = model_parameters(args)
        target = resolve_model(params.get("model") or DEFAULT_MODEL)
        max_len = context_window(load_config(target), int(params.get("max_model_len") or 0))
        # A bad speculative_config fails this model's load with the config's own message.
        self.config = SpeculativeConfig.from_json(
            params.get("speculative_config", ""), target_model=str(target), target_max_model_len=max_len
        )
        self.idle_s = float(params.get("sequence_idle_timeout_s", "60"))
        device = instance_device(args, params, log)  # model-free methods ignore it
        proposer = build_proposer(self.config, max_model_len=max_len, target_model=target,
                                  dtype=params.get("dtype", "bfloat16"), device=device)
        self.service = DraftService(proposer, self.config)
        self.active = ActiveSequencesGauge(args["model_name"])
        log.info("drafter ready: method=%s k=%d device=%s", self.config.method,
                 self.config.num_speculative_tokens, device)

    def execute(self, requests: list) -> list:
        responses = self._execute(requests)
        self.active.set(self.service.num_sequences)
        return responses

    def _execute(self, requests: list) -> list:
        self.service.release_idle(self.idle_s)
        responses: list = [None] * len(requests)
        calls, index = [], []
        for i, request in enumerate(requests):
            seq_id = request.correlation_id()
            if request.flags() & SEQUENCE_END:
                self.service.release(seq_id)
                responses[i] = self._response([], 0.0)
                continue
            requested = input_scalar(request, "num_draft_tokens")
            hidden = input_array(request, "hidden_states")
            temperature = input_scalar(request, "temperature")
            call = DraftCall(
                seq_id,
                input_ids(request, "input_ids"),
                int(input_scalar(request, "max_draft_tokens")),
                None if requested is None or requested < 0 else int(requested),
                None if hidden is None else torch.from_numpy(hidden.reshape(hidden.shape[-3:])),
                1.0 if temperature is None else float(temperature),
            )
            try:
                self.service.num_tokens(call)  # refuse a bad request alone, not its batch
            except ValueError as e:
                responses[i] = error_response(f"drafter: {e}")
                continue
            calls.append(call)
            index.append(i)
        if calls:
            start = time.perf_counter()
            try:
                drafts = self.service.draft(calls)
            except Exception as e:
                log.exception("proposer failed")
                for i in index:
                    responses[i] = error_response(f"drafter ({self.config.method}): {e}")
                return responses
            elapsed = (time.perf_counter() - start) / len(calls)
            for i, draft in zip(index, drafts):
                responses[i] = self._response(draft.token_ids, elapsed, draft.probs)
        return responses

    def _response(self, token_ids: list[int], propose_s: float, probs: torch.Tensor | None = None) -> object:
        # Draft probabilities only from methods that sample their drafts (lossless sampled
        # verification needs q); greedy drafts are one-hot and send none.
        extra = [] if probs is None else [pb_utils.Tensor("draft_probs", probs.float().cpu().numpy()[None])]
        return pb_utils.InferenceResponse(output_tensors=extra + [
            pb_utils.Tensor("draft_ids", np.array([token_ids], dtype=np.int64)),
            pb_utils.Tensor("propose_ms", np.array([[propose_s * 1e3]], dtype=np.float64)),
            pb_utils.Tensor("method", np.array([[self.config.method.encode()]], dtype=np.object_)),
            pb_utils.Tensor("num_speculative_tokens",
                            np.array([[self.service.num_speculative_tokens]], dtype=np.int32)),
            pb_utils.Tensor("hidden_layer_ids",
                            np.array([self.service.proposer.hidden_layer_ids], dtype=np.int32).reshape(1, -1)),
        ])
