"""The orchestrator's handles on its BLS peers: the `drafter` and `verifier` models, one
handle per sequence (START on the first call, END on release; or the verifier's steps batched
with other sequences', step_batch.py). They implement the
`Drafter` / `Verifier` protocols of backends.serving.orchestrator over Triton."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import torch

from backends.serving.drafting import DraftCall
from backends.serving.logits import LOGPROB_OUTPUTS, logprobs_from_arrays
from backends.serving.proposer import Draft, DrafterInfo
from backends.serving.target import VerifyRequest, VerifyResult
from backends.triton_models.common import SEQUENCE_END, SEQUENCE_START, bls
from backends.triton_models.peer_token import with_token
from backends.triton_models.step_batch import StepBatcher


class PeerTimeoutError(TimeoutError):
    """A peer model did not answer a call in time (the orchestrator then decodes plainly)."""


_BOUNDED_CALLS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="bls-bounded")


class SequencePeer:
    """A sequence-batched BLS peer: START on the first call, END on release."""

    # This server's internal token (peer_token.py), sent with every call: the peers refuse
    # requests without it. Set once by the `speculative` model when it loads.
    token = ""

    def __init__(self, model_name: str, seq_id: int) -> None:
        self.model_name = model_name
        self.seq_id = seq_id
        self.started = False

    # Seconds a call may take before the request stops waiting for it (None: no bound). A
    # BLS call cannot be cancelled in this Triton, so a bounded one runs on a helper thread
    # that is left to finish on its own.
    timeout_s: float | None = None

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
        if self.timeout_s is None:
            return bls(*args)
        try:
            return _BOUNDED_CALLS.submit(bls, *args).result(timeout=self.timeout_s)
        except FutureTimeout:
            raise PeerTimeoutError(f"{self.model_name} did not answer within {self.timeout_s:g} s") from None


class BlsDrafter(SequencePeer):
    def __init__(self, model_name: str, seq_id: int, info: DrafterInfo) -> None:
        super().__init__(model_name, seq_id)
        self.info = info

    def draft(self, call: DraftCall) -> tuple[Draft, float]:
        inputs = self._inputs(call.new_token_ids, call.num_tokens)
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
    def _inputs(token_ids: list[int], num_tokens: int) -> dict:
        return {
            "input_ids": np.array([token_ids], dtype=np.int64),
            "num_draft_tokens": np.array([[num_tokens]], dtype=np.int32),
        }

    def release(self, seq_id: int | None = None) -> None:
        super().release(self._inputs([], 0))


class BlsVerifier(SequencePeer):
    logprobs = False  # the sequence asked for logprobs (its first step's sampling parameters)
    # Set by the `speculative` model when its steps go to the verifier in batches
    # (step_batch.py); a sequence that asks for logprobs still makes one request per step.
    batcher: StepBatcher | None = None
    batched: bool | None = None  # this sequence's steps go through the batcher (set by its first)

    def verify(self, req: VerifyRequest) -> VerifyResult:
        if self.batched is None:
            logprobs = req.sampling is not None and req.sampling.logprobs is not None
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
        inputs = self._inputs(req.new_token_ids, req.draft_token_ids)
        if req.draft_probs is not None:
            inputs["draft_probs"] = req.draft_probs.numpy()[None]
        if req.draft_parents is not None:
            inputs["draft_parents"] = np.array([req.draft_parents], dtype=np.int64)
        outputs = ["output_ids", "forward_ms"]
        if req.hidden_layer_ids:
            inputs["hidden_layer_ids"] = np.array([req.hidden_layer_ids], dtype=np.int32)
            outputs.append("hidden_states")
        if self.logprobs:
            outputs += LOGPROB_OUTPUTS
        out = self.call(inputs, outputs, params or None)
        hidden = out.get("hidden_states")
        token_ids = out["output_ids"].reshape(-1).tolist()
        return VerifyResult(
            token_ids,
            max(len(token_ids) - 1, 0),  # a prefill chunk emits nothing
            float(out["forward_ms"].item()) / 1e3,
            None if hidden is None else torch.from_numpy(hidden.reshape(hidden.shape[-3:])),
            logprobs_from_arrays(token_ids, out) if self.logprobs else None,
        )

    @staticmethod
    def _inputs(token_ids: list[int], draft_ids: list[int]) -> dict:
        return {"input_ids": np.array([token_ids], dtype=np.int64), "draft_ids": np.array([draft_ids], dtype=np.int64)}

    def release(self, seq_id: int | None = None) -> None:
        if self.batched:
            self.batcher.release(self.seq_id)
        else:
            super().release(self._inputs([], []))
