"""Step 3 of resolving a speculative config, vLLM's ``_verify_args``: the fields' combinations
once the method is resolved (tensor parallelism, vocabularies, synthetic acceptance, trees)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from backends.config.detect import hf_lookup
from backends.config.errors import SpeculativeConfigError
from backends.config.fields import parse_token_tree, validate_dynamic_tree

if TYPE_CHECKING:
    from backends.config.speculative import SpeculativeConfig

# Which methods draft which kind of tree, and how many nodes one tree may have (the verifier's
# per-step limit, vLLM's MAX_SPEC_LEN).
TREE_METHODS = {
    "speculative_token_tree": ("medusa", "eagle", "eagle3", "mtp", "draft_model"),
    "dynamic_tree": ("eagle", "eagle3", "mtp"),
    "suffix_decoding_use_tree_spec": ("suffix",),
}
MAX_TREE_NODES = 128
# The methods whose heads may draft over the target's whole vocabulary (Medusa: FasterDecoding's
# layout): a speculative_token_map cuts their LM heads (backends/methods/draft_vocab.py).
TOKEN_MAP_METHODS = ("eagle", "mtp", "mlp_speculator", "medusa")


def verify_args(cfg: SpeculativeConfig) -> None:
    """vLLM's _verify_args: the fields' combinations, once the method is resolved (synthetic
    acceptance rates and trees filled in)."""
    if cfg.tensor_parallel_size is not None:
        raise SpeculativeConfigError(
            "'tensor_parallel_size' is not a valid argument in the speculative_config. "
            "Please pass 'draft_tensor_parallel_size' instead."
        )
    if cfg.num_speculative_tokens is None:
        raise SpeculativeConfigError(
            "num_speculative_tokens must be provided with speculative model unless the "
            "draft model config contains an n_predict parameter."
        )
    _resolve_synthetic_rates(cfg)
    _validate_trees(cfg)
    _validate_token_map(cfg)
    if cfg.disable_padded_drafter_batch and (
        cfg.parallel_drafting or cfg.method in ("draft_model", "extract_hidden_states")
    ):
        what = "parallel_drafting" if cfg.parallel_drafting else f"method='{cfg.method}'"
        raise SpeculativeConfigError(f"disable_padded_drafter_batch is not supported with {what}")
    if cfg.use_heterogeneous_vocab:
        if cfg.method != "draft_model":
            raise SpeculativeConfigError(
                f"use_heterogeneous_vocab only works with method='draft_model', got method='{cfg.method}'"
            )
        if cfg.draft_sample_method != "greedy":
            raise SpeculativeConfigError(
                "use_heterogeneous_vocab currently only supports greedy draft sampling "
                f"(draft_sample_method='greedy'), got '{cfg.draft_sample_method}'"
            )
    elif cfg.method == "draft_model":
        target = hf_lookup(cfg.target_hf_config, "vocab_size")
        draft = hf_lookup(cfg.draft_hf_config or {}, "vocab_size")
        if target is not None and draft is not None and target != draft:
            raise SpeculativeConfigError(
                "Target and draft model should have the same vocabulary size. Target model "
                f"vocab_size={target}. Draft model vocab_size={draft}. Set "
                "use_heterogeneous_vocab=true for a draft with another vocabulary."
            )
    if cfg.method == "draft_model" and cfg.draft_tensor_parallel_size != cfg.target_tensor_parallel_size:
        raise SpeculativeConfigError(
            "Currently, 'draft_tensor_parallel_size' and 'tensor_parallel_size' must be the "
            f"same for draft_model (draft_tensor_parallel_size="
            f"{cfg.draft_tensor_parallel_size}, target {cfg.target_tensor_parallel_size})"
        )


def _validate_trees(cfg: SpeculativeConfig) -> None:
    """At most one tree option, on a method that drafts that kind of tree, within k levels
    and MAX_TREE_NODES nodes; synthetic acceptance (per chain position) takes no tree."""
    given = [
        name
        for name in ("speculative_token_tree", "dynamic_tree", "suffix_decoding_use_tree_spec")
        if getattr(cfg, name) not in (None, False)
    ]
    if cfg.suffix_decoding_max_tree_nodes is not None and not cfg.suffix_decoding_use_tree_spec:
        raise SpeculativeConfigError(
            "suffix_decoding_max_tree_nodes sizes the trees of suffix_decoding_use_tree_spec: set that too"
        )
    if not given:
        return
    if len(given) > 1:
        raise SpeculativeConfigError(f"{' and '.join(given)} are alternatives: give one")
    name = given[0]
    if cfg.method not in TREE_METHODS[name]:
        raise SpeculativeConfigError(
            f"{name} applies to method {' / '.join(TREE_METHODS[name])}, not method='{cfg.method}'"
        )
    if cfg.rejection_sample_method == "synthetic":
        raise SpeculativeConfigError(f"{name} cannot be combined with rejection_sample_method='synthetic'")
    k = cfg.num_speculative_tokens
    if name == "speculative_token_tree":
        cfg.speculative_token_tree = parse_token_tree(cfg.speculative_token_tree)
        off_chain = [p for p in cfg.speculative_token_tree if any(p[:-1])]
        if cfg.method == "draft_model" and off_chain:
            raise SpeculativeConfigError(
                f"speculative_token_tree path {off_chain[0]}: draft_model's tree branches off its chain "
                "only (every rank but a path's last is 0)"
            )
        depth = max(map(len, cfg.speculative_token_tree))
        if depth > k:
            raise SpeculativeConfigError(
                f"speculative_token_tree is {depth} levels deep, more than num_speculative_tokens={k}"
            )
        nodes = len(cfg.speculative_token_tree)
    elif name == "dynamic_tree":
        cfg.dynamic_tree = validate_dynamic_tree(cfg.dynamic_tree)
        nodes = cfg.dynamic_tree["total_token"]
    else:
        # Suffix trees are num_speculative_tokens deep; twice as many nodes leave room for
        # the alternatives a chain of that length cannot hold.
        if cfg.suffix_decoding_max_tree_nodes is None:
            cfg.suffix_decoding_max_tree_nodes = min(2 * k, MAX_TREE_NODES)
        name, nodes = "suffix_decoding_max_tree_nodes", cfg.suffix_decoding_max_tree_nodes
    if nodes > MAX_TREE_NODES:
        raise SpeculativeConfigError(f"{name}: {nodes} tree nodes, at most {MAX_TREE_NODES} per step")


def _validate_token_map(cfg: SpeculativeConfig) -> None:
    """A speculative_token_map cuts the LM head of a head that drafts over the target's whole
    vocabulary; the others have a draft vocabulary of their own."""
    if cfg.speculative_token_map is None:
        return
    if cfg.method not in TOKEN_MAP_METHODS:
        raise SpeculativeConfigError(
            f"speculative_token_map applies to method {' / '.join(TOKEN_MAP_METHODS)} (heads that draft over "
            f"the target's whole vocabulary), not method='{cfg.method}'; eagle3, dflash and dspark "
            "checkpoints carry a draft vocabulary of their own"
        )
    if not Path(cfg.speculative_token_map).expanduser().is_file():
        raise SpeculativeConfigError(f"speculative_token_map: no such file: {cfg.speculative_token_map}")


def _resolve_synthetic_rates(cfg: SpeculativeConfig) -> None:
    rates, length = cfg.synthetic_acceptance_rates, cfg.synthetic_acceptance_length
    k = cfg.num_speculative_tokens
    if cfg.rejection_sample_method != "synthetic":
        if rates is not None or length is not None:
            raise SpeculativeConfigError(
                "synthetic_acceptance_rates / synthetic_acceptance_length are only valid "
                "with rejection_sample_method='synthetic'."
            )
        return
    if (rates is None) == (length is None):
        raise SpeculativeConfigError(
            "rejection_sample_method='synthetic' requires exactly one of "
            "synthetic_acceptance_rates or synthetic_acceptance_length."
        )
    if rates is not None:
        if len(rates) != k:
            raise SpeculativeConfigError(
                f"synthetic_acceptance_rates must have length {k} (num_speculative_tokens), got {len(rates)}."
            )
        if not all(0 <= r <= 1 for r in rates):
            raise SpeculativeConfigError(f"synthetic_acceptance_rates entries must be in [0, 1], got {rates}.")
        if any(later > earlier for earlier, later in zip(rates, rates[1:])):
            raise SpeculativeConfigError(f"synthetic_acceptance_rates must be non-increasing, got {rates}.")
    else:
        if not 1 <= length <= k + 1:
            raise SpeculativeConfigError(f"synthetic_acceptance_length must be in [1, {k + 1}], got {length}.")
        # Minimum-variance schedule: certain acceptance, one fractional step, then none.
        a = length - 1
        f = math.floor(a)
        rates = ([1.0] * f + [a - f] + [0.0] * (k - f - 1))[:k]
    cfg.synthetic_acceptance_rates = [float(r) for r in rates]
    cfg.synthetic_acceptance_length = None
