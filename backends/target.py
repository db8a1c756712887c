"""The target model: one forward over a sequence's uncached tokens plus its drafts, then
accept/reject right here so logits never leave the process.

Each sequence keeps its own KV cache. After a step the cache covers every token but the
last emitted one (that token has not been through the model yet); rejected drafts are
cropped off, so the cache never holds a token that is not part of the output.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from backends.model_store import load_causal_lm
from backends.rejection import rejection_sample
from backends.request import SamplingParams

log = logging.getLogger("tritonspec.target")


class SequenceError(ValueError):
    """A request that does not fit the sequence it names (unknown sequence, too long...)."""


@dataclass
class VerifyRequest:
    seq_id: int
    new_token_ids: list[int]  # tokens the target has not seen: the prompt on the first step
    draft_token_ids: list[int]
    sampling: SamplingParams | None = None  # given on the first step, kept for the sequence
    hidden_layer_ids: tuple[int, ...] = ()
    draft_probs: torch.Tensor | None = None  # [len(drafts), V] from drafters that have them


@dataclass
class VerifyResult:
    token_ids: list[int]  # accepted drafts + one more token (recovered or bonus)
    num_accepted: int
    forward_s: float
    hidden_states: torch.Tensor | None = None  # [kept positions, layers, hidden]


@dataclass
class _Sequence:
    cache: DynamicCache
    sampling: SamplingParams
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    last_used: float = field(default_factory=time.monotonic)


class TargetRunner:
    def __init__(
        self,
        model_path: Path,
        dtype: str = "bfloat16",
        device: str = "cpu",
        max_model_len: int | None = None,
    ) -> None:
        self.model = load_causal_lm(model_path, dtype).to(device)
        self.device = torch.device(device)
        limit = getattr(self.model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(limit, max_model_len) if max_model_len else limit
        self.sequences: dict[int, _Sequence] = {}

    def verify_batch(self, batch: list[VerifyRequest]) -> list[VerifyResult]:
        return [self.verify(r) for r in batch]

    @torch.inference_mode()
    def verify(self, req: VerifyRequest) -> VerifyResult:
        seq = self.sequences.get(req.seq_id)
        if seq is None:
            if not req.new_token_ids:
                raise SequenceError(f"sequence {req.seq_id} is unknown (ended or timed out)")
            seq = self._start(req.seq_id, req.sampling or SamplingParams())
        seq.last_used = time.monotonic()
        seq.token_ids.extend(req.new_token_ids)
        drafts = req.draft_token_ids
        pending = seq.token_ids[seq.num_cached :]
        if seq.num_cached + len(pending) + len(drafts) > self.max_model_len:
            raise SequenceError(
                f"sequence {req.seq_id}: {len(seq.token_ids)} tokens + {len(drafts)} drafts "
                f"exceed the context window of {self.max_model_len}"
            )

        start = time.perf_counter()
        input_ids = torch.tensor([pending + drafts], device=self.device)
        out = self.model(
            input_ids=input_ids,
            cache=seq.cache,
            use_cache=True,
            logits_to_keep=len(drafts) + 1,  # only the rows that verify drafts (+ bonus)
            output_hidden_states=bool(req.hidden_layer_ids),
        )
        forward_s = time.perf_counter() - start

        emitted = rejection_sample(
            drafts,
            out.logits[0],
            req.draft_probs,
            temperature=seq.sampling.temperature,
            top_k=seq.sampling.top_k,
            top_p=seq.sampling.top_p,
            generator=seq.generator,
        )
        num_accepted = len(emitted) - 1
        num_rejected = len(drafts) - num_accepted
        if num_rejected:
            seq.cache.crop(-num_rejected)
        kept = len(pending) + num_accepted
        seq.token_ids.extend(emitted)
        seq.num_cached = len(seq.token_ids) - 1
        hidden = None
        if req.hidden_layer_ids:
            # hidden_states[0] is the embedding output, so decoder layer i is at i + 1.
            layers = [out.hidden_states[i + 1 if i >= 0 else i][0, :kept] for i in req.hidden_layer_ids]
            hidden = torch.stack(layers, dim=1).float().cpu()
        return VerifyResult(emitted, num_accepted, forward_s, hidden)

    def _start(self, seq_id: int, sampling: SamplingParams) -> _Sequence:
        generator = torch.Generator(device=self.device)
        if sampling.seed is not None:
            generator.manual_seed(sampling.seed)
        else:
            generator.seed()
        seq = _Sequence(DynamicCache(config=self.model.config), sampling, generator)
        self.sequences[seq_id] = seq
        log.debug("sequence %d started (%d active)", seq_id, len(self.sequences))
        return seq

    def release(self, seq_id: int) -> bool:
        """Drop a sequence's KV cache; True when it existed."""
        return self.sequences.pop(seq_id, None) is not None

    def release_idle(self, idle_s: float) -> list[int]:
        """Drop sequences unused for `idle_s` seconds (a client vanished without END)."""
        now = time.monotonic()
        stale = [sid for sid, s in self.sequences.items() if now - s.last_used > idle_s]
        for sid in stale:
            self.release(sid)
        if stale:
            log.warning("released %d idle sequences: %s", len(stale), stale)
        return stale
