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

import ast
import dataclasses
import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

from backends.config.detect import (
    DSPARK_ARCHS,
    MTP_MODEL_TYPES,
    MULTI_STEP_MTP_TYPES,
    as_eagle_config,
    aux_layer_ids,
    detect_method,
    hf_config_override,
    hf_lookup,
    is_custom_proposer_path,
    speculators_draft_config,
    speculators_spec,
)
from backends.config.errors import SpeculativeConfigError
from backends.runtime.model_store import unnamable

logger = logging.getLogger(__name__)

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
_BATCH_SCHEDULE = "num_speculative_tokens_per_batch_size"
# Which methods draft which kind of tree, and how many nodes one tree may have (the verifier's
# per-step limit, vLLM's MAX_SPEC_LEN).
TREE_METHODS = {
    "speculative_token_tree": ("medusa", "eagle", "eagle3", "mtp", "draft_model"),
    "dynamic_tree": ("eagle", "eagle3", "mtp"),
    "suffix_decoding_use_tree_spec": ("suffix",),
}
MAX_TREE_NODES = 128
DYNAMIC_TREE_KEYS = ("top_k", "total_token")  # EAGLE-2's names; its depth is num_speculative_tokens


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
        if _read_model_config(target_model, "target_model").get("speculators_config") is not None:
            cfg = cls.from_target_speculators(target_model, target_max_model_len, target_tensor_parallel_size)
            if data:
                cfg._warn(
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
        raw = _read_model_config(target_dir, "target_model")
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
        # vLLM's order: field checks, then __post_init__ resolution, then _verify_args.
        self._validate_fields()
        given = self._non_default_values()  # before resolution sets some of them itself
        self.target_hf_config = _read_model_config(self.target_model, "target_model")
        if self.target_max_model_len is None:
            self.target_max_model_len = _max_position_embeddings(self.target_hf_config)
        self._resolve_method()
        self._verify_args()
        self._flag_no_effect(given)

    # ------------------------------------------------------------------ step 1: fields

    def _validate_fields(self) -> None:
        v = vars(self)
        for name in (
            "model",
            "quantization",
            "moe_backend",
            "attention_backend",
            "kv_cache_dtype",
            "revision",
            "code_revision",
            "target_model",
        ):
            _check(name, v[name], v[name] is None or isinstance(v[name], str), "a valid string")
        for name in (
            "disable_padded_drafter_batch",
            "use_local_argmax_reduction",
            "use_heterogeneous_vocab",
            "parallel_drafting",
            "suffix_decoding_use_tree_spec",
        ):
            _check(name, v[name], isinstance(v[name], bool), "a valid boolean")
        eager = self.enforce_eager
        _check("enforce_eager", eager, eager is None or isinstance(eager, bool), "a valid boolean")
        k = self.num_speculative_tokens
        _check("num_speculative_tokens", k, k is None or _is_int(k), "a valid integer")
        _check("num_speculative_tokens", k, k is None or k > 0, "greater than 0")
        for name in (
            "draft_tensor_parallel_size",
            "max_model_len",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "target_max_model_len",
            "suffix_decoding_max_tree_nodes",
        ):
            _check(name, v[name], v[name] is None or _is_int(v[name]), "a valid integer")
            _check(name, v[name], v[name] is None or v[name] >= 1, "greater than or equal to 1")
        _check(
            "target_tensor_parallel_size",
            self.target_tensor_parallel_size,
            _is_int(self.target_tensor_parallel_size) and self.target_tensor_parallel_size >= 1,
            "an integer >= 1",
        )
        _check(
            "tensor_parallel_size",
            self.tensor_parallel_size,
            self.tensor_parallel_size is None or _is_int(self.tensor_parallel_size),
            "a valid integer",
        )
        for name in ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
            _check(name, v[name], _is_int(v[name]), "a valid integer")
        for name in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
            _check(name, v[name], _is_number(v[name]), "a valid number")
        _check_choice("method", self.method, METHODS, optional=True)
        _check_choice("rejection_sample_method", self.rejection_sample_method, REJECTION_SAMPLE_METHODS)
        _check_choice("draft_sample_method", self.draft_sample_method, DRAFT_SAMPLE_METHODS)
        rates = self.synthetic_acceptance_rates
        _check(
            "synthetic_acceptance_rates",
            rates,
            rates is None or (isinstance(rates, list) and all(map(_is_number, rates))),
            "a list of numbers",
        )
        length = self.synthetic_acceptance_length
        _check("synthetic_acceptance_length", length, length is None or _is_number(length), "a valid number")
        for name in ("draft_load_config", "hf_overrides"):
            _check(name, v[name], v[name] is None or isinstance(v[name], dict), "a valid dictionary")
        ids = self.eagle_aux_hidden_state_layer_ids
        _check(
            "eagle_aux_hidden_state_layer_ids",
            ids,
            ids is None or (isinstance(ids, list) and all(_is_int(i) and i >= 0 for i in ids)),
            "a list of non-negative integers",
        )
        if self.num_speculative_tokens_per_batch_size is not None:
            self.num_speculative_tokens_per_batch_size = _validate_batch_schedule(
                self.num_speculative_tokens_per_batch_size
            )
        # Parsed case-insensitively like vLLM's enum; "auto" means "let the engine choose".
        if self.attention_backend is not None:
            backend = self.attention_backend.upper()
            self.attention_backend = None if backend == "AUTO" else backend

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
            self._warn(f"method `{self.method}` is deprecated and replaced with mtp.")
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
            how = self._resolve_draft(how)
        self.resolution = how

    def _default_model(self) -> None:
        if self.method in ("mtp", "dspark"):
            # The draft layers live in the target checkpoint.
            if self.target_model is None:
                raise SpeculativeConfigError(f"target_model_config must be present for {self.method}")
            if self.method == "mtp" and _text_model_type(self.target_hf_config) == "deepseek_v32":
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
            self._warn(
                "num_speculative_tokens defaults to suffix_decoding_max_tree_depth="
                f"{self.suffix_decoding_max_tree_depth} for suffix decoding"
            )

    def _resolve_custom_class(self) -> None:
        self._warn("method='custom_class' is experimental")
        if self.model is not None and "." not in self.model:
            raise SpeculativeConfigError(
                f"Invalid custom proposer module path model={self.model!r}: expected 'module.ClassName'"
            )
        self.prompt_lookup_min = self.prompt_lookup_max = 0
        self.draft_hf_config = self.target_hf_config

    def _resolve_extract_hidden_states(self) -> None:
        hf = {**self.target_hf_config, **self._user_overrides(), "architectures": ["ExtractHiddenStatesModel"]}
        ids = hf.get("eagle_aux_hidden_state_layer_ids")
        if self.num_speculative_tokens not in (None, 1):
            raise SpeculativeConfigError(
                f"num_speculative_tokens must be 1 for extract_hidden_states, got {self.num_speculative_tokens}"
            )
        # Missing ids are accepted here, as in vLLM: building the extractor refuses them.
        self.eagle_aux_hidden_state_layer_ids = list(ids) if ids else None
        self.draft_hf_config = hf

    def _resolve_draft(self, how: str) -> str:
        """The draft_model/eagle*/mtp/medusa/mlp_speculator/dflash/dspark branch."""
        self.prompt_lookup_min = self.prompt_lookup_max = 0
        if self.model is None:
            return how
        raw = _read_model_config(self.model, "model")
        if "speculators_model_type" in raw:
            raw = speculators_draft_config(raw, self.model)
        if os.path.isdir(self.model):
            self.checkpoint_config = raw
        raw = {**raw, **self._user_overrides()}
        if self.method == "medusa":
            hf = {**raw, "model_type": "medusa"}  # old FasterDecoding checkpoints lack it
            target_vocab = hf_lookup(self.target_hf_config, "vocab_size")
            if target_vocab is not None and hf.get("vocab_size") != target_vocab:
                hf.update(vocab_size=target_vocab, truncated_vocab_size=target_vocab)
            rewritten = ""
        else:
            hf = hf_config_override(raw)
            rewritten = (
                ""
                if hf.get("model_type") == raw.get("model_type")
                else (f" (config model_type {raw.get('model_type')!r} rewritten by hf_config_override)")
            )

        archs = list(hf.get("architectures") or [])
        model_type = hf.get("model_type")
        self.method, how = detect_method(self.method, self.model.lower(), archs, model_type, how)
        how += rewritten
        k = self.num_speculative_tokens
        if self.method == "mtp" and k is not None and k > 1 and model_type not in MULTI_STEP_MTP_TYPES:
            self._warn(
                "Enabling num_speculative_tokens > 1 will run multiple times of forward "
                "on same MTP layer, which may result in lower acceptance rate"
            )

        if self.method in ("eagle", "eagle3", "dflash"):
            hf = as_eagle_config(hf, self.method)
        if self.method == "dspark":
            if not set(archs) & set(DSPARK_ARCHS):  # the DeepSeek-V4 bundled drafter
                hf.update(model_type="deepseek_v4", architectures=["DSparkDraftModel"])
            elif "Gemma4DSparkModel" in archs:
                hf.setdefault("dspark_target_layer_ids", hf.get("target_layer_ids"))
                hf.setdefault("n_predict", hf.get("block_size"))
        if self.method in ("dflash", "dspark"):
            self.parallel_drafting = True
        if k is not None and hf.get("model_type") == "medusa":
            hf["num_heads"] = k  # vLLM's num_lookahead_tokens setter: K heads
        if hf.get("model_type") == "mlp_speculator":
            # MLPSpeculatorConfig: n_predict (default 3) stays the checkpoint's; K sets the
            # number of stages built (its num_lookahead_tokens), so K > n_predict must divide.
            hf.setdefault("n_predict", 3)
            hf["num_lookahead_tokens"] = k or hf["n_predict"]

        n_predict = hf.get("n_predict")
        if n_predict is not None:
            if not _is_int(n_predict) or n_predict < 1:
                raise SpeculativeConfigError(
                    f"n_predict={n_predict!r} in the draft config of model={self.model!r}: "
                    "the checkpoint has no prediction layers"
                )
            if k is None:
                k = self.num_speculative_tokens = n_predict
            elif k > n_predict and k % n_predict != 0:
                raise SpeculativeConfigError(f"num_speculative_tokens:{k} must be divisible by n_predict={n_predict}")
        if k is None:
            raise SpeculativeConfigError(
                "A speculative model was provided, but `num_speculative_tokens` was not provided"
            )
        if hf.get("model_type") == "inkling_mtp" and k != 1:
            raise SpeculativeConfigError(
                f"Inkling MTP currently supports exactly one speculative token (num_speculative_tokens={k})"
            )
        block = hf.get("dspark_block_size")
        if self.method == "dspark" and block is not None and k < block:
            raise SpeculativeConfigError(
                f"DSpark requires num_speculative_tokens >= dspark_block_size ({block}); got {k}."
            )

        self.draft_tensor_parallel_size = self._draft_tensor_parallel_size(hf.get("model_type"))
        self.draft_max_model_len = _draft_max_model_len(
            self.max_model_len, _max_position_embeddings(hf), self.target_max_model_len
        )
        if self.method in ("eagle3", "dflash", "dspark"):
            self.eagle_aux_hidden_state_layer_ids = aux_layer_ids(hf, self.target_hf_config)
        self.draft_hf_config = hf
        return how

    def _user_overrides(self) -> dict[str, Any]:
        """hf_overrides plus a top-level eagle_aux_hidden_state_layer_ids (which wins)."""
        overrides = dict(self.hf_overrides or {})
        if self.eagle_aux_hidden_state_layer_ids is not None:
            overrides["eagle_aux_hidden_state_layer_ids"] = self.eagle_aux_hidden_state_layer_ids
        return overrides

    def _draft_tensor_parallel_size(self, draft_model_type: str | None) -> int:
        target_tp = self.target_tensor_parallel_size
        if self.draft_tensor_parallel_size is None:
            if draft_model_type == "mlp_speculator":
                if target_tp > 1:
                    self._warn(
                        "mlp_speculator cannot use tensor parallelism; the draft runs with draft_tensor_parallel_size=1"
                    )
                return 1
            return target_tp
        if self.draft_tensor_parallel_size not in (1, target_tp):
            raise SpeculativeConfigError(
                f"draft_tensor_parallel_size={self.draft_tensor_parallel_size} cannot be other "
                f"value than 1 or target model tensor_parallel_size={target_tp}"
            )
        return self.draft_tensor_parallel_size

    # ------------------------------------------------------------------ step 3: vLLM's _verify_args

    def _verify_args(self) -> None:
        if self.tensor_parallel_size is not None:
            raise SpeculativeConfigError(
                "'tensor_parallel_size' is not a valid argument in the speculative_config. "
                "Please pass 'draft_tensor_parallel_size' instead."
            )
        if self.num_speculative_tokens is None:
            raise SpeculativeConfigError(
                "num_speculative_tokens must be provided with speculative model unless the "
                "draft model config contains an n_predict parameter."
            )
        self._resolve_synthetic_rates()
        self._validate_trees()
        if self.disable_padded_drafter_batch and (
            self.parallel_drafting or self.method in ("draft_model", "extract_hidden_states")
        ):
            what = "parallel_drafting" if self.parallel_drafting else f"method='{self.method}'"
            raise SpeculativeConfigError(f"disable_padded_drafter_batch is not supported with {what}")
        if self.use_heterogeneous_vocab:
            if self.method != "draft_model":
                raise SpeculativeConfigError(
                    f"use_heterogeneous_vocab only works with method='draft_model', got method='{self.method}'"
                )
            if self.draft_sample_method != "greedy":
                raise SpeculativeConfigError(
                    "use_heterogeneous_vocab currently only supports greedy draft sampling "
                    f"(draft_sample_method='greedy'), got '{self.draft_sample_method}'"
                )
        elif self.method == "draft_model":
            target = hf_lookup(self.target_hf_config, "vocab_size")
            draft = hf_lookup(self.draft_hf_config or {}, "vocab_size")
            if target is not None and draft is not None and target != draft:
                raise SpeculativeConfigError(
                    "Target and draft model should have the same vocabulary size. Target model "
                    f"vocab_size={target}. Draft model vocab_size={draft}. Set "
                    "use_heterogeneous_vocab=true for a draft with another vocabulary."
                )
        if self.method == "draft_model" and self.draft_tensor_parallel_size != self.target_tensor_parallel_size:
            raise SpeculativeConfigError(
                "Currently, 'draft_tensor_parallel_size' and 'tensor_parallel_size' must be the "
                f"same for draft_model (draft_tensor_parallel_size="
                f"{self.draft_tensor_parallel_size}, target {self.target_tensor_parallel_size})"
            )

    def _validate_trees(self) -> None:
        """At most one tree option, on a method that drafts that kind of tree, within k levels
        and MAX_TREE_NODES nodes; synthetic acceptance (per chain position) takes no tree."""
        given = [
            name
            for name in ("speculative_token_tree", "dynamic_tree", "suffix_decoding_use_tree_spec")
            if getattr(self, name) not in (None, False)
        ]
        if self.suffix_decoding_max_tree_nodes is not None and not self.suffix_decoding_use_tree_spec:
            raise SpeculativeConfigError(
                "suffix_decoding_max_tree_nodes sizes the trees of suffix_decoding_use_tree_spec: set that too"
            )
        if not given:
            return
        if len(given) > 1:
            raise SpeculativeConfigError(f"{' and '.join(given)} are alternatives: give one")
        name = given[0]
        if self.method not in TREE_METHODS[name]:
            raise SpeculativeConfigError(
                f"{name} applies to method {' / '.join(TREE_METHODS[name])}, not method='{self.method}'"
            )
        if self.rejection_sample_method == "synthetic":
            raise SpeculativeConfigError(f"{name} cannot be combined with rejection_sample_method='synthetic'")
        k = self.num_speculative_tokens
        if name == "speculative_token_tree":
            self.speculative_token_tree = parse_token_tree(self.speculative_token_tree)
            off_chain = [p for p in self.speculative_token_tree if any(p[:-1])]
            if self.method == "draft_model" and off_chain:
                raise SpeculativeConfigError(
                    f"speculative_token_tree path {off_chain[0]}: draft_model's tree branches off its chain "
                    "only (every rank but a path's last is 0)"
                )
            depth = max(map(len, self.speculative_token_tree))
            if depth > k:
                raise SpeculativeConfigError(
                    f"speculative_token_tree is {depth} levels deep, more than num_speculative_tokens={k}"
                )
            nodes = len(self.speculative_token_tree)
        elif name == "dynamic_tree":
            self.dynamic_tree = _validate_dynamic_tree(self.dynamic_tree)
            nodes = self.dynamic_tree["total_token"]
        else:
            # Suffix trees are num_speculative_tokens deep; twice as many nodes leave room for
            # the alternatives a chain of that length cannot hold.
            if self.suffix_decoding_max_tree_nodes is None:
                self.suffix_decoding_max_tree_nodes = min(2 * k, MAX_TREE_NODES)
            name, nodes = "suffix_decoding_max_tree_nodes", self.suffix_decoding_max_tree_nodes
        if nodes > MAX_TREE_NODES:
            raise SpeculativeConfigError(f"{name}: {nodes} tree nodes, at most {MAX_TREE_NODES} per step")

    def _resolve_synthetic_rates(self) -> None:
        rates, length = self.synthetic_acceptance_rates, self.synthetic_acceptance_length
        k = self.num_speculative_tokens
        if self.rejection_sample_method != "synthetic":
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
        self.synthetic_acceptance_rates = [float(r) for r in rates]
        self.synthetic_acceptance_length = None

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

    def _warn(self, message: str) -> None:
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
        self._warn(f"{name}={value!r} has no effect on this server ({why})")


# ---------------------------------------------------------------------- K per request / batch


def request_num_draft_tokens(k: int, requested: int | None) -> int:
    """K for one request: its ``num_draft_tokens`` if given (0 turns speculation off)."""
    if requested is None:
        return k
    if not _is_int(requested):
        raise SpeculativeConfigError(f"num_draft_tokens: input should be a valid integer, got {requested!r}")
    if not 0 <= requested <= k:
        raise SpeculativeConfigError(
            f"num_draft_tokens={requested} must be in [0, {k}] (the configured num_speculative_tokens)"
        )
    return requested


def batch_num_draft_tokens(k: int, schedule: list[tuple[int, int, int]] | None, batch_size: int) -> int:
    """K for a batch of this size under a validated dynamic schedule (``k`` without one)."""
    if not _is_int(batch_size) or batch_size < 1:
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


def _validate_batch_schedule(schedule: Any) -> list[tuple[int, int, int]]:
    """vLLM's checks of num_speculative_tokens_per_batch_size: non-empty, 3-item (start, end,
    K) entries, disjoint, the first starting at 1."""
    name = _BATCH_SCHEDULE
    if not isinstance(schedule, list):
        raise SpeculativeConfigError(f"{name}: input should be a list, got {schedule!r}")
    if not schedule:
        raise SpeculativeConfigError(f"{name} must not be empty")
    entries = []
    for entry in schedule:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3 or not all(_is_int(x) for x in entry):
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


def _read_model_config(path: str | None, field_name: str) -> dict[str, Any]:
    """A local directory's config.json; {} for None or a bare name (nothing to read)."""
    if path is not None and (why := unnamable(path)):
        raise SpeculativeConfigError(f"{field_name}: {why}")
    if path is None or not os.path.isdir(path):
        return {}
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SpeculativeConfigError(f"{field_name}: cannot read {config_path}: {e}") from e
    if not isinstance(config, dict):
        raise SpeculativeConfigError(f"{field_name}: {config_path} is not a JSON object")
    return config


def _text_model_type(cfg: dict[str, Any]) -> str | None:
    text = cfg.get("text_config")
    return text.get("model_type") if isinstance(text, dict) else cfg.get("model_type")


def _max_position_embeddings(cfg: dict[str, Any]) -> int | None:
    return hf_lookup(cfg, "max_position_embeddings")


def _draft_max_model_len(spec: int | None, draft: int | None, target: int | None) -> int | None:
    """vLLM's _maybe_override_draft_max_model_len: an explicit draft length must fit both
    models; otherwise the smaller one."""
    if spec is not None:
        for name, limit in (("draft", draft), ("target", target)):
            if limit is not None and spec > limit:
                raise SpeculativeConfigError(f"max_model_len: spec={spec} cannot be larger than {name}={limit}")
        return spec
    known = [n for n in (draft, target) if n is not None]
    return min(known) if known else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
        if not isinstance(path, (list, tuple)) or not path or not all(_is_int(r) and r >= 0 for r in path):
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


def _validate_dynamic_tree(spec: Any) -> dict[str, int]:
    """``dynamic_tree``: {"top_k": children tried per expanded node, "total_token": nodes kept}."""
    _check("dynamic_tree", spec, isinstance(spec, dict), "a dictionary with keys " + ", ".join(DYNAMIC_TREE_KEYS))
    unknown = sorted(set(spec) - set(DYNAMIC_TREE_KEYS))
    if unknown:
        hint = " (its depth is num_speculative_tokens)" if "depth" in unknown else ""
        raise SpeculativeConfigError(
            f"dynamic_tree: unknown key {unknown[0]!r}{hint}; the keys are {', '.join(DYNAMIC_TREE_KEYS)}"
        )
    tree = {"top_k": 4, "total_token": 16, **spec}
    for key in DYNAMIC_TREE_KEYS:
        _check(f"dynamic_tree.{key}", tree[key], _is_int(tree[key]) and tree[key] >= 1, "an integer >= 1")
    return tree


def _check(name: str, value: Any, ok: bool, expected: str) -> None:
    if not ok:
        raise SpeculativeConfigError(f"{name}: input should be {expected}, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...], optional: bool = False) -> None:
    ok = (optional and value is None) or (isinstance(value, str) and value in choices)
    _check(name, value, ok, "one of " + ", ".join(repr(c) for c in choices))
