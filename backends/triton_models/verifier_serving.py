"""The `verifier` model while it serves (`verifier.py` decides): the target model behind
Triton's sequence batcher (one KV cache per correlation id). Inputs per step: new token ids
and draft ids (and, where they have them, draft probabilities, a tree's parents, a structured
output's token mask); outputs: the emitted ids."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from backends.runtime.threads import own_cores
from backends.serving.logits import PROMPT, logprobs_to_arrays
from backends.serving.request import SamplingParams
from backends.serving.target import TargetRunner, VerifyRequest, VerifyResult
from backends.triton_models.common import input_array, input_ids, instance_device, parse_flag
from backends.triton_models.metrics import EngineMetrics
from backends.triton_models.pbtxt import ModelSettings
from backends.triton_models.sequence_model import SequenceBatchedModel
from backends.triton_models.step_batch import ROW_INPUTS, ROWS, decode_rows, encode_results, verify_steps

log = logging.getLogger("tritonspec.verifier")
PREFIX_CACHE_NAMESPACE_ENV = "TRITONSPEC_PREFIX_CACHE_NAMESPACE"


class VerifierModel(SequenceBatchedModel):
    role = "verifier"

    def __init__(self, args: dict, settings: ModelSettings) -> None:
        own_cores()  # execute, and so every forward, runs on this thread (threads.py)
        device = instance_device(args, settings.params, log)  # a GPU that cannot be used fails the load here
        self.runner = target_runner(settings, device)
        self.init_sequences(args, settings.params, self.runner)
        self.engine_metrics = EngineMetrics(args["model_name"], str(args.get("model_version", "1")), self.runner)

    def parse(self, request) -> VerifyRequest:
        params = json.loads(request.parameters() or "{}")
        sampling_json = params.get("sampling")
        draft_probs, parents, mask = (
            input_array(request, name) for name in ("draft_probs", "draft_parents", "token_mask")
        )
        return VerifyRequest(
            request.correlation_id(),
            input_ids(request, "input_ids"),
            input_ids(request, "draft_ids"),
            SamplingParams.from_json(sampling_json) if sampling_json else None,
            tuple(input_ids(request, "hidden_layer_ids")),
            None if draft_probs is None else torch.from_numpy(draft_probs.reshape(draft_probs.shape[-2:])),
            params.get("max_new_tokens"),
            None if parents is None else parents.reshape(-1).tolist(),
            params.get("prefill_only") is True,
            None if mask is None else torch.from_numpy(mask.reshape(mask.shape[-2:])),
        )

    def carried(self, request) -> list | None:
        params = json.loads(request.parameters() or "{}")
        if ROWS not in params:
            return None
        return decode_rows(params[ROWS], {name: input_array(request, name) for name in ROW_INPUTS})

    def respond_rows(self, results: list) -> object:
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, array) for name, array in encode_results(results).items()]
        )

    def run(self, calls: list[VerifyRequest]) -> list:
        """Requests from many sequences (the `oldest` sequence batcher) are verified together."""
        results = verify_steps(self.runner, calls)
        self.engine_metrics.stepped(calls)
        return results

    def execute(self, requests: list) -> list:
        responses = super().execute(requests)
        self.engine_metrics.update()  # after the steps and the releases, before the responses go out
        return responses

    def respond(self, result: VerifyResult | None) -> object:
        token_ids, forward_s, hidden = (
            ([], 0.0, None) if result is None else (result.token_ids, result.forward_s, result.hidden_states)
        )
        outputs = [
            pb_utils.Tensor("output_ids", np.array([token_ids], dtype=np.int64)),
            pb_utils.Tensor("forward_ms", np.array([[forward_s * 1e3]], dtype=np.float64)),
        ]
        if hidden is not None:
            outputs.append(pb_utils.Tensor("hidden_states", hidden.numpy()[None]))
        if result is not None and result.waiting:  # no KV room now: the step did not run
            outputs.append(pb_utils.Tensor("waiting", np.array([[True]])))
        for logprobs, prefix in ((result and result.logprobs, ""), (result and result.prompt_logprobs, PROMPT)):
            if logprobs is not None:  # top arrays only with alternatives
                outputs += [
                    pb_utils.Tensor(name, array[None])
                    for name, array in logprobs_to_arrays(logprobs, prefix).items()
                    if array.size
                ]
        return pb_utils.InferenceResponse(output_tensors=outputs)

    @property
    def num_sequences(self) -> int:
        return len(self.runner.sequences)

    def finalize(self) -> None:
        self.runner.sequences.clear()


def target_runner(settings: ModelSettings, device: str) -> TargetRunner:
    """The target as a verifier's config.pbtxt parameters describe it, on `device`."""
    budget = float(settings.params.get("kv_cache_memory_gb", "4"))
    runner = TargetRunner(
        settings.target,
        dtype=settings.dtype,
        device=device,
        max_model_len=settings.max_model_len,
        kv_cache_memory_gb=budget or None,
        runtime=settings.params.get("runtime", "auto"),
        batch_invariant=settings.params.get("batch_invariant", "auto"),
        prefix_caching=parse_flag(settings.params, "enable_prefix_caching", True),
        # Mixed into every prefix-cache key (with each request's cache_salt): this deployment's own.
        prefix_cache_namespace=settings.params.get("prefix_cache_namespace")
        or os.environ.get(PREFIX_CACHE_NAMESPACE_ENV, ""),
    )
    log.info(
        "verifier ready: %s (%s on %s, context %d, KV budget %s tokens)",
        settings.target,
        settings.dtype,
        device,
        runner.max_model_len,
        runner.kv_budget_tokens or "unlimited",
    )
    return runner
