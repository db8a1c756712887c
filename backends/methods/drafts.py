"""What the model drafters share (draft_model and the trained heads: EAGLE, MTP, DFlash,
Medusa, ...): the checks of their sampling and quantization settings, how a draft is drawn
from a step's logits, how a propose call's steps become each sequence's drafts, and the size
of the lean runtime's KV pool a drafter keeps.

Greedy drafts (the default) come without probabilities: an argmax draft was drawn from a
one-hot distribution, which is what the rejection sampler assumes when it gets none (vLLM's
"one-hot treatment"). `probabilistic` drafts are sampled from the softmax at the request's
own temperature and come with it; a greedy request still drafts the argmax.
"""

from __future__ import annotations

import torch

from backends.config.fields import DRAFT_SAMPLE_METHODS
from backends.runtime.cpu_kernels import argmax_rows
from backends.serving.request import is_greedy

# The lean runtime's KV pool for a drafter (touched only where sequences write), and the room a
# sequence's reservation grows by beyond what the current call needs (fewer, longer runs).
DRAFT_KV_MEMORY_GB = 1.0
GROW_SLACK_TOKENS = 128


def check_sample_method(sample_method: str) -> None:
    if sample_method not in DRAFT_SAMPLE_METHODS:
        raise ValueError(f"draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, got {sample_method!r}")


def check_quantization_device(quantization: str, device: str) -> None:
    """quantization='int8' / 'int4' quantizes for the CPU's kernels; refuse it for other devices."""
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"quantization={quantization!r} (the CPU's {quantization} kernels) runs on the CPU only, but this "
            f"drafter's device is {device}; drop the quantization or run the drafter on cpu"
        )


def sample_drafts(
    logits: torch.Tensor,
    sample_method: str,
    temperatures: list[float],
    generators: list[torch.Generator | None],
    to_target: torch.Tensor | None = None,
    target_vocab_size: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drafts from `logits` [B, ..., V_d] (row i belongs to a request at `temperatures[i]`):
    the argmax for greedy drafting and for greedy requests (temperature < 1e-5); otherwise a
    sample from softmax(logits / temperature), as vLLM's probabilistic drafting (temperature
    only, no top-k/top-p), row i drawn with `generators[i]`. Returns the tokens [B, ...] as target ids (`to_target` maps draft
    vocabulary ids) and, when any row sampled, the probabilities [B, ..., V] in the target
    vocabulary (`target_vocab_size`; 0 outside the draft vocabulary; greedy rows' go unused)."""
    greedy = [is_greedy(t) for t in temperatures]
    tokens, probs = argmax_ids(logits), None
    if sample_method == "probabilistic" and not all(greedy):
        logits = logits.float()
        rows = (-1,) + (1,) * (tokens.dim() - 1)  # broadcasts a per-row value over a row's slots
        scale = torch.tensor([1.0 if g else t for g, t in zip(greedy, temperatures)], device=logits.device)
        probs = (logits / scale.view(*rows, 1)).softmax(dim=-1)
        if all(g is generators[0] for g in generators):  # one shared generator: one draw
            sampled = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generators[0])
        else:
            flat = probs.reshape(len(temperatures), -1, probs.shape[-1])
            sampled = torch.stack([torch.multinomial(row, 1, generator=g) for row, g in zip(flat, generators)])
        sampled = sampled.view(tokens.shape)
        tokens = torch.where(torch.tensor(greedy, device=logits.device).view(rows), tokens, sampled)
        if to_target is not None:
            probs = probs.new_zeros(*probs.shape[:-1], target_vocab_size).index_copy_(-1, to_target, probs)
    return (tokens if to_target is None else to_target[tokens]), probs


def draft_confidence(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The drafter's probability of each draft: softmax(`logits` [B, V])[b, tokens[b]] -> [B]
    (float32), the confidence EAGLE-2 ranks drafts by (Li et al., 2024, arXiv 2406.16858)."""
    logits = logits.float()
    return (logits.gather(-1, tokens.view(-1, 1)).squeeze(-1) - logits.logsumexp(-1)).exp()


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (the first of equal maxima): on the CPU in the kernel that reads
    bf16 in place, where torch widens a copy first (a row of 49152 bf16 logits here: 12 against
    56 us; of 8192: 6 against 11)."""
    if logits.device.type != "cpu" or not logits.numel():
        return logits.argmax(dim=-1)
    return torch.tensor(argmax_rows(logits.reshape(-1, logits.shape[-1]))).view(logits.shape[:-1])


def gather_drafts(
    steps: list[tuple[torch.Tensor, torch.Tensor | None]], counts: list[int]
) -> tuple[list[list[int]], list[torch.Tensor | None]]:
    """Each row's drafts from the (tokens [B], probs [B, V] or None) of every draft step, cut
    to the row's count, and its probabilities [count, V] (None for greedy drafts). The ids
    cross to the host once per propose call; the probabilities stay on the device."""
    tokens = torch.stack([t for t, _ in steps], dim=1).tolist()
    probs = None if steps[0][1] is None else torch.stack([p for _, p in steps], dim=1)
    return (
        [row[:n] for row, n in zip(tokens, counts)],
        [None if probs is None else probs[row, :n] for row, n in enumerate(counts)],
    )
