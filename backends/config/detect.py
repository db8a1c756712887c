"""What a draft checkpoint's config says, as vLLM at commit c314af1 reads it: the method
auto-detection and the target-to-MTP rewrite of ``SpeculativeConfig.__post_init__`` and
``hf_config_override`` (https://github.com/vllm-project/vllm/blob/c314af1abfddff7b6cce9af578be72c496c6a5e4/vllm/config/speculative.py),
the speculators format (https://github.com/vllm-project/vllm/blob/c314af1abfddff7b6cce9af578be72c496c6a5e4/vllm/transformers_utils/configs/speculators/algos.py)
and the EAGLE-3 aux hidden-state layer ids
(https://github.com/vllm-project/vllm/blob/c314af1abfddff7b6cce9af578be72c496c6a5e4/vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py).

Pure functions over config dicts; :mod:`backends.config.speculative` reads the files and
calls them in vLLM's order.
"""

from __future__ import annotations

import keyword
from typing import Any

from backends.config.errors import SpeculativeConfigError, UnsupportedSpeculativeMethodError

# MTPModelTypes at c314af1 except the plain "mtp": legacy method names and the
# model_types that make auto-detection pick mtp.
MTP_MODEL_TYPES = (
    "deepseek_mtp",
    "mimo_mtp",
    "mimo_v2_mtp",
    "glm4_moe_mtp",
    "glm4_moe_lite_mtp",
    "glm_ocr_mtp",
    "ernie_mtp",
    "nemotron_h_mtp",
    "exaone_moe_mtp",
    "exaone4_5_mtp",
    "qwen3_next_mtp",
    "qwen3_5_mtp",
    "longcat_flash_mtp",
    "minimax_m3_mtp",
    "bailing_hybrid_mtp",
    "pangu_ultra_moe_mtp",
    "step3p5_mtp",
    "hy_v3_mtp",
    "gemma4_mtp",
    "inkling_mtp",
)
DSPARK_ARCHS = ("Qwen3DSparkModel", "Gemma4DSparkModel")
# MTP types for which K > 1 does not mean "run the same MTP layer K times" (auto-detection step 8).
MULTI_STEP_MTP_TYPES = ("step3p5_mtp", "inkling_mtp")
# Methods whose explicit value auto-detection never overrides (its step 1).
_STICKY_METHODS = ("eagle", "eagle3", "dflash", "dspark")
# vLLM's MiMo-V2 MTP constant: only the first MTP layer is supported.
_MIMO_V2_N_PREDICT = 1
# speculators_model_type -> method; peagle is EAGLE-3 with parallel drafting.
_SPECULATORS_METHODS = {
    "eagle": "eagle",
    "eagle3": "eagle3",
    "peagle": "eagle3",
    "dflash": "dflash",
    "dspark": "dspark",
}


# ---------------------------------------------------------------------- auto-detection (__post_init__)


def detect_method(method: str, name: str, archs: list[str], model_type: str | None, how: str) -> tuple[str, str]:
    """vLLM's auto-detection, steps 1-10: (method, reason). ``name`` is the lower-cased model path."""
    if method in _STICKY_METHODS:
        return method, how
    for needle, detected in (("eagle-", "eagle"), ("eagle3", "eagle3"), ("dflash", "dflash"), ("dspark", "dspark")):
        if needle in name:
            return detected, f"name contains '{needle}'"
    for arch in archs:
        if arch in DSPARK_ARCHS:
            return "dspark", f"draft architecture '{arch}'"
    if model_type in ("medusa", "mlp_speculator"):
        return model_type, f"draft model_type '{model_type}'"
    if model_type == "mtp" or model_type in MTP_MODEL_TYPES:
        return "mtp", f"draft model_type '{model_type}'"
    if method == "draft_model":
        return method, how
    raise UnsupportedSpeculativeMethodError(f"Unsupported speculative method: '{method}'")


def is_custom_proposer_path(model: str | None) -> bool:
    """A dotted import path like ``my_module.MyProposer`` (no URL, no '/')."""
    if model is None or model.startswith(("http://", "https://", "file://")) or "/" in model:
        return False
    parts = model.split(".")
    return len(parts) >= 2 and all(p.isidentifier() and not keyword.iskeyword(p) for p in parts)


def as_eagle_config(hf: dict[str, Any], method: str) -> dict[str, Any]:
    """Wrap a plain LM config as vLLM's EAGLEConfig: model_type 'eagle', prefixed archs."""
    if hf.get("model_type") == "eagle" or "speculators_model_type" in hf:
        return hf
    prefix = {"eagle": "Eagle", "eagle3": "Eagle3", "dflash": "DFlash"}[method]

    def rename(arch: str) -> str:
        keep = arch.startswith(prefix) or (method != "eagle" and arch.endswith(prefix))
        return arch if keep else prefix + arch

    return {**hf, "model_type": "eagle", "architectures": [rename(a) for a in hf.get("architectures") or []]}


def aux_layer_ids(hf: dict[str, Any], target_hf: dict[str, Any]) -> list[int] | None:
    """The target layers whose hidden states feed the drafter (first source wins)."""
    eagle_config = hf.get("eagle_config") or {}
    if eagle_config.get("use_aux_hidden_state") is False:
        return None  # single-hidden EAGLE-3 variant
    if hf.get("eagle_aux_hidden_state_layer_ids"):
        return list(hf["eagle_aux_hidden_state_layer_ids"])
    dflash_config = hf.get("dflash_config") or {}
    # 0-based layer indices name the layer; aux id k is the stream *after* k layers.
    for ids in (dflash_config.get("target_layer_ids"), hf.get("dspark_target_layer_ids"), hf.get("target_layer_ids")):
        if ids:
            return [i + 1 for i in ids]
    for ids in (dflash_config.get("layer_ids"), eagle_config.get("layer_ids")):
        if ids:
            return list(ids)
    layers = hf_lookup(target_hf, "num_hidden_layers")
    return [2, layers // 2, layers - 3] if layers else None


# ---------------------------------------------------------------------- hf_config_override


def hf_config_override(config: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a target-family checkpoint config into its MTP-draft form (vLLM's hf_config_override).

    Configs that match no row are returned unchanged (as a copy). The rows are vLLM's, in its order.
    """
    cfg = dict(config)
    return _deepseek_to_ernie_override(cfg) or _nemotron_to_mistral_override(cfg) or cfg


def _mtp(
    cfg: dict[str, Any],
    new_type: str,
    n_predict: Any,
    arch: str | None = None,
    base: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """`base` (default `cfg`) as an MTP draft of `new_type` predicting `n_predict` tokens."""
    out = {**(cfg if base is None else base), "model_type": new_type, "n_predict": n_predict, **extra}
    if arch is not None:
        out["architectures"] = [arch]
    return out


def _deepseek_to_ernie_override(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The rows from DeepSeek to ERNIE; None when none matches."""
    model_type = cfg.get("model_type") or ""
    archs = set(cfg.get("architectures") or [])
    nextn = hf_lookup(cfg, "num_nextn_predict_layers")
    if model_type in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
        return _mtp(cfg, "deepseek_mtp", nextn, "DeepSeekMTPModel")
    if model_type == "deepseek_v4":
        return _mtp(cfg, "deepseek_mtp", nextn, "DeepSeekV4MTPModel")
    if model_type == "pangu_ultra_moe":
        return _mtp(cfg, "pangu_ultra_moe_mtp", nextn)
    if "MiMoForCausalLM" in archs:
        return _mtp(cfg, "mimo_mtp", nextn, num_hidden_layers=0)
    if archs & {"MiMoV2ForCausalLM", "MiMoV2OmniForCausalLM", "MiMoV2FlashForCausalLM"}:
        return _mtp(cfg, "mimo_v2_mtp", _MIMO_V2_N_PREDICT)
    for arch, new_type in (
        ("Glm4MoeForCausalLM", "glm4_moe_mtp"),
        ("Glm4MoeLiteForCausalLM", "glm4_moe_lite_mtp"),
        ("GlmOcrForConditionalGeneration", "glm_ocr_mtp"),
    ):
        if arch in archs:
            return _mtp(cfg, new_type, nextn)
    if model_type == "ernie4_5_moe":
        return _mtp(cfg, "ernie_mtp", nextn)
    return None


def _nemotron_to_mistral_override(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The rows from Nemotron-H to Mistral Large 3; None when none matches."""
    model_type = cfg.get("model_type") or ""
    archs = set(cfg.get("architectures") or [])
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    nextn = hf_lookup(cfg, "num_nextn_predict_layers")
    nemotron = ("nemotron_h", "nemotron_h_puzzle")
    step = ("step3p5", "step3p7")
    if model_type in nemotron or text.get("model_type") in nemotron:
        base = cfg if model_type in nemotron else text  # a VL wrapper: promote its text_config
        layers = base.get("num_nextn_predict_layers") or 0
        if layers > 0:
            return _mtp(cfg, "nemotron_h_mtp", layers, base=base)
    if model_type == "qwen3_next":
        return _mtp(cfg, "qwen3_next_mtp", nextn)
    if model_type == "bailing_hybrid" or "BailingMoeV2_5ForCausalLM" in archs:
        return _mtp(cfg, "bailing_hybrid_mtp", nextn)
    if model_type == "exaone_moe":
        return _mtp(cfg, "exaone_moe_mtp", nextn)
    if "exaone4_5" in model_type:
        return _mtp(cfg, "exaone4_5_mtp", nextn)
    if model_type in ("qwen3_5", "qwen3_5_moe", "intern_s2_preview"):
        return _mtp(cfg, "qwen3_5_mtp", hf_lookup(cfg, "mtp_num_hidden_layers"))
    if model_type in ("longcat_flash", "longcat_flash_ngram"):
        return _mtp(cfg, "longcat_flash_mtp", nextn or 1)
    if model_type in step or text.get("model_type") in step:
        base = text or cfg
        return _mtp(cfg, "step3p5_mtp", base.get("num_nextn_predict_layers") or 1, base=base)
    if model_type == "hy_v3":
        return _mtp(cfg, "hy_v3_mtp", nextn)
    if model_type in ("inkling_mm_model", "inkling_model"):
        layers = (cfg.get("mtp_config") or {}).get("num_nextn_predict_layers") or 0
        if layers < 1:
            raise SpeculativeConfigError(
                "The Inkling checkpoint does not contain MTP weights (mtp_config.num_nextn_predict_layers < 1)"
            )
        return _mtp(cfg, "inkling_mtp", layers)
    if model_type in ("gemma4_assistant", "gemma4_unified_assistant"):
        return _mtp(cfg, "gemma4_mtp", 1, num_kv_shared_layers=0)
    if model_type in ("minimax_m3_vl", "minimax_m3_mtp") or any(a.startswith("MiniMaxM3Sparse") for a in archs):
        return _mtp(cfg, "minimax_m3_mtp", hf_lookup(cfg, "num_mtp_modules"))
    if "MistralLarge3ForCausalLM" in archs:
        # model_type is kept, so detection stays name-based.
        return {**cfg, "architectures": ["EagleMistralLarge3ForCausalLM"]}
    return None


# ---------------------------------------------------------------------- speculators


def speculators_spec(cfg: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """The speculative config a speculators-format checkpoint implies, and its verifier."""
    try:
        speculators = cfg["speculators_config"]
        methods = speculators["proposal_methods"]
        verifier = speculators["verifier"]["name_or_path"]
        kind = cfg["speculators_model_type"]
    except (KeyError, TypeError) as e:
        raise SpeculativeConfigError(f"Invalid speculators config structure in {path!r}: missing {e}") from e
    if "transformer_layer_config" not in cfg:
        raise SpeculativeConfigError("Must provide transformer_layer_config")
    if not isinstance(cfg["transformer_layer_config"], dict):
        raise SpeculativeConfigError("transformer_layer_config must be a dictionary")
    if not methods or not isinstance(methods, list):
        raise SpeculativeConfigError("No proposal methods found in speculators config")
    first = methods[0] if isinstance(methods[0], dict) else {}
    if first.get("speculative_tokens") is None:
        raise SpeculativeConfigError(f"Missing 'speculative_tokens' in proposal method. Got: {methods[0]}")
    if kind not in _SPECULATORS_METHODS:
        raise SpeculativeConfigError(
            f"speculators_model_type={kind!r} is not supported; expected one of {sorted(_SPECULATORS_METHODS)}"
        )
    spec: dict[str, Any] = {"method": _SPECULATORS_METHODS[kind], "num_speculative_tokens": first["speculative_tokens"]}
    if kind == "peagle":
        spec["parallel_drafting"] = True
    return spec, verifier


def speculators_draft_config(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """The draft config vLLM builds from a speculators-format directory (its per-algorithm rewrites)."""
    layer = cfg.get("transformer_layer_config") or {}
    hf = {**layer, **{k: v for k, v in cfg.items() if k != "transformer_layer_config"}}
    kind = cfg.get("speculators_model_type")
    aux = cfg.get("aux_hidden_state_layer_ids") or cfg.get("eagle_aux_hidden_state_layer_ids")
    if kind in ("eagle3", "peagle"):
        qwen3 = layer.get("model_type") == "qwen3"
        hf["architectures"] = ["Eagle3Qwen3ForCausalLM" if qwen3 else "Eagle3LlamaForCausalLM"]
        hf.setdefault("norm_before_residual", True)  # the speculators default
        if kind == "peagle" and "mask_token_id" in hf:
            hf["pard_token"] = hf.pop("mask_token_id")
    elif kind == "dflash":
        dflash_config = dict(hf.get("dflash_config") or {})
        mask = dflash_config.get("mask_token_id", hf.get("mask_token_id"))
        if mask is None:
            raise SpeculativeConfigError(f"mask_token_id is required in the speculators dflash config of {path!r}")
        dflash_config.update(mask_token_id=mask)
        dflash_config.setdefault("sample_from_anchor", False)
        if aux:
            dflash_config["target_layer_ids"] = [a - 1 for a in aux]
        hf.update(architectures=["DFlashDraftModel"], dflash_config=dflash_config)
    elif kind == "dspark":
        hf["architectures"] = ["Qwen3DSparkModel"]
        hf.setdefault("sample_from_anchor", False)
        if aux:
            hf["target_layer_ids"] = [a - 1 for a in aux]
    return hf


# ---------------------------------------------------------------------- helpers


def hf_lookup(cfg: dict[str, Any], key: str) -> Any:
    """A config value, falling back to the text_config of multimodal wrappers."""
    if cfg.get(key) is not None:
        return cfg[key]
    text = cfg.get("text_config")
    return text.get(key) if isinstance(text, dict) else None
