"""The drafter side of a step: keeps each sequence's tokens (the orchestrator sends only
what is new since the last call, and the k it decided), and calls the proposer batched.

What a proposer is told per sequence (DraftRequest): the whole sequence, how many of its
tokens are new since the proposer last saw it, and how many of the drafts it made then were
accepted. A call for k = 0 does not reach the proposer: its new tokens and hidden-state
rows wait for the next call that does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from backends.config import SpeculativeConfig
from backends.serving.idle import release_idle
from backends.serving.proposer import Draft, DraftRequest, Proposer
from backends.serving.request import is_greedy

log = logging.getLogger("tritonspec.drafter")


@dataclass
class DraftCall:
    seq_id: int
    new_token_ids: list[int]  # tokens appended since the last call (the prompt on the first)
    num_draft_tokens: int  # k for this step, decided by the orchestrator (orchestrator.draft_length)
    hidden_states: torch.Tensor | None = None  # target rows since the last call (EAGLE family)
    temperature: float = 1.0  # the request's (DraftRequest.temperature)
    num_accepted: int = 0  # how many drafts of this drafter's last answer the target accepted
    seed: int | None = None  # a seeded request's: its sampled drafts come from its own generator
    num_nodes: int = 0  # the most tree nodes wanted (DraftRequest.num_nodes); 0: a chain


@dataclass
class _Sequence:
    token_ids: list[int] = field(default_factory=list)
    num_new: int = 0  # tokens the proposer has not seen yet
    num_accepted: int = 0  # of the proposer's last drafts
    answered_drafts: bool = False  # the last answer carried drafts (num_accepted refers to them)
    hidden: list[torch.Tensor] = field(default_factory=list)  # rows the proposer has not seen yet
    last_used: float = 0.0  # on DraftService.clock, when its last step ended


class DraftService:
    def __init__(self, proposer: Proposer, config: SpeculativeConfig) -> None:
        self.proposer = proposer
        self.config = config
        self._seqs: dict[int, _Sequence] = {}
        # What idleness is measured on; the Triton drafter counts only the time it waits for
        # work (sequence_model.IdleClock), so a step queued behind others never looks idle.
        self.clock: Callable[[], float] = time.monotonic

    @property
    def num_speculative_tokens(self) -> int:
        """The configured k, or 0 for a proposer that never drafts."""
        return self.config.num_speculative_tokens if self.proposer.proposes_drafts else 0

    def draft(self, calls: list[DraftCall]) -> list[Draft]:
        batch, index = [], []
        for i, call in enumerate(calls):
            seq = self._take(call)
            if call.num_draft_tokens > 0 and seq.token_ids:
                hidden = torch.cat(seq.hidden) if seq.hidden else None
                batch.append(
                    DraftRequest(
                        call.seq_id,
                        seq.token_ids,
                        call.num_draft_tokens,
                        hidden,
                        call.temperature,
                        seq.num_new,
                        seq.num_accepted,
                        call.seed,
                        call.num_nodes,
                    )
                )
                index.append(i)
        drafts = [Draft() for _ in calls]
        for i, draft in zip(index, self.proposer.propose(batch) if batch else []):
            if is_greedy(calls[i].temperature):
                draft.probs = None  # a greedy request's verification never reads q
            drafts[i] = draft
            seq = self._seqs[calls[i].seq_id]
            seq.num_new, seq.num_accepted, seq.hidden = 0, 0, []
            seq.answered_drafts = bool(draft.token_ids)
        now = self.clock()
        for call in calls:
            self._seqs[call.seq_id].last_used = now  # idleness counts from the end of a step
        return drafts

    def _take(self, call: DraftCall) -> _Sequence:
        """Add a call's new tokens, hidden rows and acceptance to its sequence."""
        seq = self._seqs.setdefault(call.seq_id, _Sequence())
        seq.token_ids.extend(call.new_token_ids)
        seq.num_new += len(call.new_token_ids)
        if call.hidden_states is not None:
            seq.hidden.append(call.hidden_states)
        if seq.answered_drafts:  # the count refers to the proposer's last drafts
            seq.num_accepted, seq.answered_drafts = call.num_accepted, False
        return seq

    def release(self, seq_id: int) -> bool:
        self.proposer.release(seq_id)
        return self._seqs.pop(seq_id, None) is not None

    def release_idle(self, idle_s: float, keep: Collection[int] = ()) -> list[int]:
        """Release sequences idle for `idle_s` since their last step ended; `keep`: those with
        a step in hand (never idle, however long that step waited)."""
        return release_idle(self._seqs, self.clock(), idle_s, keep, self.release, log)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)
