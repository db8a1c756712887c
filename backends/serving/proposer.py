"""The proposer interface every drafting method implements, and the registry that maps a
`method` name from the speculative config to its module.

A proposer is batched from the start: it gets the sequences that need drafts in this step
and returns one draft per sequence. State per sequence (n-gram indexes, suffix trees, KV
caches) is keyed by the sequence id and dropped in `release`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from backends.config import DrafterConfig, SpeculativeConfig
from backends.serving.rejection import new_generator
from backends.serving.tree import DraftTree, best_nodes, subtree_parents


@dataclass
class DraftRequest:
    """What a proposer sees of one sequence in one step."""

    seq_id: int
    token_ids: list[int]  # the whole sequence so far: prompt + accepted output (grows in place)
    num_draft_tokens: int  # k: the most drafts wanted this step (already clamped by the caller)
    # [rows, layers, H]: the target's states since the last call, for methods that draft from them
    hidden_states: torch.Tensor | None = None
    # The request's sampling temperature: probabilistic drafting samples at it; below 1e-5
    # (a greedy request) every method drafts the argmax.
    temperature: float = 1.0
    # Tokens appended since this proposer's last call for the sequence (all of them on the first).
    num_new: int | None = None
    # Of the drafts this proposer made on its last call for the sequence, how many the target
    # accepted (as Hugging Face's update_candidate_strategy is told).
    num_accepted: int = 0
    seed: int | None = None  # the request's seed: its draft samples come from its own generator
    # The most tree nodes wanted (at most num_draft_tokens levels deep); 0: draft a chain.
    num_nodes: int = 0

    def __post_init__(self) -> None:
        if self.num_new is None:
            self.num_new = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        """num_draft_tokens under its earlier name: custom proposers written against it still run."""
        return self.num_draft_tokens

    @property
    def num_kept(self) -> int:
        """How many tokens of the proposer's view after its last call (that context + the
        drafts it made) are still the sequence: roll back anything past this."""
        return len(self.token_ids) - self.num_new + self.num_accepted


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # [len(token_ids), V] when the method has them
    # A tree: each node's parent (-1 = the root), nodes in topological order
    # (backends/serving/tree.py); None: a chain.
    parents: list[int] | None = None
    # Node scores: the drafter's probability of each node's whole path (EAGLE-2's cumulative
    # confidence; a chain's position i: of its first i + 1 drafts); the orchestrator verifies
    # the best-scored nodes that pay (adaptive.DraftCut). None: the draft is verified whole.
    scores: list[float] | None = None

    def best(self, size: int) -> Draft:
        """This draft cut to its `size` nodes of the highest score (closed under parents, as a
        node never scores above its parent), parents first; a chain to its first `size`."""
        if self.parents is None:
            return self.nodes(list(range(min(size, len(self.token_ids)))))
        return self.nodes(best_nodes(self.scores, DraftTree(tuple(self.token_ids), tuple(self.parents)).depths, size))

    def nodes(self, kept: list[int]) -> Draft:
        """The subtree of these nodes (each after its parent), renumbered."""
        return Draft(
            [self.token_ids[i] for i in kept],
            None if self.probs is None else self.probs[kept],
            None if self.parents is None else subtree_parents(self.parents, kept),
            None if self.scores is None else [self.scores[i] for i in kept],
        )


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer is built with besides its config: the serving side's settings and the
    target it drafts for."""

    max_model_len: int  # the context window: no draft goes past it
    target_model: str | Path | None = None  # the target's directory (its config, tokenizer, embedding)
    dtype: str = "bfloat16"  # the drafter's weights
    device: str = "cpu"  # where the drafter runs ("cpu", "cuda:0", ...)
    seed: int | None = None  # seeds the proposer's own generator (for requests that bring none)


class Proposer:
    """Base class: `propose` is the only required method; `from_config` is how the registry
    builds one."""

    # Target layers whose hidden states the proposer needs (empty = token ids are enough).
    hidden_layer_ids: tuple[int, ...] = ()
    # False: it never drafts, it only names layers whose states each step returns
    # (extract_hidden_states); the orchestrator then asks the verifier for them directly.
    proposes_drafts: bool = True
    # True: it drafts from token ids alone, in microseconds, and holds no model, so the
    # `speculative` model may run it in its own process (its `drafter_in_process`): a step
    # then makes one BLS round trip (to the verifier) instead of two.
    in_orchestrator: bool = False
    # True: a drafter model of this project's own (the heads) that the `speculative` model may
    # run in its process when it verifies there too, on the verify thread (drafter_in_process):
    # no BLS round trip a step. Never user code (custom_class): a call that hangs there would
    # stall every sequence's verification, where over BLS it is abandoned (drafter_timeout_s).
    beside_verifier: bool = False
    device = torch.device("cpu")  # where sampled drafts are drawn

    @classmethod
    def from_config(cls, config: DrafterConfig, ctx: ProposerContext) -> Proposer:
        """The proposer `config` describes, built for the serving side's `ctx`. The default
        is `cls(config)` (a custom proposer that needs nothing more)."""
        return cls(config)

    def propose(self, batch: list[DraftRequest]) -> list[Draft]:
        raise NotImplementedError

    def release(self, seq_id: int) -> None:
        """Forget everything kept for `seq_id` (end, cancel or idle timeout)."""

    @classmethod
    def layers_for(cls, config: Any, target_model: Any = None) -> tuple[int, ...]:
        """The target layers a proposer built from `config` will ask for, known without
        loading it (the orchestrator learns them at load)."""
        return cls.hidden_layer_ids


def check_one_device(config: Any, what: str) -> None:
    """Drafters run on one device here: refuse vLLM's draft_tensor_parallel_size above 1."""
    if (config.draft_tensor_parallel_size or 1) != 1:
        raise ValueError(
            f"draft_tensor_parallel_size={config.draft_tensor_parallel_size}: {what} runs on one device here; use 1"
        )


class SequenceProposer(Proposer):
    """A proposer that keeps state per sequence between steps (a KV cache, a context) in `_seqs`,
    and draws each sequence's sampled drafts from that sequence's own generator (seeded by
    its request), so a seeded request drafts the same whoever else is being served."""

    def __init__(self) -> None:
        self._seqs: dict[int, Any] = {}
        self._generators: dict[int, torch.Generator] = {}

    def generator_for(self, req: DraftRequest) -> torch.Generator | None:
        """A seeded request's own generator (created on its first call); the proposer's shared
        one (`self.generator`, if it samples) for the others."""
        if req.seed is None:
            return getattr(self, "generator", None)
        if req.seq_id not in self._generators:
            self._generators[req.seq_id] = new_generator(self.device, req.seed)
        return self._generators[req.seq_id]

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self._generators.pop(seq_id, None)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)


@dataclass(frozen=True)
class DrafterInfo:
    """What the orchestrator knows of its drafter, from the config, at load."""

    config: DrafterConfig  # k, its per-request and batch-size rules, the rejection method
    hidden_layer_ids: tuple[int, ...]  # target layers it drafts from (or extracts)
    proposes_drafts: bool = True  # False: it only names layers to extract (extract_hidden_states)
    in_orchestrator: bool = False  # it may draft in the orchestrator's process (Proposer.in_orchestrator)
    beside_verifier: bool = False  # it may draft beside an in-process verifier (Proposer.beside_verifier)

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens


def describe_drafter(config: SpeculativeConfig | DrafterConfig, target_model: Any = None) -> DrafterInfo:
    """The drafter that `config` builds, without building it."""
    config = _runtime_config(config)
    cls = proposer_class(config.method)
    layers = tuple(cls.layers_for(config, target_model))
    return DrafterInfo(config, layers, cls.proposes_drafts, cls.in_orchestrator, cls.beside_verifier)


def check_layers(proposer: Proposer, info: DrafterInfo) -> None:
    """A built proposer must read the target layers its config described: the orchestrator
    learnt them from the config alone (describe_drafter) and asks the verifier for those."""
    if tuple(proposer.hidden_layer_ids) != info.hidden_layer_ids:
        raise RuntimeError(
            f"{info.method} proposer asks for target layers {proposer.hidden_layer_ids}, "
            f"but its config describes {info.hidden_layer_ids}; a custom proposer declares "
            "hidden_layer_ids as a class attribute"
        )


# method name -> "module:Class"; importing lazily keeps model-free methods free of model code.
_REGISTRY: dict[str, str] = {
    "ngram": "backends.methods.ngram:PromptLookupProposer",
    "ngram_gpu": "backends.methods.ngram_gpu:NgramGPUProposer",
    "suffix": "backends.methods.suffix:SuffixProposer",
    "draft_model": "backends.methods.draft_model:DraftModelProposer",
    "eagle": "backends.methods.eagle:EagleProposer",
    "eagle3": "backends.methods.eagle:Eagle3Proposer",
    "medusa": "backends.methods.medusa:MedusaProposer",
    "mlp_speculator": "backends.methods.mlp_speculator:MLPSpeculatorProposer",
    "mtp": "backends.methods.mtp:MTPProposer",
    "dflash": "backends.methods.dflash:DFlashProposer",
    "dspark": "backends.methods.dspark:DSparkProposer",
    "extract_hidden_states": "backends.methods.extract_hidden_states:ExtractHiddenStatesProposer",
    "custom_class": "backends.methods.custom_class:CustomClassProposer",
}


def register_proposer(method: str, target: str) -> None:
    """Register `target` ("package.module:Class") as the proposer for `method`."""
    _REGISTRY[method] = target


def registered_methods() -> list[str]:
    return sorted(_REGISTRY)


def proposer_class(method: str) -> type[Proposer]:
    if method not in _REGISTRY:
        raise ValueError(
            f"speculative method {method!r} has no drafter backend here; available: {', '.join(registered_methods())}"
        )
    module_name, _, cls_name = _REGISTRY[method].partition(":")
    return getattr(importlib.import_module(module_name), cls_name)


def build_proposer(config: SpeculativeConfig | DrafterConfig, **context: Any) -> Proposer:
    """Instantiate the proposer that `config.method` names, from the small resolved runtime
    config (DrafterConfig) rather than the vLLM parsing state; `context`: the fields of its
    ProposerContext (max_model_len=..., target_model=..., ...)."""
    return proposer_class(config.method).from_config(_runtime_config(config), ProposerContext(**context))


def _runtime_config(config: SpeculativeConfig | DrafterConfig) -> DrafterConfig:
    return DrafterConfig.from_speculative(config) if isinstance(config, SpeculativeConfig) else config
