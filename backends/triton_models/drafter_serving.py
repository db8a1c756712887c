"""The `drafter` model while it serves (`drafter.py` decides): the proposer that the
`speculative_config` parameter names, behind Triton's sequence batcher. Inputs per step: the
tokens new since the last call, the k the orchestrator decided, how many drafts of the last
answer were accepted, the request's temperature and seed, and the target's hidden states when
the method reads them; outputs: the draft ids (and their probabilities when sampled; a tree's
parents and node scores)."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from backends.config import SpeculativeConfig
from backends.runtime.threads import own_cores
from backends.serving.drafting import DraftCall, DraftService
from backends.serving.proposer import Draft, build_proposer, check_layers, describe_drafter
from backends.triton_models.common import input_array, input_ids, input_scalar, instance_device
from backends.triton_models.pbtxt import ModelSettings
from backends.triton_models.sequence_model import SequenceBatchedModel

log = logging.getLogger("tritonspec.drafter")


class DrafterModel(SequenceBatchedModel):
    role = "drafter"

    def __init__(self, args: dict, settings: ModelSettings, config: SpeculativeConfig, max_len: int) -> None:
        own_cores()  # execute, and so every forward, runs on this thread (threads.py)
        target = settings.target
        self.config = config
        device = instance_device(args, settings.params, log)  # model-free methods ignore it
        proposer = build_proposer(
            self.config, max_model_len=max_len, target_model=target, dtype=settings.dtype, device=device
        )
        check_layers(proposer, describe_drafter(self.config, target))
        self.service = DraftService(proposer, self.config)
        self.init_sequences(args, settings.params, self.service)
        log.info(
            "drafter ready: method=%s k=%d device=%s", self.config.method, self.config.num_speculative_tokens, device
        )

    def parse(self, request) -> DraftCall:
        hidden = input_array(request, "hidden_states")
        temperature = input_scalar(request, "temperature")
        seed = input_scalar(request, "random_seed")
        nodes = input_scalar(request, "num_draft_nodes")
        return DraftCall(
            request.correlation_id(),
            input_ids(request, "input_ids"),
            int(input_scalar(request, "num_draft_tokens")),
            None if hidden is None else torch.from_numpy(hidden.reshape(hidden.shape[-3:])),
            1.0 if temperature is None else float(temperature),
            int(input_scalar(request, "num_accepted_drafts") or 0),
            None if seed is None else int(seed),
            int(nodes or 0),
        )

    def run(self, calls: list[DraftCall]) -> list:
        start = time.perf_counter()
        try:
            drafts = self.service.draft(calls)
        except Exception as e:
            log.exception("proposer failed")
            return [RuntimeError(f"{self.config.method} proposer failed: {e}")] * len(calls)
        elapsed = (time.perf_counter() - start) / len(calls)
        return [(draft, elapsed) for draft in drafts]

    def respond(self, result: tuple[Draft, float] | None) -> object:
        draft, propose_s = (Draft(), 0.0) if result is None else result
        # Draft probabilities only from methods that sample their drafts (lossless sampled
        # verification needs q); greedy drafts are one-hot and send none.
        probs = draft.probs
        extra = [] if probs is None else [pb_utils.Tensor("draft_probs", probs.float().cpu().numpy()[None])]
        if draft.parents is not None:
            extra.append(pb_utils.Tensor("draft_parents", np.array([draft.parents], dtype=np.int64)))
        if draft.scores is not None:
            extra.append(pb_utils.Tensor("draft_scores", np.array([draft.scores], dtype=np.float32)))
        return pb_utils.InferenceResponse(
            output_tensors=extra
            + [
                pb_utils.Tensor("draft_ids", np.array([draft.token_ids], dtype=np.int64)),
                pb_utils.Tensor("propose_ms", np.array([[propose_s * 1e3]], dtype=np.float64)),
            ]
        )

    @property
    def num_sequences(self) -> int:
        return self.service.num_sequences
