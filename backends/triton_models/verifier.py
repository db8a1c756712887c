"""`verifier` model: the target model behind Triton's sequence batcher (one KV cache per
correlation id). Inputs per step: new token ids and draft ids; outputs: the emitted ids."""
from __future__ import annotations

import json
import logging

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from backends.runtime.model_store import DEFAULT_MODEL, resolve_model
from backends.serving.request import SamplingParams
from backends.serving.target import TargetRunner, VerifyRequest
from backends.triton_models.common import (
    SEQUENCE_END, ActiveSequencesGauge, error_response, input_array, input_ids, instance_device,
    model_parameters, setup_logging,
)

log = logging.getLogger("tritonspec.verifier")


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        setup_logging()
        params = model_parameters(args)
        path = resolve_model(params.get("model") or DEFAULT_MODEL)
        dtype = params.get("dtype", "bfloat16")
        max_len = int(params["max_model_len"]) if params.get("max_model_len") else None
        self.idle_s = float(params.get("sequence_idle_timeout_s", "60"))
        budget = float(params.get("kv_cache_memory_gb", "4"))
        device = instance_device(args, params, log)  # a GPU that cannot be used fails the load here
        self.runner = TargetRunner(path, dtype=dtype, device=device, max_model_len=max_len,
                                   kv_cache_memory_gb=budget or None)
        self.active = ActiveSequencesGauge(args["model_name"])
        log.info("verifier ready: %s (%s on %s, context %d, KV budget %s tokens)", path, dtype, device,
                 self.runner.max_model_len, self.runner.kv_budget_tokens or "unlimited")

    def execute(self, requests: list) -> list:
        """Requests from many sequences (the `oldest` sequence batcher) are verified together."""
        self.runner.release_idle(self.idle_s)
        responses: list = [None] * len(requests)
        batch, index = [], []
        for i, request in enumerate(requests):
            seq_id = request.correlation_id()
            if request.flags() & SEQUENCE_END:
                self.runner.release(seq_id)
                responses[i] = self._response([], 0.0, None)
                continue
            try:
                batch.append(self._verify_request(request))
                index.append(i)
            except Exception as e:  # a malformed request fails alone
                responses[i] = self._fail(seq_id, e)
        if batch:
            try:
                results = self.runner.verify_batch(batch)
            except Exception as e:  # the forward itself failed: every sequence in it is suspect
                log.exception("batched verification failed")
                results = [e] * len(batch)
            for i, req, result in zip(index, batch, results):
                responses[i] = (self._fail(req.seq_id, result) if isinstance(result, Exception)
                                else self._response(result.token_ids, result.forward_s, result.hidden_states))
        self.active.set(len(self.runner.sequences))
        return responses

    @staticmethod
    def _verify_request(request) -> VerifyRequest:
        params = json.loads(request.parameters() or "{}")
        sampling_json = params.get("sampling")
        draft_probs = input_array(request, "draft_probs")
        return VerifyRequest(
            request.correlation_id(),
            input_ids(request, "input_ids"),
            input_ids(request, "draft_ids"),
            SamplingParams.from_json(sampling_json) if sampling_json else None,
            tuple(input_ids(request, "hidden_layer_ids")),
            None if draft_probs is None else torch.from_numpy(draft_probs.reshape(draft_probs.shape[-2:])),
            params.get("max_new_tokens"),
        )

    def _fail(self, seq_id: int, error: Exception) -> object:
        # The request fails; the server and the other sequences don't.
        log.warning("sequence %d: %s", seq_id, error)
        self.runner.release(seq_id)
        return error_response(f"verifier: {error}")

    @staticmethod
    def _response(token_ids: list[int], forward_s: float, hidden: torch.Tensor | None) -> object:
        outputs = [
            pb_utils.Tensor("output_ids", np.array([token_ids], dtype=np.int64)),
            pb_utils.Tensor("forward_ms", np.array([[forward_s * 1e3]], dtype=np.float64)),
        ]
        if hidden is not None:
            outputs.append(pb_utils.Tensor("hidden_states", hidden.numpy()[None]))
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def finalize(self) -> None:
        self.runner.sequences.clear()
