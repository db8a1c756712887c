"""Step 2's draft branch of resolving a speculative config (draft_model, eagle / eagle3, mtp,
medusa, mlp_speculator, dflash, dspark), vLLM's ``__post_init__`` for a draft network: the
draft's config.json read and rewritten as vLLM rewrites it, the method detected from it, k
checked against what the checkpoint predicts, and the draft's parallelism and length."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from backends.config.detect import (
    DSPARK_ARCHS,
    MULTI_STEP_MTP_TYPES,
    as_eagle_config,
    aux_layer_ids,
    detect_method,
    hf_config_override,
    hf_lookup,
    speculators_draft_config,
)
from backends.config.errors import SpeculativeConfigError
from backends.config.fields import is_int
from backends.config.model_config import max_position_embeddings, read_model_config

if TYPE_CHECKING:
    from backends.config.speculative import SpeculativeConfig


def resolve_draft(cfg: SpeculativeConfig, how: str) -> str:
    """Resolve `cfg`'s draft network in place; `how` the method was chosen, with what the
    draft's config added."""
    cfg.prompt_lookup_min = cfg.prompt_lookup_max = 0
    if cfg.model is None:
        return how
    hf, rewritten = _draft_hf_config(cfg)
    archs = list(hf.get("architectures") or [])
    model_type = hf.get("model_type")
    cfg.method, how = detect_method(cfg.method, cfg.model.lower(), archs, model_type, how)
    how += rewritten
    k = cfg.num_speculative_tokens
    if cfg.method == "mtp" and k is not None and k > 1 and model_type not in MULTI_STEP_MTP_TYPES:
        cfg.warn(
            "Enabling num_speculative_tokens > 1 will run multiple times of forward "
            "on same MTP layer, which may result in lower acceptance rate"
        )
    hf = _as_method_config(cfg, hf, archs, k)
    k = _checked_k(cfg, hf, k)
    cfg.draft_tensor_parallel_size = draft_tensor_parallel_size(cfg, hf.get("model_type"))
    cfg.draft_max_model_len = draft_max_model_len(
        cfg.max_model_len, max_position_embeddings(hf), cfg.target_max_model_len
    )
    if cfg.method in ("eagle3", "dflash", "dspark"):
        cfg.eagle_aux_hidden_state_layer_ids = aux_layer_ids(hf, cfg.target_hf_config)
    cfg.draft_hf_config = hf
    return how


def user_overrides(cfg: SpeculativeConfig) -> dict[str, Any]:
    """hf_overrides plus a top-level eagle_aux_hidden_state_layer_ids (which wins)."""
    overrides = dict(cfg.hf_overrides or {})
    if cfg.eagle_aux_hidden_state_layer_ids is not None:
        overrides["eagle_aux_hidden_state_layer_ids"] = cfg.eagle_aux_hidden_state_layer_ids
    return overrides


def _draft_hf_config(cfg: SpeculativeConfig) -> tuple[dict[str, Any], str]:
    """The draft's config.json (speculators format flattened, the user's overrides on top) as
    vLLM rewrites it (medusa's vocabulary, hf_config_override's MTP forms), and a note when
    the rewrite changed its model_type."""
    raw = read_model_config(cfg.model, "model")
    if "speculators_model_type" in raw:
        raw = speculators_draft_config(raw, cfg.model)
    if os.path.isdir(cfg.model):
        cfg.checkpoint_config = raw
    raw = {**raw, **user_overrides(cfg)}
    if cfg.method == "medusa":
        hf = {**raw, "model_type": "medusa"}  # old FasterDecoding checkpoints lack it
        target_vocab = hf_lookup(cfg.target_hf_config, "vocab_size")
        if target_vocab is not None and hf.get("vocab_size") != target_vocab:
            hf.update(vocab_size=target_vocab, truncated_vocab_size=target_vocab)
        return hf, ""
    hf = hf_config_override(raw)
    if hf.get("model_type") == raw.get("model_type"):
        return hf, ""
    return hf, f" (config model_type {raw.get('model_type')!r} rewritten by hf_config_override)"


def _as_method_config(cfg: SpeculativeConfig, hf: dict[str, Any], archs: list[str], k: int | None) -> dict[str, Any]:
    """The draft config in the form the detected method reads (vLLM's per-method rewrites)."""
    if cfg.method in ("eagle", "eagle3", "dflash"):
        hf = as_eagle_config(hf, cfg.method)
    if cfg.method == "dspark":
        if not set(archs) & set(DSPARK_ARCHS):  # the DeepSeek-V4 bundled drafter
            hf.update(model_type="deepseek_v4", architectures=["DSparkDraftModel"])
        elif "Gemma4DSparkModel" in archs:
            hf.setdefault("dspark_target_layer_ids", hf.get("target_layer_ids"))
            hf.setdefault("n_predict", hf.get("block_size"))
    if cfg.method in ("dflash", "dspark"):
        cfg.parallel_drafting = True
    if k is not None and hf.get("model_type") == "medusa":
        hf["num_heads"] = k  # vLLM's num_lookahead_tokens setter: K heads
    if hf.get("model_type") == "mlp_speculator":
        # MLPSpeculatorConfig: n_predict (default 3) stays the checkpoint's; K sets the
        # number of stages built (its num_lookahead_tokens), so K > n_predict must divide.
        hf.setdefault("n_predict", 3)
        hf["num_lookahead_tokens"] = k or hf["n_predict"]
    return hf


def _checked_k(cfg: SpeculativeConfig, hf: dict[str, Any], k: int | None) -> int:
    """k as the checkpoint allows it (n_predict's when not given: then set on `cfg` too)."""
    n_predict = hf.get("n_predict")
    if n_predict is not None:
        if not is_int(n_predict) or n_predict < 1:
            raise SpeculativeConfigError(
                f"n_predict={n_predict!r} in the draft config of model={cfg.model!r}: "
                "the checkpoint has no prediction layers"
            )
        if k is None:
            k = cfg.num_speculative_tokens = n_predict
        elif k > n_predict and k % n_predict != 0:
            raise SpeculativeConfigError(f"num_speculative_tokens:{k} must be divisible by n_predict={n_predict}")
    if k is None:
        raise SpeculativeConfigError("A speculative model was provided, but `num_speculative_tokens` was not provided")
    if hf.get("model_type") == "inkling_mtp" and k != 1:
        raise SpeculativeConfigError(
            f"Inkling MTP currently supports exactly one speculative token (num_speculative_tokens={k})"
        )
    block = hf.get("dspark_block_size")
    if cfg.method == "dspark" and block is not None and k < block:
        raise SpeculativeConfigError(f"DSpark requires num_speculative_tokens >= dspark_block_size ({block}); got {k}.")
    return k


def draft_tensor_parallel_size(cfg: SpeculativeConfig, draft_model_type: str | None) -> int:
    target_tp = cfg.target_tensor_parallel_size
    if cfg.draft_tensor_parallel_size is None:
        if draft_model_type == "mlp_speculator":
            if target_tp > 1:
                cfg.warn(
                    "mlp_speculator cannot use tensor parallelism; the draft runs with draft_tensor_parallel_size=1"
                )
            return 1
        return target_tp
    if cfg.draft_tensor_parallel_size not in (1, target_tp):
        raise SpeculativeConfigError(
            f"draft_tensor_parallel_size={cfg.draft_tensor_parallel_size} cannot be other "
            f"value than 1 or target model tensor_parallel_size={target_tp}"
        )
    return cfg.draft_tensor_parallel_size


def draft_max_model_len(spec: int | None, draft: int | None, target: int | None) -> int | None:
    """vLLM's _maybe_override_draft_max_model_len: an explicit draft length must fit both
    models; otherwise the smaller one."""
    if spec is not None:
        for name, limit in (("draft", draft), ("target", target)):
            if limit is not None and spec > limit:
                raise SpeculativeConfigError(f"max_model_len: spec={spec} cannot be larger than {name}={limit}")
        return spec
    known = [n for n in (draft, target) if n is not None]
    return min(known) if known else None
