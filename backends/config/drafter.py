"""The resolved runtime config a proposer is built from: what a :class:`SpeculativeConfig`
decided, without its vLLM parsing state, so no loader parses the JSON or re-reads the
draft's ``config.json``: ``checkpoint_config`` is the file as read during resolution, for
the head loaders, and ``draft_hf_config`` the same with ``hf_overrides`` and vLLM's rewrites
applied. Field names are the SpeculativeConfig ones.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Any

from backends.config.speculative import SpeculativeConfig, batch_num_draft_tokens, request_num_draft_tokens


@dataclass(frozen=True)
class DrafterConfig:
    """What one proposer needs, resolved once at load. Build it with :meth:`from_speculative`."""

    method: str
    model: str | None  # draft model or head path; the method name for model-free methods
    num_speculative_tokens: int  # k
    # The draft's config.json as resolved (a copy of the SpeculativeConfig's). For ngram and
    # custom_class it is the target's, for extract_hidden_states the target's plus the ids.
    draft_hf_config: dict[str, Any]
    draft_sample_method: str = "greedy"
    # (start, end, k) batch-size ranges of vLLM's dynamic schedule; None: always k.
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    quantization: str | None = None
    draft_tensor_parallel_size: int = 1
    # Target layers whose hidden states the drafter takes (eagle3, dflash, dspark) or
    # extracts (extract_hidden_states): verifier numbering, see backends/serving/target.py.
    eagle_aux_hidden_state_layer_ids: tuple[int, ...] | None = None
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: tuple[float, ...] | None = None  # per position, synthetic only
    use_heterogeneous_vocab: bool = False
    hf_overrides: dict[str, Any] | None = None  # keys over a checkpoint's own config.json (dflash/dspark)
    # The checkpoint's own config.json as resolution read it (a copy of the SpeculativeConfig's),
    # handed to the head loaders; None: nothing was read, a loader reads the file itself.
    checkpoint_config: dict[str, Any] | None = None
    max_model_len: int | None = None  # the drafter's context window, None if unknown
    # Method-specific knobs, passed through unchanged (defaults: SpeculativeConfig's).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = SpeculativeConfig.suffix_decoding_max_tree_depth
    suffix_decoding_max_cached_requests: int = SpeculativeConfig.suffix_decoding_max_cached_requests
    suffix_decoding_max_spec_factor: float = SpeculativeConfig.suffix_decoding_max_spec_factor
    suffix_decoding_min_token_prob: float = SpeculativeConfig.suffix_decoding_min_token_prob
    # Draft trees (at most one is set; backends/serving/tree.py): a static tree's node paths
    # (sorted breadth-first), EAGLE-2's {"top_k", "total_token"}, or suffix subtrees.
    speculative_token_tree: tuple[tuple[int, ...], ...] | None = None
    dynamic_tree: dict[str, int] | None = None
    suffix_decoding_use_tree_spec: bool = False
    suffix_decoding_max_tree_nodes: int | None = None
    speculative_token_map: str | None = None  # a file of target token ids (methods/draft_vocab.py)

    @classmethod
    def from_speculative(cls, config: SpeculativeConfig) -> DrafterConfig:
        """The runtime config of a resolved :class:`SpeculativeConfig`: its fields of the same
        names, copied (a proposer cannot change the SpeculativeConfig's), lists as tuples."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = copy.deepcopy(getattr(config, f.name))
            values[f.name] = tuple(value) if isinstance(value, list) else value
        max_len = config.draft_max_model_len
        values.update(
            draft_hf_config=values["draft_hf_config"] or {},
            draft_tensor_parallel_size=values["draft_tensor_parallel_size"] or 1,
            # Model-free methods have no draft length of their own: the target's bounds them.
            max_model_len=config.target_max_model_len if max_len is None else max_len,
        )
        return cls(**values)

    def num_draft_tokens_for_request(self, requested: int | None) -> int:
        """K for one request: its ``num_draft_tokens`` if given (0 turns speculation off)."""
        return request_num_draft_tokens(self.num_speculative_tokens, requested)

    def max_tree_nodes(self, k: int) -> int:
        """The most nodes a tree of at most `k` levels may have under this config; 0 when the
        method drafts chains."""
        if self.speculative_token_tree is not None:
            return sum(len(path) <= k for path in self.speculative_token_tree)
        if self.dynamic_tree is not None:
            return max(k, self.dynamic_tree["total_token"])
        # Suffix trees: suffix_decoding_max_tree_nodes nodes, however few levels the step allows.
        return self.suffix_decoding_max_tree_nodes if self.suffix_decoding_use_tree_spec else 0

    def num_draft_tokens_for_batch_size(self, batch_size: int) -> int:
        """K for a batch of this size under the dynamic schedule (k without one)."""
        return batch_num_draft_tokens(
            self.num_speculative_tokens, self.num_speculative_tokens_per_batch_size, batch_size
        )
