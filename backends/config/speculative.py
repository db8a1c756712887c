"""vLLM-compatible ``--speculative-config``: parsing, method resolution and validation.

The behaviour follows vLLM's ``SpeculativeConfig`` at commit c314af1
(https://github.com/vllm-project/vllm/blob/c314af1abfddff7b6cce9af578be72c496c6a5e4/vllm/config/speculative.py):
its fields and defaults (with the ngram and suffix ones), ``__post_init__``'s method
resolution, ``_verify_args``, the derived helpers, the EAGLE-3 aux layer ids and the dynamic K
schedule (``num_speculative_tokens_per_batch_size``). It is written from a description of
that code, not from the code.

Model paths are local directories (their ``config.json`` is read) or bare names (then the
name alone decides auto-detection, as if the draft config were empty).

Deliberate differences from vLLM:

* ``mlp_speculator`` is accepted *and runs here*; vLLM accepts the config but neither of its
  runners can execute it.
* Suffix decoding is implemented in this project, so there is no arctic-inference
  ``ImportError``; the range checks of ``_validate_suffix_decoding`` still apply.
* Types are strict: ``true`` is not an int and ``"3"`` is not an int (pydantic's lax mode
  would coerce both). Every error is a ``SpeculativeConfigError`` (a ``ValueError``);
  step 10 of auto-detection also is a ``NotImplementedError``, like vLLM's.
* A top-level key given both kebab- and snake-case is an error rather than last-one-wins.
* Fields this server accepts but does not act on (``NO_EFFECT_FIELDS`` and a few
  method-dependent ones) are logged when set, listed in ``no_effect_fields`` and marked in
  :meth:`SpeculativeConfig.explain`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from backends.config.detect import MTP_MODEL_TYPES, is_custom_proposer_path, speculators_spec
from backends.config.draft import resolve_draft, user_overrides
from backends.config.errors import SpeculativeConfigError
from backends.config.fields import is_int, validate_fields
from backends.config.model_config import max_position_embeddings, read_model_config, text_model_type
from backends.config.verify import verify_args

logger = logging.getLogger(__name__)

# Accepted for vLLM compatibility but read by nothing in this server (checked against
# backends/): setting one is logged as having no effect.
NO_EFFECT_FIELDS = (
    "attention_backend",
    "kv_cache_dtype",
    "enforce_eager",
    "moe_backend",
    "revision",
    "code_revision",
    "disable_padded_drafter_batch",
    "use_local_argmax_reduction",
    "parallel_drafting",
    "draft_load_config",
)

_EAGLE_FAMILY = ("eagle", "eagle3", "mtp", "dflash", "dspark")
# Methods that load no draft network, so a draft tensor-parallel size means nothing to them.
_MODEL_FREE_METHODS = ("ngram", "ngram_gpu", "suffix", "extract_hidden_states")
# Methods that draft from token ids alone, holding no model (their proposers' `in_orchestrator`):
# the `speculative` model runs them in its own process, and their drafter model, then never
# called, stands by without loading torch (triton_models/topology.py).
IN_ORCHESTRATOR_METHODS = ("ngram", "suffix")
# Trained heads run by HeadProposer: quantization 'int8' puts their own linear layers on the int8 kernel.
_HEAD_METHODS = ("eagle", "eagle3", "mtp", "medusa", "mlp_speculator", "dflash", "dspark")
# Methods that draft beside a verifier the `speculative` model runs in its own process, on its
# verify thread (their proposers' `beside_verifier`): the heads, small and this project's own.
BESIDE_VERIFIER_METHODS = _HEAD_METHODS


@dataclass
class SpeculativeConfig:
    """The resolved speculative config. Build it with :meth:`from_json`."""

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Draft trees (not in vLLM at c314af1: removed by vllm-project/vllm#42121; issue 19). A static tree as
    # node paths of child ranks (vLLM's historical field), EAGLE-2's dynamic tree, or
    # arctic-inference's suffix subtree.
    speculative_token_tree: str | list | tuple | None = None
    dynamic_tree: dict[str, Any] | None = None
    suffix_decoding_use_tree_spec: bool = False
    # The most nodes of a suffix tree draft; default 2 * num_speculative_tokens (its depth).
    suffix_decoding_max_tree_nodes: int | None = None
    draft_tensor_parallel_size: int | None = None
    tensor_parallel_size: int | None = None
    max_model_len: int | None = None
    quantization: str | None = None
    moe_backend: str | None = None
    attention_backend: str | None = None
    kv_cache_dtype: str | None = None
    revision: str | None = None
    code_revision: str | None = None
    enforce_eager: bool | None = None
    disable_padded_drafter_batch: bool = False
    use_local_argmax_reduction: bool = False
    use_heterogeneous_vocab: bool = False
    parallel_drafting: bool = False
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = None
    draft_load_config: dict[str, Any] | None = None
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: list[float] | None = None
    synthetic_acceptance_length: float | None = None
    draft_sample_method: str = "greedy"
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    # Keys written over the draft's config.json (vLLM: draft_model_config["hf_config"]).
    hf_overrides: dict[str, Any] | None = None
    # A reduced draft vocabulary (not in vLLM; SGLang's --speculative-token-map, FR-Spec): a
    # file of target token ids the LM heads of an eagle, mtp, mlp_speculator or medusa head are cut to.
    speculative_token_map: str | None = None
    # What the engine injects in vLLM (target_model_config / target_parallel_config).
    target_model: str | None = None
    target_max_model_len: int | None = None
    target_tensor_parallel_size: int = 1

    # Derived during resolution.
    resolution: str = field(default="", init=False)
    draft_max_model_len: int | None = field(default=None, init=False)
    target_hf_config: dict[str, Any] = field(default_factory=dict, init=False)
    draft_hf_config: dict[str, Any] | None = field(default=None, init=False)
    # The draft checkpoint's own config.json as read here (speculators format flattened, no
    # overrides or vLLM rewrites), so the head loaders need not read it again; None when no
    # directory was read (model-free methods, bare model names).
    checkpoint_config: dict[str, Any] | None = field(default=None, init=False)
    warnings: list[str] = field(default_factory=list, init=False)
    no_effect_fields: list[str] = field(default_factory=list, init=False)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_json(
        cls,
        spec: str | dict[str, Any],
        target_model: str | None = None,
        target_max_model_len: int | None = None,
        target_tensor_parallel_size: int = 1,
    ) -> SpeculativeConfig:
        """Parse a ``--speculative-config`` JSON object (string or dict) and resolve it.

        A target directory in speculators format replaces ``spec`` entirely (as vLLM's engine args do).
        """
        data = _parse_spec(spec)
        if read_model_config(target_model, "target_model").get("speculators_config") is not None:
            cfg = cls.from_target_speculators(target_model, target_max_model_len, target_tensor_parallel_size)
            if data:
                cfg.warn(
                    f"speculative_config {data} is discarded: {target_model!r} is a "
                    "speculators-format checkpoint that defines its own"
                )
            return cfg
        return cls(
            **_normalize_keys(data),
            target_model=target_model,
            target_max_model_len=target_max_model_len,
            target_tensor_parallel_size=target_tensor_parallel_size,
        )

    @classmethod
    def from_target_speculators(
        cls, target_dir: str, target_max_model_len: int | None = None, target_tensor_parallel_size: int = 1
    ) -> SpeculativeConfig:
        """Serve a speculators-format drafter directory: its verifier becomes the target."""
        raw = read_model_config(target_dir, "target_model")
        spec, verifier = speculators_spec(raw, target_dir)
        cfg = cls(
            **spec,
            model=target_dir,
            target_model=verifier,
            target_max_model_len=target_max_model_len,
            target_tensor_parallel_size=target_tensor_parallel_size,
        )
        cfg.resolution = (
            f"speculators_model_type {raw['speculators_model_type']!r} in "
            f"{target_dir!r} (verifier {verifier!r}); {cfg.resolution}"
        )
        return cfg

    def __post_init__(self) -> None:
        # vLLM's order: field checks (fields.py), then __post_init__ resolution (here, the
        # draft network's in draft.py), then _verify_args (verify.py).
        validate_fields(self)
        given = self._non_default_values()  # before resolution sets some of them itself
        self.target_hf_config = read_model_config(self.target_model, "target_model")
        if self.target_max_model_len is None:
            self.target_max_model_len = max_position_embeddings(self.target_hf_config)
        self._resolve_method()
        verify_args(self)
        self._flag_no_effect(given)

    # ------------------------------------------------------------------ step 2: vLLM's __post_init__

    def _resolve_method(self) -> None:
        # A. infer a missing method
        if self.method is not None:
            how = "explicit method"
        elif is_custom_proposer_path(self.model):
            self.method, how = "custom_class", f"model {self.model!r} is a dotted class path"
        elif self.model in ("ngram", "[ngram]"):
            self.method, how = "ngram", f"model {self.model!r}"
        else:
            self.method, how = "draft_model", "default draft_model"
        # B. legacy MTP method names
        if self.method in MTP_MODEL_TYPES:
            self.warn(f"method `{self.method}` is deprecated and replaced with mtp.")
            how = f"legacy method name {self.method!r} -> mtp"
            self.method = "mtp"
        # C. a K without a model
        if self.model is None and self.num_speculative_tokens is not None:
            self._default_model()
        # D. per-method branch
        if self.method in ("ngram", "ngram_gpu"):
            self._resolve_ngram()
        elif self.method == "suffix":
            self._validate_suffix_decoding()
        elif self.method == "custom_class":
            self._resolve_custom_class()
        elif self.method == "extract_hidden_states":
            self._resolve_extract_hidden_states()
        else:
            how = resolve_draft(self, how)
        self.resolution = how

    def _default_model(self) -> None:
        if self.method in ("mtp", "dspark"):
            # The draft layers live in the target checkpoint.
            if self.target_model is None:
                raise SpeculativeConfigError(f"target_model_config must be present for {self.method}")
            if self.method == "mtp" and text_model_type(self.target_hf_config) == "deepseek_v32":
                self.enforce_eager = True
            self.model = self.target_model
            if self.quantization is None:
                self.quantization = (self.target_hf_config.get("quantization_config") or {}).get("quant_method")
        elif self.method in ("ngram", "ngram_gpu", "suffix", "extract_hidden_states"):
            self.model = self.method
        elif self.method == "custom_class":
            raise SpeculativeConfigError(
                "method='custom_class' requires 'model' to contain the custom proposer module "
                "path (e.g., 'my_module.MyProposer')."
            )
        else:
            raise SpeculativeConfigError("num_speculative_tokens was provided but without speculative model.")

    def _resolve_ngram(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi  # vLLM's docstring says 1, its code mirrors the max
        elif hi is None:
            hi = lo
        if lo > hi:
            raise SpeculativeConfigError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        self.draft_hf_config = self.target_hf_config  # only its vocab size is used

    def _validate_suffix_decoding(self) -> None:
        for name, ok, bound in (
            ("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth >= 1, ">= 1"),
            ("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests >= 0, ">= 0"),
            ("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor >= 0, ">= 0"),
            ("suffix_decoding_min_token_prob", 0 <= self.suffix_decoding_min_token_prob <= 1, "in [0, 1]"),
        ):
            if not ok:
                raise SpeculativeConfigError(f"{name}={getattr(self, name)} must be {bound}")
        if self.num_speculative_tokens is None:
            # K is only a cap for suffix drafts, whose length varies per step.
            self.num_speculative_tokens = self.suffix_decoding_max_tree_depth
            self.warn(
                "num_speculative_tokens defaults to suffix_decoding_max_tree_depth="
                f"{self.suffix_decoding_max_tree_depth} for suffix decoding"
            )

    def _resolve_custom_class(self) -> None:
        self.warn("method='custom_class' is experimental")
        if self.model is not None and "." not in self.model:
            raise SpeculativeConfigError(
                f"Invalid custom proposer module path model={self.model!r}: expected 'module.ClassName'"
            )
        self.prompt_lookup_min = self.prompt_lookup_max = 0
        self.draft_hf_config = self.target_hf_config

    def _resolve_extract_hidden_states(self) -> None:
        hf = {**self.target_hf_config, **user_overrides(self), "architectures": ["ExtractHiddenStatesModel"]}
        ids = hf.get("eagle_aux_hidden_state_layer_ids")
        if self.num_speculative_tokens not in (None, 1):
            raise SpeculativeConfigError(
                f"num_speculative_tokens must be 1 for extract_hidden_states, got {self.num_speculative_tokens}"
            )
        # Missing ids are accepted here, as in vLLM: building the extractor refuses them.
        self.eagle_aux_hidden_state_layer_ids = list(ids) if ids else None
        self.draft_hf_config = hf

    # ------------------------------------------------------------------ per request / batch

    def num_draft_tokens_for_request(self, requested: int | None) -> int:
        """K for one request: its ``num_draft_tokens`` if given (0 turns speculation off)."""
        return request_num_draft_tokens(self.num_speculative_tokens, requested)

    def num_draft_tokens_for_batch_size(self, batch_size: int) -> int:
        """K for a batch of this size under the dynamic schedule (the configured K without)."""
        return batch_num_draft_tokens(
            self.num_speculative_tokens, self.num_speculative_tokens_per_batch_size, batch_size
        )

    # ------------------------------------------------------------------ vLLM's derived helpers

    def use_eagle(self) -> bool:
        """Whether the drafter consumes target hidden states."""
        return self.method in _EAGLE_FAMILY

    def use_dflash(self) -> bool:
        return self.method == "dflash"

    def use_dspark(self) -> bool:
        return self.method == "dspark"

    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    def uses_extract_hidden_states(self) -> bool:
        return self.method == "extract_hidden_states"

    def use_ngram_gpu(self) -> bool:
        return self.method == "ngram_gpu"

    def use_gemma4_mtp(self) -> bool:
        return self.method == "mtp" and self._draft_model_type() == "gemma4_mtp"

    def use_step3p5_mtp(self) -> bool:
        return self.method == "mtp" and self._draft_model_type() == "step3p5_mtp"

    def _draft_model_type(self) -> str | None:
        return (self.draft_hf_config or {}).get("model_type")

    def uses_dynamic_speculative_decoding(self) -> bool:
        return self.num_speculative_tokens_per_batch_size is not None

    @property
    def max_num_new_slots_for_drafting(self) -> int:
        """Extra KV slots per request a drafting step needs beyond the verified tokens."""
        parallel = self.num_speculative_tokens - 1 if self.parallel_drafting else 0
        return parallel + (1 if self.uses_draft_model() else 0)

    def compute_hash(self) -> str:
        """Hash of what changes the compiled graph: aux-state methods and their draft config."""
        factors: list[Any] = []
        if self.method in ("eagle3", "extract_hidden_states", "dflash", "dspark"):
            factors = [self.method, self.draft_hf_config, self.eagle_aux_hidden_state_layer_ids]
        return hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()).hexdigest()

    # ------------------------------------------------------------------ reporting

    def to_dict(self) -> dict[str, Any]:
        """Every field (resolved and derived) plus vLLM's derived predicates (use_eagle, ...)."""
        out = dataclasses.asdict(self)
        out.update(
            use_eagle=self.use_eagle(),
            use_dflash=self.use_dflash(),
            use_dspark=self.use_dspark(),
            uses_draft_model=self.uses_draft_model(),
            uses_extract_hidden_states=self.uses_extract_hidden_states(),
            use_ngram_gpu=self.use_ngram_gpu(),
            use_gemma4_mtp=self.use_gemma4_mtp(),
            use_step3p5_mtp=self.use_step3p5_mtp(),
            uses_dynamic_speculative_decoding=self.uses_dynamic_speculative_decoding(),
            max_num_new_slots_for_drafting=self.max_num_new_slots_for_drafting,
        )
        return out

    def explain(self) -> str:
        """A human-readable account of how the method was chosen and every value."""
        values = self.to_dict()
        lines = [f"method: {values.pop('method')}  <- {values.pop('resolution')}"]
        for name in ("draft_hf_config", "target_hf_config", "checkpoint_config"):
            hf = values.pop(name) or {}
            keys = ("model_type", "architectures", "n_predict", "vocab_size")
            summary = ", ".join(f"{k}={hf[k]!r}" for k in keys if k in hf)
            lines.append(f"{name}: {summary or '(none read)'}")
        for warning in values.pop("warnings"):
            lines.append(f"warning: {warning}")
        ignored = {*NO_EFFECT_FIELDS, *values.pop("no_effect_fields")}
        lines += [
            f"{name}: {value!r}" + (" (no effect here)" if name in ignored else "") for name, value in values.items()
        ]
        return "\n".join(lines)

    def warn(self, message: str) -> None:
        """Log `message` and keep it in `warnings` (shown by explain)."""
        logger.warning(message)
        self.warnings.append(message)

    # ------------------------------------------------------------------ no-effect fields

    def _non_default_values(self) -> dict[str, Any]:
        """The user-settable fields whose value is not the default."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.init and getattr(self, f.name) != f.default
        }

    def _flag_no_effect(self, given: dict[str, Any]) -> None:
        """One warning per field set here that this server accepts but does not act on."""
        for name in NO_EFFECT_FIELDS:
            if name in given:
                self._no_effect(name, given[name], "accepted for vLLM compatibility")
        if self.rejection_sample_method == "block":
            self._no_effect("rejection_sample_method", "block", "standard rejection sampling runs, lossless like block")
        tp = given.get("draft_tensor_parallel_size")
        if tp is not None and tp > 1 and self.method in _MODEL_FREE_METHODS:
            self._no_effect("draft_tensor_parallel_size", tp, f"method {self.method!r} loads no draft model")
        quantizes = self.method in ("draft_model", "custom_class") or (
            self.method in _HEAD_METHODS and given.get("quantization") == "int8"
        )
        if "quantization" in given and not quantizes:
            self._no_effect(
                "quantization", given["quantization"], "draft_model quantizes its draft; a trained head takes 'int8'"
            )

    def _no_effect(self, name: str, value: Any, why: str) -> None:
        self.no_effect_fields.append(name)
        self.warn(f"{name}={value!r} has no effect on this server ({why})")


# ---------------------------------------------------------------------- K per request / batch


def request_num_draft_tokens(k: int, requested: int | None) -> int:
    """K for one request: its ``num_draft_tokens`` if given (0 turns speculation off)."""
    if requested is None:
        return k
    if not is_int(requested):
        raise SpeculativeConfigError(f"num_draft_tokens: input should be a valid integer, got {requested!r}")
    if not 0 <= requested <= k:
        raise SpeculativeConfigError(
            f"num_draft_tokens={requested} must be in [0, {k}] (the configured num_speculative_tokens)"
        )
    return requested


def batch_num_draft_tokens(k: int, schedule: list[tuple[int, int, int]] | None, batch_size: int) -> int:
    """K for a batch of this size under a validated dynamic schedule (``k`` without one)."""
    if not is_int(batch_size) or batch_size < 1:
        raise SpeculativeConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    chosen = k
    # Ranges are sorted and the first starts at 1; gaps and the tail keep the last K.
    for start, _end, range_k in schedule or ():
        if start > batch_size:
            break
        chosen = min(range_k, k)
    return chosen


# ---------------------------------------------------------------------- parsing helpers


def _parse_spec(spec: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(f"speculative_config is not valid JSON: {e}") from e
    if not isinstance(spec, dict):
        raise SpeculativeConfigError(f"speculative_config must be a JSON object, got {type(spec).__name__}")
    return spec


# Keys a user may give; target_* are injected by the caller, not read from the JSON.
_USER_KEYS = tuple(f.name for f in dataclasses.fields(SpeculativeConfig) if f.init and not f.name.startswith("target_"))


def _normalize_keys(data: dict[str, Any]) -> dict[str, Any]:
    """Top-level kebab-case -> snake_case; unknown or duplicated keys are errors."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise SpeculativeConfigError(f"speculative_config keys must be strings, got {key!r}")
        name = key.replace("-", "_")
        if name == "draft_model_config":
            # vLLM's way to pass draft hf_config keys (extract_hidden_states layer ids).
            if not isinstance(value, dict) or set(value) - {"hf_config"}:
                raise SpeculativeConfigError(
                    f"draft_model_config: only {{'hf_config': {{...}}}} is accepted, got {value!r}"
                )
            name, value = "hf_overrides", value.get("hf_config")
        elif name not in _USER_KEYS:
            raise SpeculativeConfigError(
                f"Unknown key '{key}' in speculative_config: Extra inputs are not permitted. "
                f"Valid keys: {', '.join(sorted(_USER_KEYS))}, draft_model_config"
            )
        if name in out:
            raise SpeculativeConfigError(f"{name}: given more than once in speculative_config")
        out[name] = value
    return out
