"""The drafter side of a step: keeps each sequence's tokens (the orchestrator sends only
what is new since the last call), clamps the draft length, and calls the proposer batched.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from backends.config import SpeculativeConfig
from backends.serving.proposer import Draft, DraftRequest, Proposer
from backends.serving.rejection import GREEDY_TEMPERATURE_EPS

log = logging.getLogger("tritonspec.drafter")


@dataclass
class DraftCall:
    seq_id: int
    new_token_ids: list[int]  # tokens appended since the last call (the prompt on the first)
    max_tokens: int  # the caller's clamp: room left in max_tokens and the context window
    requested: int | None = None  # the client's num_draft_tokens; None = configured
    hidden_states: torch.Tensor | None = None  # target rows since the last call (EAGLE family)
    temperature: float = 1.0  # the request's (DraftRequest.temperature)


class DraftService:
    def __init__(self, proposer: Proposer, config: SpeculativeConfig) -> None:
        self.proposer = proposer
        self.config = config
        self._tokens: dict[int, list[int]] = {}
        self._last_used: dict[int, float] = {}

    @property
    def num_speculative_tokens(self) -> int:
        """The configured k, or 0 for a proposer that never drafts."""
        return self.config.num_speculative_tokens if self.proposer.proposes_drafts else 0

    def num_tokens(self, call: DraftCall) -> int:
        """Drafts for this call: the client's number (SpeculativeConfigError when above the
        configured k), capped by the batch-size schedule at the current load and by the
        caller's room."""
        load = max(1, len(self._tokens))
        k = min(self.config.num_tokens_for_request(call.requested), self.config.num_tokens_for_batch_size(load))
        return max(0, min(k, call.max_tokens))

    def draft(self, calls: list[DraftCall]) -> list[Draft]:
        now = time.monotonic()
        batch, drafts = [], [Draft() for _ in calls]
        index = []
        for i, call in enumerate(calls):
            tokens = self._tokens.setdefault(call.seq_id, [])
            tokens.extend(call.new_token_ids)
            self._last_used[call.seq_id] = now
            k = self.num_tokens(call)
            if k > 0 and tokens:
                batch.append(DraftRequest(call.seq_id, tokens, k, call.hidden_states, call.temperature))
                index.append(i)
        for i, draft in zip(index, self.proposer.propose(batch) if batch else []):
            if calls[i].temperature < GREEDY_TEMPERATURE_EPS:
                draft.probs = None  # a greedy request's verification never reads q
            drafts[i] = draft
        return drafts

    def release(self, seq_id: int) -> bool:
        self.proposer.release(seq_id)
        self._last_used.pop(seq_id, None)
        return self._tokens.pop(seq_id, None) is not None

    def release_idle(self, idle_s: float) -> list[int]:
        now = time.monotonic()
        stale = [sid for sid, t in self._last_used.items() if now - t > idle_s]
        for sid in stale:
            self.release(sid)
        if stale:
            log.warning("released %d idle sequences: %s", len(stale), stale)
        return stale

    @property
    def num_sequences(self) -> int:
        return len(self._tokens)
