"""`verifier` model: the target model behind Triton's sequence batcher (one KV cache per
correlation id). Inputs per step: new token ids and draft ids; outputs: the emitted ids."""
from __future__ import annotations

import json
import logging

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from backends.model_store import DEFAULT_MODEL, resolve_model
from backends.request import SamplingParams
from backends.target import TargetRunner, VerifyRequest
from backends.triton_models.common import (
    SEQUENCE_END, ActiveSequencesGauge, error_response, input_array, input_ids, model_parameters,
    setup_logging,
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
        self.runner = TargetRunner(path, dtype=dtype, max_model_len=max_len)
        self.active = ActiveSequencesGauge(args["model_name"])
        log.info("verifier ready: %s (%s, context %d)", path, dtype, self.runner.max_model_len)

    def execute(self, requests: list) -> list:
        self.runner.release_idle(self.idle_s)
        responses = [self._one(r) for r in requests]
        self.active.set(len(self.runner.sequences))
        return responses

    def _one(self, request) -> object:
        seq_id = request.correlation_id()
        try:
            if request.flags() & SEQUENCE_END:
                self.runner.release(seq_id)
                return self._response([], 0.0, None)
            sampling_json = json.loads(request.parameters() or "{}").get("sampling")
            sampling = SamplingParams.from_json(sampling_json) if sampling_json else None
            layers = tuple(input_ids(request, "hidden_layer_ids"))
            draft_probs = input_array(request, "draft_probs")
            result = self.runner.verify(
                VerifyRequest(seq_id, input_ids(request, "input_ids"), input_ids(request, "draft_ids"),
                              sampling, layers,
                              None if draft_probs is None else torch.from_numpy(draft_probs.reshape(draft_probs.shape[-2:])))
            )
            return self._response(result.token_ids, result.forward_s, result.hidden_states)
        except Exception as e:  # the request fails, the server and other sequences don't
            log.warning("sequence %d: %s", seq_id, e)
            self.runner.release(seq_id)
            return error_response(f"verifier: {e}")

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
