"""The drafter `tritonspec soak --chaos` serves (a custom_class proposer): prompt-lookup
drafts, and a fault whenever the soak asks for one. The soak writes a fault kind into the
file named by $TRITONSPEC_CHAOS_TRIGGER (set in the server's environment); the next batch
of drafts fails that way, once:

- `raise`: the proposer raises (the drafter model answers every request of the batch with
  an error);
- `garbage`: draft ids outside the target's vocabulary (the custom_class checks refuse them);
- `slow`: the batch takes `SLOW_S` seconds (every sequence in it waits).

Without the variable it never fails. The target verifies every draft, so no fault may change
any request's output; at most it costs speed or ends a request with an error.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from backends.config import DrafterConfig
from backends.methods.ngram import NgramProposer
from backends.serving.proposer import Draft, DraftRequest, Proposer, ProposerContext

FAULTS = ("raise", "garbage", "slow")
SLOW_S = 3.0


class ChaosNgram(Proposer):
    def __init__(self, num_speculative_tokens: int, max_model_len: int) -> None:
        self.ngram = NgramProposer(
            prompt_lookup_min=1,
            prompt_lookup_max=3,
            num_speculative_tokens=num_speculative_tokens,
            max_model_len=max_model_len,
        )
        trigger = os.environ.get("TRITONSPEC_CHAOS_TRIGGER", "")
        self.trigger = Path(trigger) if trigger else None

    @classmethod
    def from_config(cls, config: DrafterConfig, ctx: ProposerContext) -> ChaosNgram:
        return cls(config.num_speculative_tokens, ctx.max_model_len)

    def propose(self, batch: list[DraftRequest]) -> list[Draft]:
        fault = self._take_fault()
        if fault == "raise":
            raise RuntimeError("chaos: an injected drafter fault")
        if fault == "slow":
            time.sleep(SLOW_S)
        if fault == "garbage":
            return [Draft([2**40] * req.num_draft_tokens) for req in batch]
        return [Draft(self.ngram.propose(req.token_ids, req.num_draft_tokens)) for req in batch]

    def _take_fault(self) -> str:
        """The fault asked for, once: the trigger file is consumed."""
        if self.trigger is None:
            return ""
        try:
            fault = self.trigger.read_text().strip()
            self.trigger.unlink()
        except OSError:
            return ""
        return fault
