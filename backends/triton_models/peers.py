"""The orchestrator's handles on its BLS peers: the `drafter` and `verifier` models, one
handle per sequence (START on the first call, END on release). They implement the
`Drafter` / `Verifier` protocols of backends.serving.orchestrator over Triton."""
from __future__ import annotations

import numpy as np
import torch

from backends.serving.request import SamplingParams
from backends.triton_models.common import SEQUENCE_END, SEQUENCE_START, bls


class SequencePeer:
    """A sequence-batched BLS peer: START on the first call, END on release."""

    def __init__(self, model_name: str, seq_id: int) -> None:
        self.model_name = model_name
        self.seq_id = seq_id
        self.started = False

    def call(self, inputs: dict, outputs: list[str], parameters: dict | None = None) -> dict:
        flags = 0 if self.started else SEQUENCE_START
        self.started = True
        return bls(self.model_name, inputs, outputs, self.seq_id, flags, parameters)

    def release(self, empty_inputs: dict) -> None:
        if self.started:
            self.started = False
            bls(self.model_name, empty_inputs, [], self.seq_id, SEQUENCE_END)


class BlsDrafter(SequencePeer):
    # The drafter's method (metrics label) and configured k, learnt from its first answer.
    method = ""
    num_speculative_tokens: int | None = None
    hidden_layer_ids: tuple[int, ...] = ()

    def draft(self, seq_id: int, new_token_ids: list[int], max_tokens: int, requested: int | None,
              hidden_states: torch.Tensor | None = None, temperature: float = 1.0,
              ) -> tuple[list[int], torch.Tensor | None, float]:
        first = not self.method
        outputs = ["draft_ids", "propose_ms", "draft_probs"]
        if first:
            outputs += ["method", "num_speculative_tokens", "hidden_layer_ids"]
        inputs = self._inputs(new_token_ids, max_tokens, requested)
        inputs["temperature"] = np.array([[temperature]], dtype=np.float32)
        if hidden_states is not None:
            inputs["hidden_states"] = hidden_states.numpy()[None]
        out = self.call(inputs, outputs)
        if first:
            self.method = out["method"].reshape(-1)[0].decode()
            self.num_speculative_tokens = int(out["num_speculative_tokens"].item())
            self.hidden_layer_ids = tuple(out["hidden_layer_ids"].reshape(-1).tolist())
        probs = out.get("draft_probs")
        return (out["draft_ids"].reshape(-1).tolist(),
                None if probs is None else torch.from_numpy(probs.reshape(probs.shape[-2:])),
                float(out["propose_ms"].item()) / 1e3)

    @staticmethod
    def _inputs(token_ids: list[int], max_tokens: int, requested: int | None) -> dict:
        return {
            "input_ids": np.array([token_ids], dtype=np.int64),
            "max_draft_tokens": np.array([[max_tokens]], dtype=np.int32),
            "num_draft_tokens": np.array([[-1 if requested is None else requested]], dtype=np.int32),
        }

    def release(self, seq_id: int | None = None) -> None:
        super().release(self._inputs([], 0, None))


class BlsVerifier(SequencePeer):
    def verify(self, seq_id: int, new_token_ids: list[int], draft_token_ids: list[int],
               draft_probs: torch.Tensor | None, sampling: SamplingParams | None,
               max_new_tokens: int | None = None, hidden_layer_ids: tuple[int, ...] = (),
               ) -> tuple[list[int], float, torch.Tensor | None]:
        # The first step carries the sequence's sampling parameters and its KV reservation.
        params = {"sampling": sampling.to_json(), "max_new_tokens": max_new_tokens} if sampling else None
        inputs = self._inputs(new_token_ids, draft_token_ids)
        if draft_probs is not None:
            inputs["draft_probs"] = draft_probs.numpy()[None]
        outputs = ["output_ids", "forward_ms"]
        if hidden_layer_ids:
            inputs["hidden_layer_ids"] = np.array([hidden_layer_ids], dtype=np.int32)
            outputs.append("hidden_states")
        out = self.call(inputs, outputs, params)
        hidden = out.get("hidden_states")
        return (out["output_ids"].reshape(-1).tolist(), float(out["forward_ms"].item()) / 1e3,
                None if hidden is None else torch.from_numpy(hidden.reshape(hidden.shape[-3:])))

    @staticmethod
    def _inputs(token_ids: list[int], draft_ids: list[int]) -> dict:
        return {
            "input_ids": np.array([token_ids], dtype=np.int64),
            "draft_ids": np.array([draft_ids], dtype=np.int64),
        }

    def release(self, seq_id: int | None = None) -> None:
        super().release(self._inputs([], []))
