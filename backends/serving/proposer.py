"""The proposer interface every drafting method implements, and the registry that maps a
`method` name from the speculative config to its module.

A proposer is batched from the start: it gets the sequences that need drafts in this step
and returns one draft per sequence. State per sequence (n-gram indexes, suffix trees, KV
caches) is keyed by the sequence id and dropped in `release`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class DraftRequest:
    """What a proposer sees of one sequence in one step."""

    seq_id: int
    token_ids: list[int]  # the whole sequence so far: prompt + accepted output
    num_tokens: int  # the most drafts wanted this step (already clamped by the caller)
    # [rows, layers, H]: the target's states since the last call, for methods that draft from them
    hidden_states: torch.Tensor | None = None
    # The request's sampling temperature: probabilistic drafting samples at it; below 1e-5
    # (a greedy request) every method drafts the argmax.
    temperature: float = 1.0


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # [len(token_ids), V] when the method has them


class Proposer:
    """Base class: `propose` is the only required method."""

    # Target layers whose hidden states the proposer needs (empty = token ids are enough).
    hidden_layer_ids: tuple[int, ...] = ()
    # False: it never drafts, it only names layers whose states each step returns
    # (extract_hidden_states); the drafter then reports k = 0.
    proposes_drafts: bool = True

    def propose(self, batch: list[DraftRequest]) -> list[Draft]:
        raise NotImplementedError

    def release(self, seq_id: int) -> None:
        """Forget everything kept for `seq_id` (end, cancel or idle timeout)."""


class SequenceProposer(Proposer):
    """A proposer that keeps state per sequence between steps (a KV cache, a context) in `_seqs`."""

    def __init__(self) -> None:
        self._seqs: dict[int, Any] = {}

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)


# method name -> "module:Class"; importing lazily keeps model-free methods free of model code.
_REGISTRY: dict[str, str] = {
    "ngram": "backends.methods.ngram:NgramDrafter",
    "ngram_gpu": "backends.methods.ngram_gpu:NgramGPUDrafter",
    "suffix": "backends.methods.suffix:SuffixDrafter",
    "draft_model": "backends.methods.draft_model:DraftModelProposer",
    "eagle": "backends.methods.eagle:EagleProposer",
    "eagle3": "backends.methods.eagle:Eagle3Proposer",
    "medusa": "backends.methods.medusa:MedusaProposer",
    "mlp_speculator": "backends.methods.mlp_speculator:MLPSpeculatorProposer",
    "mtp": "backends.methods.mtp:MTPProposer",
    "dflash": "backends.methods.dflash:DFlashProposer",
    "dspark": "backends.methods.dspark:DSparkProposer",
    "extract_hidden_states": "backends.methods.extract_hidden_states:HiddenStateExtractor",
    "custom_class": "backends.methods.custom_class:CustomClass",
}


def register_proposer(method: str, target: str) -> None:
    """Register `target` ("package.module:Class") as the proposer for `method`."""
    _REGISTRY[method] = target


def registered_methods() -> list[str]:
    return sorted(_REGISTRY)


def proposer_class(method: str) -> Callable[..., Proposer]:
    if method not in _REGISTRY:
        raise ValueError(
            f"speculative method {method!r} has no drafter backend here; "
            f"available: {', '.join(registered_methods())}"
        )
    module_name, _, cls_name = _REGISTRY[method].partition(":")
    return getattr(importlib.import_module(module_name), cls_name)


def build_proposer(config: Any, **context: Any) -> Proposer:
    """Instantiate the proposer that `config.method` names."""
    return proposer_class(config.method).from_config(config, **context)
