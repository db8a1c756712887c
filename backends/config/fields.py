"""Step 1 of resolving a speculative config: each field as the user gave it, its type and
range (vLLM's pydantic model, but strict: ``true`` is not an int, ``"3"`` is not an int), and
the parsers of the fields with a structure of their own (the dynamic-K schedule, the trees)."""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any

from backends.config.detect import MTP_MODEL_TYPES
from backends.config.errors import SpeculativeConfigError

if TYPE_CHECKING:
    from backends.config.speculative import SpeculativeConfig

METHODS = (
    "ngram",
    "medusa",
    "mlp_speculator",
    "draft_model",
    "suffix",
    "custom_class",
    "eagle",
    "eagle3",
    "extract_hidden_states",
    "mtp",
    *MTP_MODEL_TYPES,
    "dflash",
    "ngram_gpu",
    "dspark",
)
REJECTION_SAMPLE_METHODS = ("standard", "synthetic", "block")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
BATCH_SCHEDULE = "num_speculative_tokens_per_batch_size"
DYNAMIC_TREE_KEYS = ("top_k", "total_token")  # EAGLE-2's names; its depth is num_speculative_tokens


def validate_fields(cfg: SpeculativeConfig) -> None:
    """Every field's type and range, in vLLM's order; the dynamic-K schedule normalised and
    attention_backend read case-insensitively."""
    _check_types(vars(cfg))
    _check_values(cfg, vars(cfg))
    if cfg.num_speculative_tokens_per_batch_size is not None:
        cfg.num_speculative_tokens_per_batch_size = validate_batch_schedule(cfg.num_speculative_tokens_per_batch_size)
    # Parsed case-insensitively like vLLM's enum; "auto" means "let the engine choose".
    if cfg.attention_backend is not None:
        backend = cfg.attention_backend.upper()
        cfg.attention_backend = None if backend == "AUTO" else backend


def _check_types(v: dict[str, Any]) -> None:
    """The strings, flags and counts."""
    for name in (
        "model",
        "quantization",
        "moe_backend",
        "attention_backend",
        "kv_cache_dtype",
        "revision",
        "code_revision",
        "target_model",
        "speculative_token_map",
    ):
        check(name, v[name], v[name] is None or isinstance(v[name], str), "a valid string")
    for name in (
        "disable_padded_drafter_batch",
        "use_local_argmax_reduction",
        "use_heterogeneous_vocab",
        "parallel_drafting",
        "suffix_decoding_use_tree_spec",
    ):
        check(name, v[name], isinstance(v[name], bool), "a valid boolean")
    eager = v["enforce_eager"]
    check("enforce_eager", eager, eager is None or isinstance(eager, bool), "a valid boolean")
    k = v["num_speculative_tokens"]
    check("num_speculative_tokens", k, k is None or is_int(k), "a valid integer")
    check("num_speculative_tokens", k, k is None or k > 0, "greater than 0")
    for name in (
        "draft_tensor_parallel_size",
        "max_model_len",
        "prompt_lookup_max",
        "prompt_lookup_min",
        "target_max_model_len",
        "suffix_decoding_max_tree_nodes",
    ):
        check(name, v[name], v[name] is None or is_int(v[name]), "a valid integer")
        check(name, v[name], v[name] is None or v[name] >= 1, "greater than or equal to 1")
    tp = v["target_tensor_parallel_size"]
    check("target_tensor_parallel_size", tp, is_int(tp) and tp >= 1, "an integer >= 1")
    tp = v["tensor_parallel_size"]
    check("tensor_parallel_size", tp, tp is None or is_int(tp), "a valid integer")


def _check_values(cfg: SpeculativeConfig, v: dict[str, Any]) -> None:
    """The suffix-decoding numbers, the choices, the lists and the dictionaries."""
    for name in ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
        check(name, v[name], is_int(v[name]), "a valid integer")
    for name in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
        check(name, v[name], is_number(v[name]), "a valid number")
    check_choice("method", cfg.method, METHODS, optional=True)
    check_choice("rejection_sample_method", cfg.rejection_sample_method, REJECTION_SAMPLE_METHODS)
    check_choice("draft_sample_method", cfg.draft_sample_method, DRAFT_SAMPLE_METHODS)
    rates = cfg.synthetic_acceptance_rates
    check(
        "synthetic_acceptance_rates",
        rates,
        rates is None or (isinstance(rates, list) and all(map(is_number, rates))),
        "a list of numbers",
    )
    length = cfg.synthetic_acceptance_length
    check("synthetic_acceptance_length", length, length is None or is_number(length), "a valid number")
    for name in ("draft_load_config", "hf_overrides"):
        check(name, v[name], v[name] is None or isinstance(v[name], dict), "a valid dictionary")
    ids = cfg.eagle_aux_hidden_state_layer_ids
    check(
        "eagle_aux_hidden_state_layer_ids",
        ids,
        ids is None or (isinstance(ids, list) and all(is_int(i) and i >= 0 for i in ids)),
        "a list of non-negative integers",
    )


def validate_batch_schedule(schedule: Any) -> list[tuple[int, int, int]]:
    """vLLM's checks of num_speculative_tokens_per_batch_size: non-empty, 3-item (start, end,
    K) entries, disjoint, the first starting at 1."""
    name = BATCH_SCHEDULE
    if not isinstance(schedule, list):
        raise SpeculativeConfigError(f"{name}: input should be a list, got {schedule!r}")
    if not schedule:
        raise SpeculativeConfigError(f"{name} must not be empty")
    entries = []
    for entry in schedule:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3 or not all(is_int(x) for x in entry):
            raise SpeculativeConfigError(
                f"{name} entries must be a 3-item sequence of integers (start, end, "
                f"num_speculative_tokens), got {entry!r}"
            )
        start, end, k = entry
        if start <= 0 or end <= 0:
            raise SpeculativeConfigError(f"{name} batch sizes must be positive, got {entry!r}")
        if start > end:
            raise SpeculativeConfigError(f"{name} range start must be <= end, got {entry!r}")
        if k < 0:
            raise SpeculativeConfigError(f"{name} num_speculative_tokens values must be >= 0, got {entry!r}")
        entries.append((start, end, k))
    entries.sort()
    for (_, prev_end, _), (start, _, _) in zip(entries, entries[1:]):
        if start <= prev_end:
            raise SpeculativeConfigError(f"{name} ranges must be non-overlapping and sorted, got {schedule!r}")
    if entries[0][0] != 1:
        raise SpeculativeConfigError(f"The first batch-size range must start at 1 in {name}, got {entries[0]!r}")
    return entries


def parse_token_tree(spec: Any) -> tuple[tuple[int, ...], ...]:
    """``speculative_token_tree``: node paths of child ranks, e.g. "[(0,), (1,), (0, 0)]" (a
    Python literal as vLLM took it, or a JSON list of lists), sorted breadth-first by
    (length, path) as vLLM did. Each path's parent path must be in the tree; ranks are >= 0."""
    if isinstance(spec, str):
        try:
            spec = ast.literal_eval(spec)
        except (ValueError, SyntaxError) as e:
            raise SpeculativeConfigError(f"speculative_token_tree {spec!r} is not a list of tuples: {e}") from None
    if not isinstance(spec, (list, tuple)) or not spec:
        raise SpeculativeConfigError(f"speculative_token_tree must be a non-empty list of paths, got {spec!r}")
    paths = []
    for path in spec:
        if not isinstance(path, (list, tuple)) or not path or not all(is_int(r) and r >= 0 for r in path):
            raise SpeculativeConfigError(
                f"speculative_token_tree: each path is a non-empty tuple of ranks >= 0, got {path!r}"
            )
        paths.append(tuple(path))
    if len(set(paths)) != len(paths):
        raise SpeculativeConfigError("speculative_token_tree lists a path twice")
    paths.sort(key=lambda p: (len(p), p))
    known = set(paths)
    for path in paths:
        if len(path) > 1 and path[:-1] not in known:
            raise SpeculativeConfigError(f"speculative_token_tree: path {path} has no parent path {path[:-1]}")
    return tuple(paths)


def validate_dynamic_tree(spec: Any) -> dict[str, int]:
    """``dynamic_tree``: {"top_k": children tried per expanded node, "total_token": nodes kept}."""
    check("dynamic_tree", spec, isinstance(spec, dict), "a dictionary with keys " + ", ".join(DYNAMIC_TREE_KEYS))
    unknown = sorted(set(spec) - set(DYNAMIC_TREE_KEYS))
    if unknown:
        hint = " (its depth is num_speculative_tokens)" if "depth" in unknown else ""
        raise SpeculativeConfigError(
            f"dynamic_tree: unknown key {unknown[0]!r}{hint}; the keys are {', '.join(DYNAMIC_TREE_KEYS)}"
        )
    tree = {"top_k": 4, "total_token": 16, **spec}
    for key in DYNAMIC_TREE_KEYS:
        check(f"dynamic_tree.{key}", tree[key], is_int(tree[key]) and tree[key] >= 1, "an integer >= 1")
    return tree


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check(name: str, value: Any, ok: bool, expected: str) -> None:
    if not ok:
        raise SpeculativeConfigError(f"{name}: input should be {expected}, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[str, ...], optional: bool = False) -> None:
    ok = (optional and value is None) or (isinstance(value, str) and value in choices)
    check(name, value, ok, "one of " + ", ".join(repr(c) for c in choices))
