"""`ngram_gpu`: prompt lookup over the whole batch at once, vLLM's `NgramProposerGPU` output form.

Same proposals as `ngram` (backends/methods/ngram.py), minus its max_model_len clamp (vLLM's GPU
proposer has none; the caller's clamp to the context window still applies). The match runs on
one padded [batch, T] tensor: the OpenAI Triton kernel on CUDA (or with
TRITONSPEC_USE_KERNELS=1), its torch reference elsewhere (kernels/ngram.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from backends.config import DrafterConfig
from backends.methods.ngram import TokenHistory, check_lookup_bounds
from backends.serving.proposer import Draft, DraftRequest, Proposer, ProposerContext
from kernels.ngram import ngram_match, ngram_match_ref


class NgramGPUProposer(Proposer):
    def __init__(
        self,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        num_speculative_tokens: int,
        device: torch.device | str | None = None,
    ) -> None:
        check_lookup_bounds(prompt_lookup_min, prompt_lookup_max)
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.k = num_speculative_tokens
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.history = TokenHistory()

    @classmethod
    def from_config(cls, config: DrafterConfig, ctx: ProposerContext) -> NgramGPUProposer:
        return cls(config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens, ctx.device)

    def propose_batch(self, sequences: Sequence[Sequence[int] | np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts [batch, K] int32 padded with -1, num_valid_draft_tokens [batch] int32)."""
        seq_lens = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
        padded = np.zeros((len(sequences), int(seq_lens.max(initial=0))), dtype=np.int64)
        for row, seq in zip(padded, sequences):
            row[: len(seq)] = seq
        tokens = torch.from_numpy(padded).to(self.device)
        lens = torch.from_numpy(seq_lens).to(self.device)
        use_kernel = self.device.type == "cuda" or os.environ.get("TRITONSPEC_USE_KERNELS") == "1"
        match = ngram_match if use_kernel else ngram_match_ref
        return match(tokens, lens, self.min_n, self.max_n, self.k)

    def propose(self, batch: list[DraftRequest]) -> list[Draft]:
        drafts, num_valid = self.propose_batch([self.history.update(r.seq_id, r.token_ids, r.num_new) for r in batch])
        rows, counts = drafts.tolist(), num_valid.tolist()
        return [Draft(row[: min(count, r.num_draft_tokens)]) for row, count, r in zip(rows, counts, batch)]

    def release(self, seq_id: int) -> None:
        self.history.release(seq_id)
