"""backends/config/ against vLLM's SpeculativeConfig at c314af1 (its fields, method resolution,
_verify_args, derived helpers, per-method defaults, aux layer ids and dynamic K):
https://github.com/vllm-project/vllm/blob/c314af1abfddff7b6cce9af578be72c496c6a5e4/vllm/config/speculative.py"""

from __future__ import annotations

import logging

import pytest

from backends.config import (
    MTP_MODEL_TYPES,
    SpeculativeConfig,
    SpeculativeConfigError,
    UnsupportedSpeculativeMethodError,
    hf_config_override,
)
from tests.fixtures.helpers import LLAMA_CONFIG


def build(spec, **kw) -> SpeculativeConfig:
    return SpeculativeConfig.from_json(spec, **kw)


def fails(spec, *needles, exc=SpeculativeConfigError, **kw) -> str:
    with pytest.raises(exc) as info:
        build(spec, **kw)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    return message


# ---------------------------------------------------------------- parsing, field checks


def test_json_string_and_dict_agree():
    a = build('{"method": "ngram", "num_speculative_tokens": 3}')
    b = build({"method": "ngram", "num_speculative_tokens": 3})
    assert a.to_dict() == b.to_dict()
    assert (a.method, a.model, a.num_speculative_tokens) == ("ngram", "ngram", 3)


def test_kebab_case_top_level_keys():
    cfg = build({"method": "ngram", "num-speculative-tokens": 4, "prompt-lookup-max": 3})
    assert cfg.num_speculative_tokens == 4 and cfg.prompt_lookup_max == 3


def test_kebab_and_snake_for_the_same_key_is_an_error():
    fails(
        {"method": "ngram", "num-speculative-tokens": 4, "num_speculative_tokens": 4},
        "num_speculative_tokens",
        "more than once",
    )


def test_unknown_key_is_named_and_valid_keys_listed():
    msg = fails(
        {"method": "ngram", "num_speculative_tokens": 3, "num_spec_tokens": 2},
        "num_spec_tokens",
        "Extra inputs are not permitted",
    )
    assert "num_speculative_tokens" in msg and "prompt_lookup_min" in msg


@pytest.mark.parametrize("key", ["target_model", "resolution", "draft_hf_config", "checkpoint_config"])
def test_internal_names_are_not_user_keys(key):
    fails({"method": "ngram", "num_speculative_tokens": 3, key: "x"}, f"Unknown key '{key}'")


@pytest.mark.parametrize(
    "text,needle", [("{bad json", "not valid JSON"), ("[1, 2]", "JSON object"), ("3", "JSON object")]
)
def test_malformed_json(text, needle):
    fails(text, needle)


def test_errors_are_value_errors():
    assert issubclass(SpeculativeConfigError, ValueError)
    assert issubclass(UnsupportedSpeculativeMethodError, NotImplementedError)


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("num_speculative_tokens", True, "valid integer"),  # bool is not an int
        ("num_speculative_tokens", "3", "valid integer"),
        ("num_speculative_tokens", 2.0, "valid integer"),
        ("num_speculative_tokens", 0, "greater than 0"),
        ("num_speculative_tokens", -1, "greater than 0"),
        ("prompt_lookup_max", False, "valid integer"),
        ("prompt_lookup_min", 0, "greater than or equal to 1"),
        ("draft_tensor_parallel_size", 0, "greater than or equal to 1"),
        ("max_model_len", 0, "greater than or equal to 1"),
        ("tensor_parallel_size", "2", "valid integer"),
        ("suffix_decoding_max_tree_depth", True, "valid integer"),
        ("suffix_decoding_max_cached_requests", 1.5, "valid integer"),
        ("suffix_decoding_min_token_prob", True, "valid number"),
        ("suffix_decoding_max_spec_factor", "1", "valid number"),
        ("parallel_drafting", 1, "valid boolean"),
        ("use_heterogeneous_vocab", "true", "valid boolean"),
        ("enforce_eager", 0, "valid boolean"),
        ("model", 3, "valid string"),
        ("quantization", ["fp8"], "valid string"),
        ("draft_load_config", [], "valid dictionary"),
        ("hf_overrides", "x", "valid dictionary"),
        ("synthetic_acceptance_rates", [0.5, "a"], "list of numbers"),
        ("synthetic_acceptance_rates", [True], "list of numbers"),
        ("synthetic_acceptance_length", True, "valid number"),
        ("eagle_aux_hidden_state_layer_ids", [2, -1], "non-negative"),
        ("method", "[ngram]", "one of"),
        ("method", "strict", "one of"),
        ("rejection_sample_method", "strict", "one of"),  # stale docs value
        ("draft_sample_method", "random", "one of"),
    ],
)
def test_field_type_and_range_errors_name_the_field(field, value, needle):
    fails({"method": "ngram", "num_speculative_tokens": 3, field: value}, field, needle)


def test_field_checks_run_before_resolution():
    # A bad type wins over the (later) missing-K error.
    fails({"method": "ngram", "prompt_lookup_min": True}, "prompt_lookup_min", "valid integer")


@pytest.mark.parametrize("given,stored", [("auto", None), ("AUTO", None), ("flash_attn", "FLASH_ATTN")])
def test_attention_backend_is_case_insensitive(given, stored):
    cfg = build({"method": "ngram", "num_speculative_tokens": 3, "attention_backend": given})
    assert cfg.attention_backend == stored


def test_plain_defaults():
    cfg = build({"method": "ngram", "num_speculative_tokens": 3})
    assert cfg.rejection_sample_method == "standard" and cfg.draft_sample_method == "greedy"
    assert (
        cfg.suffix_decoding_max_tree_depth,
        cfg.suffix_decoding_max_cached_requests,
        cfg.suffix_decoding_max_spec_factor,
        cfg.suffix_decoding_min_token_prob,
    ) == (24, 10000, 1.0, 0.1)
    assert cfg.parallel_drafting is False and cfg.enforce_eager is None
    assert cfg.num_speculative_tokens_per_batch_size is None


# ---------------------------------------------------------------- A. method inference


@pytest.mark.parametrize("model", ["my_module.MyProposer", "pkg.sub.Cls", "my_model.v2"])
def test_dotted_class_path_infers_custom_class(model):
    cfg = build({"model": model, "num_speculative_tokens": 3})
    assert cfg.method == "custom_class" and "dotted class path" in cfg.resolution
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (0, 0)
    assert any("experimental" in w for w in cfg.warnings)


@pytest.mark.parametrize(
    "model", ["org/my_module.Cls", "https://host.example.Cls", "file://a.b", "a.1b", "a.class", "single", "a..b"]
)
def test_not_a_class_path_defaults_to_draft_model(model):
    cfg = build({"model": model, "num_speculative_tokens": 3})
    assert cfg.method == "draft_model" and cfg.resolution == "default draft_model"


@pytest.mark.parametrize("model", ["ngram", "[ngram]"])
def test_model_ngram_infers_ngram(model):
    cfg = build({"model": model, "num_speculative_tokens": 3})
    assert cfg.method == "ngram" and cfg.resolution == f"model '{model}'"


def test_custom_class_explicit_needs_a_dotted_path():
    fails(
        {"method": "custom_class", "model": "nodot", "num_speculative_tokens": 3},
        "Invalid custom proposer module path",
        "model=",
    )


# ---------------------------------------------------------------- B. legacy MTP names


@pytest.mark.parametrize("legacy", MTP_MODEL_TYPES)
def test_legacy_mtp_method_names_become_mtp(legacy, mkmodel):
    draft = mkmodel("draft", model_type=legacy, vocab_size=100)
    k = 1  # inkling_mtp requires exactly one
    cfg = build({"method": legacy, "model": draft, "num_speculative_tokens": k})
    assert cfg.method == "mtp"
    assert any("deprecated" in w and legacy in w for w in cfg.warnings)


def test_legacy_name_warning_goes_to_logging(mkmodel, caplog):
    draft = mkmodel("draft", model_type="deepseek_mtp")
    with caplog.at_level(logging.WARNING, logger="backends.config"):
        build({"method": "deepseek_mtp", "model": draft, "num_speculative_tokens": 1})
    assert "deprecated" in caplog.text


# ---------------------------------------------------------------- C. model missing


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_target_required_for_mtp_and_dspark_without_model(method):
    fails({"method": method, "num_speculative_tokens": 2}, f"target_model_config must be present for {method}")


def test_mtp_without_model_uses_target(mkmodel):
    target = mkmodel(
        "target",
        model_type="deepseek_v3",
        num_nextn_predict_layers=1,
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=129280,
        quantization_config={"quant_method": "fp8"},
    )
    cfg = build({"method": "mtp", "num_speculative_tokens": 1}, target_model=target)
    assert cfg.model == target and cfg.quantization == "fp8"
    assert cfg.draft_hf_config["model_type"] == "deepseek_mtp"
    assert cfg.draft_hf_config["architectures"] == ["DeepSeekMTPModel"]
    assert cfg.enforce_eager is None


def test_mtp_on_deepseek_v32_forces_enforce_eager(mkmodel):
    target = mkmodel("target", model_type="deepseek_v32", num_nextn_predict_layers=1)
    cfg = build({"method": "mtp", "num_speculative_tokens": 1}, target_model=target)
    assert cfg.enforce_eager is True


def test_explicit_quantization_is_kept_for_mtp(mkmodel):
    target = mkmodel(
        "target", model_type="deepseek_v3", num_nextn_predict_layers=1, quantization_config={"quant_method": "fp8"}
    )
    cfg = build({"method": "mtp", "num_speculative_tokens": 1, "quantization": "awq"}, target_model=target)
    assert cfg.quantization == "awq"


def test_mtp_with_bare_target_name_cannot_detect():
    # Nothing to read, and an explicit mtp is not sticky: step 10.
    fails(
        {"method": "mtp", "num_speculative_tokens": 1},
        "Unsupported speculative method",
        exc=UnsupportedSpeculativeMethodError,
        target_model="deepseek-ai/DeepSeek-V3",
    )


@pytest.mark.parametrize("method", ["ngram", "ngram_gpu", "suffix"])
def test_token_methods_get_their_name_as_model(method):
    assert build({"method": method, "num_speculative_tokens": 3}).model == method


def test_custom_class_without_model():
    fails({"method": "custom_class", "num_speculative_tokens": 3}, "method='custom_class' requires 'model'")


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "eagle", "num_speculative_tokens": 3},
        {"method": "draft_model", "num_speculative_tokens": 3},
        {"num_speculative_tokens": 3},
    ],
)
def test_k_without_model(spec):
    fails(spec, "num_speculative_tokens was provided but without speculative model")


# ---------------------------------------------------------------- D. ngram / suffix


@pytest.mark.parametrize(
    "given,expected",
    [
        ({}, (5, 5)),
        ({"prompt_lookup_min": 2}, (2, 2)),
        ({"prompt_lookup_max": 7}, (7, 7)),  # min mirrors max (code, not docstring)
        ({"prompt_lookup_min": 2, "prompt_lookup_max": 4}, (2, 4)),
    ],
)
@pytest.mark.parametrize("method", ["ngram", "ngram_gpu"])
def test_ngram_lookup_bounds(method, given, expected):
    cfg = build({"method": method, "num_speculative_tokens": 3, **given})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == expected


def test_ngram_min_above_max():
    fails(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
        "prompt_lookup_min=5 must be <= prompt_lookup_max=3",
    )


def test_ngram_uses_target_config_and_max_len(mkmodel):
    target = mkmodel("target", **LLAMA_CONFIG)
    cfg = build({"method": "ngram", "num_speculative_tokens": 3}, target_model=target)
    assert cfg.draft_hf_config["vocab_size"] == 32000
    assert cfg.target_max_model_len == 4096
    cfg = build({"method": "ngram", "num_speculative_tokens": 3}, target_model=target, target_max_model_len=1024)
    assert cfg.target_max_model_len == 1024


def test_lookup_bounds_are_zeroed_for_model_methods():
    cfg = build({"method": "draft_model", "model": "org/small", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (0, 0)


def test_suffix_k_defaults_to_tree_depth():
    cfg = build({"method": "suffix"})
    assert cfg.num_speculative_tokens == 24 and cfg.warnings
    cfg = build({"method": "suffix", "suffix_decoding_max_tree_depth": 8})
    assert cfg.num_speculative_tokens == 8
    assert build({"method": "suffix", "num_speculative_tokens": 5}).num_speculative_tokens == 5


@pytest.mark.parametrize(
    "field,value,bound",
    [
        ("suffix_decoding_max_tree_depth", 0, ">= 1"),
        ("suffix_decoding_max_cached_requests", -1, ">= 0"),
        ("suffix_decoding_max_spec_factor", -0.5, ">= 0"),
        ("suffix_decoding_min_token_prob", 1.5, "in [0, 1]"),
        ("suffix_decoding_min_token_prob", -0.1, "in [0, 1]"),
    ],
)
def test_suffix_ranges(field, value, bound):
    fails({"method": "suffix", field: value}, f"{field}={value} must be {bound}")


def test_suffix_zero_cached_requests_is_allowed():
    cfg = build({"method": "suffix", "suffix_decoding_max_cached_requests": 0})
    assert cfg.suffix_decoding_max_cached_requests == 0


def test_suffix_ranges_only_apply_to_suffix():
    cfg = build({"method": "ngram", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 0})
    assert cfg.suffix_decoding_max_tree_depth == 0


# ---------------------------------------------------------------- D. extract_hidden_states


def test_extract_hidden_states_without_layer_ids_parses():
    # vLLM accepts it here and fails when the proposer is built (test_config_conformance.py).
    cfg = build({"method": "extract_hidden_states", "num_speculative_tokens": 1})
    assert cfg.method == "extract_hidden_states" and cfg.eagle_aux_hidden_state_layer_ids is None


@pytest.mark.parametrize(
    "ids_spec",
    [
        {"draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 5]}}},
        {"hf_overrides": {"eagle_aux_hidden_state_layer_ids": [1, 5]}},
        {"eagle_aux_hidden_state_layer_ids": [1, 5]},
    ],
)
def test_extract_hidden_states(ids_spec, mkmodel):
    target = mkmodel("target", **LLAMA_CONFIG)
    cfg = build({"method": "extract_hidden_states", "num_speculative_tokens": 1, **ids_spec}, target_model=target)
    assert cfg.model == "extract_hidden_states"
    assert cfg.eagle_aux_hidden_state_layer_ids == [1, 5]
    assert cfg.draft_hf_config["architectures"] == ["ExtractHiddenStatesModel"]
    assert cfg.draft_hf_config["vocab_size"] == 32000  # built from the target config
    assert cfg.uses_extract_hidden_states() and not cfg.use_eagle()


def test_draft_model_config_accepts_only_hf_config():
    fails(
        {"method": "extract_hidden_states", "num_speculative_tokens": 1, "draft_model_config": {"model": "x"}},
        "draft_model_config",
    )


def test_extract_hidden_states_k_must_be_one():
    fails(
        {"method": "extract_hidden_states", "num_speculative_tokens": 2, "eagle_aux_hidden_state_layer_ids": [1]},
        "num_speculative_tokens must be 1",
    )


# ---------------------------------------------------------------- D. auto-detection order


@pytest.mark.parametrize("method", ["eagle", "eagle3", "dflash", "dspark"])
def test_step1_explicit_eagle_family_is_never_overridden(method, mkmodel):
    # The name says eagle-, the config says medusa: both are ignored.
    draft = mkmodel("EAGLE-medusa", model_type="medusa", architectures=["Qwen3DSparkModel"])
    cfg = build({"method": method, "model": draft, "num_speculative_tokens": 3})
    assert cfg.method == method and cfg.resolution == "explicit method"


@pytest.mark.parametrize(
    "name,method,reason",
    [
        ("yuhuili/EAGLE-LLaMA3-Instruct-8B", "eagle", "name contains 'eagle-'"),
        ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "eagle3", "name contains 'eagle3'"),
        ("org/EAGLE-v2-eagle3", "eagle", "name contains 'eagle-'"),  # eagle- first
        ("z-lab/Qwen3-8B-DFlash-b16", "dflash", "name contains 'dflash'"),
        ("org/dflash-dspark", "dflash", "name contains 'dflash'"),  # dflash before dspark
        ("deepseek-ai/dspark_qwen3_4b_block7", "dspark", "name contains 'dspark'"),
    ],
)
@pytest.mark.parametrize("given", [None, "draft_model", "medusa", "mlp_speculator", "mtp"])
def test_steps2to5_name_overrides_non_sticky_methods(name, method, reason, given):
    spec = {"model": name, "num_speculative_tokens": 3}
    if given:
        spec["method"] = given
    cfg = build(spec)
    assert (cfg.method, cfg.resolution) == (method, reason)


@pytest.mark.parametrize("arch", ["Qwen3DSparkModel", "Gemma4DSparkModel"])
def test_step5_dspark_architecture(arch, mkmodel):
    draft = mkmodel("blockdrafter", model_type="qwen3", architectures=[arch], block_size=4)
    cfg = build({"model": draft, "num_speculative_tokens": 4})
    assert cfg.method == "dspark" and cfg.resolution == f"draft architecture '{arch}'"
    assert cfg.parallel_drafting is True


@pytest.mark.parametrize("model_type", ["medusa", "mlp_speculator"])
def test_steps6_7_model_type(model_type, mkmodel):
    draft = mkmodel("heads", model_type=model_type, vocab_size=32000)
    for given in (None, "draft_model"):
        spec = {"model": draft, "num_speculative_tokens": 3}
        if given:
            spec["method"] = given
        cfg = build(spec)
        assert cfg.method == model_type
        assert cfg.resolution == f"draft model_type '{model_type}'"


def test_step8_mtp_model_type_and_layer_reuse_warning(mkmodel):
    draft = mkmodel("mtpdraft", model_type="deepseek_mtp", n_predict=1)
    cfg = build({"model": draft, "num_speculative_tokens": 1})
    assert cfg.method == "mtp" and cfg.resolution == "draft model_type 'deepseek_mtp'"
    assert not cfg.warnings
    cfg = build({"model": draft, "num_speculative_tokens": 2})
    assert any("same MTP layer" in w for w in cfg.warnings)


def test_step8_no_layer_reuse_warning_for_step3p5(mkmodel):
    draft = mkmodel("stepdraft", model_type="step3p5_mtp")
    cfg = build({"model": draft, "num_speculative_tokens": 3})
    assert cfg.method == "mtp" and not any("same MTP layer" in w for w in cfg.warnings)


@pytest.mark.parametrize("given,reason", [(None, "default draft_model"), ("draft_model", "explicit method")])
def test_step9_draft_model_kept(given, reason, mkmodel):
    draft = mkmodel("small", **LLAMA_CONFIG)
    spec = {"model": draft, "num_speculative_tokens": 3}
    if given:
        spec["method"] = given
    cfg = build(spec, target_model=mkmodel("target", **LLAMA_CONFIG))
    assert (cfg.method, cfg.resolution) == ("draft_model", reason)
    assert cfg.uses_draft_model()


@pytest.mark.parametrize("method", ["mlp_speculator", "mtp"])
def test_step10_unsupported(method, mkmodel):
    draft = mkmodel("small", **LLAMA_CONFIG)
    fails(
        {"method": method, "model": draft, "num_speculative_tokens": 3},
        f"Unsupported speculative method: '{method}'",
        exc=UnsupportedSpeculativeMethodError,
    )


def test_explicit_medusa_injects_model_type():
    cfg = build({"method": "medusa", "model": "FasterDecoding/medusa-vicuna-7b-v1.3", "num_speculative_tokens": 4})
    assert cfg.method == "medusa" and cfg.draft_hf_config["num_heads"] == 4


def test_explicit_medusa_needs_k(mkmodel):
    draft = mkmodel("heads", model_type="medusa", num_heads=5)
    fails({"method": "medusa", "model": draft}, "`num_speculative_tokens` was not provided")


def test_medusa_vocab_is_aligned_to_target(mkmodel):
    draft = mkmodel("heads", vocab_size=32000)
    target = mkmodel("target", **{**LLAMA_CONFIG, "vocab_size": 32001})
    cfg = build({"method": "medusa", "model": draft, "num_speculative_tokens": 2}, target_model=target)
    assert cfg.draft_hf_config["vocab_size"] == 32001
    assert cfg.draft_hf_config["truncated_vocab_size"] == 32001


@pytest.mark.parametrize("given", [None, "draft_model", "mtp"])
def test_deepseek_v3_draft_dir_becomes_mtp(given, mkmodel):
    draft = mkmodel(
        "dsdraft", model_type="deepseek_v3", num_nextn_predict_layers=1, architectures=["DeepseekV3ForCausalLM"]
    )
    spec = {"model": draft}
    if given:
        spec["method"] = given
    cfg = build(spec)
    assert cfg.method == "mtp"
    assert cfg.num_speculative_tokens == 1  # from n_predict = num_nextn_predict_layers
    assert "deepseek_mtp" in cfg.resolution and "'deepseek_v3' rewritten" in cfg.resolution


def test_qwen3_5_reads_mtp_layers_from_text_config(mkmodel):
    draft = mkmodel("q35", model_type="qwen3_5", text_config={"model_type": "qwen3_5_text", "mtp_num_hidden_layers": 2})
    cfg = build({"model": draft})
    assert cfg.method == "mtp" and cfg.num_speculative_tokens == 2


# ---------------------------------------------------------------- hf_config_override


@pytest.mark.parametrize(
    "config,model_type,n_predict,arch",
    [
        ({"model_type": "deepseek_v3", "num_nextn_predict_layers": 1}, "deepseek_mtp", 1, "DeepSeekMTPModel"),
        ({"model_type": "deepseek_v32", "num_nextn_predict_layers": 2}, "deepseek_mtp", 2, "DeepSeekMTPModel"),
        ({"model_type": "glm_moe_dsa", "num_nextn_predict_layers": 1}, "deepseek_mtp", 1, "DeepSeekMTPModel"),
        ({"model_type": "deepseek_v4", "num_nextn_predict_layers": 1}, "deepseek_mtp", 1, "DeepSeekV4MTPModel"),
        ({"model_type": "pangu_ultra_moe", "num_nextn_predict_layers": 1}, "pangu_ultra_moe_mtp", 1, None),
        (
            {"model_type": "mimo", "architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1},
            "mimo_mtp",
            1,
            None,
        ),
        ({"architectures": ["MiMoV2FlashForCausalLM"]}, "mimo_v2_mtp", 1, None),
        ({"architectures": ["Glm4MoeForCausalLM"], "num_nextn_predict_layers": 1}, "glm4_moe_mtp", 1, None),
        ({"architectures": ["Glm4MoeLiteForCausalLM"]}, "glm4_moe_lite_mtp", None, None),
        ({"architectures": ["GlmOcrForConditionalGeneration"]}, "glm_ocr_mtp", None, None),
        ({"model_type": "ernie4_5_moe", "num_nextn_predict_layers": 1}, "ernie_mtp", 1, None),
        ({"model_type": "nemotron_h", "num_nextn_predict_layers": 2}, "nemotron_h_mtp", 2, None),
        (
            {"model_type": "nemotron_vl", "text_config": {"model_type": "nemotron_h", "num_nextn_predict_layers": 1}},
            "nemotron_h_mtp",
            1,
            None,
        ),
        ({"model_type": "qwen3_next", "num_nextn_predict_layers": 1}, "qwen3_next_mtp", 1, None),
        ({"model_type": "bailing_hybrid"}, "bailing_hybrid_mtp", None, None),
        ({"architectures": ["BailingMoeV2_5ForCausalLM"]}, "bailing_hybrid_mtp", None, None),
        ({"model_type": "exaone_moe"}, "exaone_moe_mtp", None, None),
        ({"model_type": "exaone4_5_vl"}, "exaone4_5_mtp", None, None),
        ({"model_type": "qwen3_5_moe", "mtp_num_hidden_layers": 1}, "qwen3_5_mtp", 1, None),
        ({"model_type": "intern_s2_preview", "mtp_num_hidden_layers": 1}, "qwen3_5_mtp", 1, None),
        ({"model_type": "longcat_flash"}, "longcat_flash_mtp", 1, None),
        ({"model_type": "longcat_flash_ngram", "num_nextn_predict_layers": 2}, "longcat_flash_mtp", 2, None),
        ({"model_type": "step3p5"}, "step3p5_mtp", 1, None),
        (
            {"model_type": "step3p7", "text_config": {"model_type": "step3p7_text", "num_nextn_predict_layers": 3}},
            "step3p5_mtp",
            3,
            None,
        ),
        ({"model_type": "hy_v3", "num_nextn_predict_layers": 1}, "hy_v3_mtp", 1, None),
        ({"model_type": "inkling_model", "mtp_config": {"num_nextn_predict_layers": 1}}, "inkling_mtp", 1, None),
        ({"model_type": "gemma4_assistant"}, "gemma4_mtp", 1, None),
        ({"model_type": "gemma4_unified_assistant"}, "gemma4_mtp", 1, None),
        ({"model_type": "minimax_m3_vl", "num_mtp_modules": 2}, "minimax_m3_mtp", 2, None),
        ({"architectures": ["MiniMaxM3SparseForCausalLM"], "num_mtp_modules": 1}, "minimax_m3_mtp", 1, None),
    ],
)
def test_hf_config_override_rows(config, model_type, n_predict, arch):
    out = hf_config_override(config)
    assert out["model_type"] == model_type and out["n_predict"] == n_predict
    if arch:
        assert out["architectures"] == [arch]


def test_hf_config_override_extras():
    assert hf_config_override({"architectures": ["MiMoForCausalLM"], "num_hidden_layers": 36})["num_hidden_layers"] == 0
    assert hf_config_override({"model_type": "gemma4_assistant"})["num_kv_shared_layers"] == 0
    mistral = hf_config_override({"model_type": "mistral", "architectures": ["MistralLarge3ForCausalLM"]})
    assert mistral == {"model_type": "mistral", "architectures": ["EagleMistralLarge3ForCausalLM"]}


@pytest.mark.parametrize("config", [dict(LLAMA_CONFIG), {"model_type": "nemotron_h", "num_nextn_predict_layers": 0}])
def test_hf_config_override_leaves_other_configs(config):
    out = hf_config_override(config)
    assert out == config and out is not config


def test_inkling_without_mtp_weights():
    with pytest.raises(SpeculativeConfigError, match="does not contain MTP weights"):
        hf_config_override({"model_type": "inkling_mm_model", "mtp_config": {"num_nextn_predict_layers": 0}})


def test_inkling_allows_exactly_one_token(mkmodel):
    draft = mkmodel("ink", model_type="inkling_model", mtp_config={"num_nextn_predict_layers": 1})
    assert build({"model": draft}).num_speculative_tokens == 1
    fails({"model": draft, "num_speculative_tokens": 2}, "Inkling MTP", "num_speculative_tokens")


def test_gemma4_assistant_is_gemma4_mtp(mkmodel):
    draft = mkmodel("assistant", model_type="gemma4_assistant")
    cfg = build({"model": draft})
    assert cfg.method == "mtp" and cfg.use_gemma4_mtp() and not cfg.use_step3p5_mtp()
    assert cfg.num_speculative_tokens == 1


# ---------------------------------------------------------------- after detection


@pytest.mark.parametrize(
    "method,arch,renamed",
    [
        ("eagle", "LlamaForCausalLM", "EagleLlamaForCausalLM"),
        ("eagle", "EagleLlamaForCausalLM", "EagleLlamaForCausalLM"),
        ("eagle3", "LlamaForCausalLM", "Eagle3LlamaForCausalLM"),
        ("eagle3", "LlamaForCausalLMEagle3", "LlamaForCausalLMEagle3"),
        ("dflash", "Qwen3ForCausalLM", "DFlashQwen3ForCausalLM"),
        ("dflash", "DFlashDraftModel", "DFlashDraftModel"),
    ],
)
def test_eagle_family_config_is_wrapped(method, arch, renamed, mkmodel):
    draft = mkmodel("head", **{**LLAMA_CONFIG, "architectures": [arch]})
    cfg = build({"method": method, "model": draft, "num_speculative_tokens": 3})
    assert cfg.draft_hf_config["model_type"] == "eagle"
    assert cfg.draft_hf_config["architectures"] == [renamed]
    assert cfg.use_eagle() and cfg.parallel_drafting == (method == "dflash")


def test_dspark_without_dspark_arch_is_the_deepseek_v4_drafter(mkmodel):
    target = mkmodel(
        "target",
        model_type="deepseek_v4",
        num_nextn_predict_layers=1,
        dspark_block_size=4,
        dspark_target_layer_ids=[3, 7],
    )
    cfg = build({"method": "dspark", "num_speculative_tokens": 4}, target_model=target)
    assert cfg.model == target
    assert cfg.draft_hf_config["model_type"] == "deepseek_v4"
    assert cfg.draft_hf_config["architectures"] == ["DSparkDraftModel"]
    assert cfg.parallel_drafting and cfg.use_dspark() and cfg.use_eagle()
    assert cfg.eagle_aux_hidden_state_layer_ids == [4, 8]


def test_dspark_block_size(mkmodel):
    target = mkmodel("target", model_type="deepseek_v4", num_nextn_predict_layers=1, dspark_block_size=4)
    fails(
        {"method": "dspark", "num_speculative_tokens": 3},
        "num_speculative_tokens >= dspark_block_size (4); got 3",
        target_model=target,
    )


def test_gemma4_dspark_copies_block_size_and_layers(mkmodel):
    draft = mkmodel(
        "g4", model_type="gemma4", architectures=["Gemma4DSparkModel"], block_size=4, target_layer_ids=[1, 5]
    )
    cfg = build({"model": draft})
    assert cfg.num_speculative_tokens == 4  # block_size -> n_predict -> K
    assert cfg.draft_hf_config["dspark_target_layer_ids"] == [1, 5]
    fails({"model": draft, "num_speculative_tokens": 6}, "must be divisible by n_predict=4")


@pytest.mark.parametrize("k,ok", [(None, True), (2, True), (3, True), (6, True), (9, True), (4, False), (5, False)])
def test_n_predict_divisibility(k, ok, mkmodel):
    draft = mkmodel("mtp3", model_type="deepseek_mtp", n_predict=3)
    spec = {"model": draft} if k is None else {"model": draft, "num_speculative_tokens": k}
    if ok:
        assert build(spec).num_speculative_tokens == (k or 3)
    else:
        fails(spec, f"num_speculative_tokens:{k} must be divisible by n_predict=3")


def test_zero_n_predict_is_rejected(mkmodel):
    draft = mkmodel("mtp0", model_type="deepseek_mtp", n_predict=0)
    fails({"model": draft, "num_speculative_tokens": 2}, "n_predict=0")


def test_model_without_k_or_n_predict(mkmodel):
    draft = mkmodel("small", **LLAMA_CONFIG)
    fails({"model": draft}, "A speculative model was provided, but `num_speculative_tokens`")


def test_mlp_speculator_k_sets_stages(mkmodel):
    draft = mkmodel("mlp", model_type="mlp_speculator", n_predict=3)
    assert build({"model": draft}).num_speculative_tokens == 3
    cfg = build({"model": draft, "num_speculative_tokens": 6})  # K stages; n_predict stays
    assert cfg.draft_hf_config["num_lookahead_tokens"] == 6 and cfg.draft_hf_config["n_predict"] == 3
    fails({"model": draft, "num_speculative_tokens": 5}, "num_speculative_tokens:5 must be divisible by n_predict=3")
    no_n_predict = mkmodel("mlp_default", model_type="mlp_speculator")
    assert build({"model": no_n_predict}).num_speculative_tokens == 3


def test_mlp_speculator_draft_tp_is_one(mkmodel):
    draft = mkmodel("mlp", model_type="mlp_speculator", n_predict=3)
    cfg = build({"model": draft}, target_tensor_parallel_size=2)
    assert cfg.draft_tensor_parallel_size == 1 and cfg.warnings


def test_missing_config_json_in_a_model_dir(tmp_path_factory):
    empty = tmp_path_factory.mktemp("models") / "nocfg"
    empty.mkdir()
    fails({"model": str(empty), "num_speculative_tokens": 3}, "model: cannot read")


# ---------------------------------------------------------------- draft TP / max len


@pytest.mark.parametrize("target_tp,draft_tp,expected", [(1, None, 1), (2, None, 2), (2, 2, 2), (2, 1, 1)])
def test_draft_tensor_parallel_size(target_tp, draft_tp, expected):
    spec = {"method": "eagle", "model": "org/head", "num_speculative_tokens": 3}
    if draft_tp:
        spec["draft_tensor_parallel_size"] = draft_tp
    cfg = build(spec, target_tensor_parallel_size=target_tp)
    assert cfg.draft_tensor_parallel_size == expected


def test_draft_tensor_parallel_size_must_be_one_or_target():
    fails(
        {"method": "eagle", "model": "org/head", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 3},
        "draft_tensor_parallel_size=3 cannot be other value",
        target_tensor_parallel_size=2,
    )


def test_draft_model_tp_must_equal_target_tp():
    fails(
        {"model": "org/small", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1},
        "'draft_tensor_parallel_size' and 'tensor_parallel_size' must be the same",
        target_tensor_parallel_size=2,
    )


@pytest.mark.parametrize(
    "spec_len,target_len,expected", [(None, None, 2048), (1024, None, 1024), (None, 1000, 1000), (2048, None, 2048)]
)
def test_draft_max_model_len(spec_len, target_len, expected, mkmodel):
    draft = mkmodel("small", **{**LLAMA_CONFIG, "max_position_embeddings": 2048})
    target = mkmodel("target", **LLAMA_CONFIG)
    spec = {"model": draft, "num_speculative_tokens": 3}
    if spec_len:
        spec["max_model_len"] = spec_len
    cfg = build(spec, target_model=target, target_max_model_len=target_len)
    assert cfg.draft_max_model_len == expected


@pytest.mark.parametrize(
    "spec_len,target_len,needle",
    [
        (3000, None, "spec=3000 cannot be larger than draft=2048"),
        (1500, 1000, "spec=1500 cannot be larger than target=1000"),
    ],
)
def test_draft_max_model_len_limits(spec_len, target_len, needle, mkmodel):
    draft = mkmodel("small", **{**LLAMA_CONFIG, "max_position_embeddings": 2048})
    fails(
        {"model": draft, "num_speculative_tokens": 3, "max_model_len": spec_len},
        "max_model_len",
        needle,
        target_max_model_len=target_len,
    )


# ---------------------------------------------------------------- _verify_args


def test_tensor_parallel_size_is_the_wrong_key():
    fails(
        {"method": "ngram", "num_speculative_tokens": 3, "tensor_parallel_size": 1},
        "'tensor_parallel_size' is not a valid argument",
        "'draft_tensor_parallel_size'",
    )


@pytest.mark.parametrize("spec", [{}, {"method": "ngram"}, {"method": "mtp"}, {"method": "eagle"}])
def test_k_is_required(spec):
    fails(spec, "num_speculative_tokens must be provided with speculative model")


def synthetic(k, **extra):
    return {"method": "ngram", "num_speculative_tokens": k, "rejection_sample_method": "synthetic", **extra}


@pytest.mark.parametrize(
    "k,length,rates",
    [
        (3, 1, [0.0, 0.0, 0.0]),
        (3, 2.5, [1.0, 0.5, 0.0]),
        (3, 3, [1.0, 1.0, 0.0]),
        (3, 4, [1.0, 1.0, 1.0]),
        (1, 1.25, [0.25]),
        (4, 3.75, [1.0, 1.0, 0.75, 0.0]),
    ],
)
def test_synthetic_rates_from_length(k, length, rates):
    cfg = build(synthetic(k, synthetic_acceptance_length=length))
    assert cfg.synthetic_acceptance_rates == pytest.approx(rates)
    assert cfg.synthetic_acceptance_length is None


def test_synthetic_rates_given():
    cfg = build(synthetic(3, synthetic_acceptance_rates=[0.9, 0.9, 0.2]))
    assert cfg.synthetic_acceptance_rates == [0.9, 0.9, 0.2]


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({}, "requires exactly one of synthetic_acceptance_rates or synthetic_acceptance_length"),
        ({"synthetic_acceptance_rates": [1, 1, 1], "synthetic_acceptance_length": 2}, "requires exactly one of"),
        ({"synthetic_acceptance_rates": [0.5, 0.4]}, "synthetic_acceptance_rates must have length 3"),
        ({"synthetic_acceptance_rates": [1.5, 0.4, 0.1]}, "synthetic_acceptance_rates entries must be in [0, 1]"),
        ({"synthetic_acceptance_rates": [0.5, 0.6, 0.1]}, "synthetic_acceptance_rates must be non-increasing"),
        ({"synthetic_acceptance_length": 0.5}, "synthetic_acceptance_length must be in [1, 4], got 0.5"),
        ({"synthetic_acceptance_length": 4.5}, "synthetic_acceptance_length must be in [1, 4]"),
    ],
)
def test_synthetic_errors(extra, needle):
    fails(synthetic(3, **extra), needle)


@pytest.mark.parametrize("extra", [{"synthetic_acceptance_rates": [0.5]}, {"synthetic_acceptance_length": 1.5}])
def test_synthetic_fields_need_synthetic_method(extra):
    fails(
        {"method": "ngram", "num_speculative_tokens": 1, **extra}, "only valid with rejection_sample_method='synthetic'"
    )


@pytest.mark.parametrize(
    "spec,needle",
    [
        ({"method": "draft_model", "model": "org/small"}, "method='draft_model'"),
        (
            {"method": "extract_hidden_states", "eagle_aux_hidden_state_layer_ids": [1]},
            "method='extract_hidden_states'",
        ),
        ({"method": "dflash", "model": "org/drafter"}, "parallel_drafting"),
        ({"method": "eagle3", "model": "org/head", "parallel_drafting": True}, "parallel_drafting"),
    ],
)
def test_disable_padded_drafter_batch_unsupported(spec, needle):
    fails(
        {**spec, "num_speculative_tokens": 1, "disable_padded_drafter_batch": True},
        "disable_padded_drafter_batch",
        needle,
    )


def test_disable_padded_drafter_batch_allowed_for_eagle():
    assert build(
        {"method": "eagle", "model": "org/head", "num_speculative_tokens": 2, "disable_padded_drafter_batch": True}
    ).disable_padded_drafter_batch


def test_vocab_sizes_must_match_for_draft_model(mkmodel):
    draft = mkmodel("small", **{**LLAMA_CONFIG, "vocab_size": 49152})
    target = mkmodel("target", **LLAMA_CONFIG)
    fails(
        {"model": draft, "num_speculative_tokens": 3},
        "same vocabulary size",
        "vocab_size=32000",
        "vocab_size=49152",
        target_model=target,
    )
    cfg = build({"model": draft, "num_speculative_tokens": 3, "use_heterogeneous_vocab": True}, target_model=target)
    assert cfg.use_heterogeneous_vocab


def test_vocab_check_only_for_draft_model(mkmodel):
    head = mkmodel("head", **{**LLAMA_CONFIG, "vocab_size": 49152})
    target = mkmodel("target", **LLAMA_CONFIG)
    assert build({"method": "eagle", "model": head, "num_speculative_tokens": 3}, target_model=target).method == "eagle"


@pytest.mark.parametrize(
    "spec,needle",
    [
        ({"method": "eagle", "model": "org/head"}, "use_heterogeneous_vocab only works with method='draft_model'"),
        (
            {"model": "org/small", "draft_sample_method": "probabilistic"},
            "use_heterogeneous_vocab currently only supports greedy draft sampling",
        ),
    ],
)
def test_heterogeneous_vocab_rules(spec, needle):
    fails({**spec, "num_speculative_tokens": 3, "use_heterogeneous_vocab": True}, needle)


# ---------------------------------------------------------------- aux layer ids


@pytest.mark.parametrize(
    "draft_extra,expected",
    [
        ({"eagle_aux_hidden_state_layer_ids": [1, 10, 20]}, [1, 10, 20]),
        ({"dflash_config": {"target_layer_ids": [1, 9]}}, [2, 10]),
        ({"target_layer_ids": [0, 4]}, [1, 5]),
        ({"eagle_config": {"layer_ids": [3, 4]}}, [3, 4]),
        ({}, [2, 16, 29]),  # target default for L=32
        ({"eagle_config": {"use_aux_hidden_state": False}}, None),
    ],
)
def test_aux_layer_ids(draft_extra, expected, mkmodel):
    draft = mkmodel("head", **LLAMA_CONFIG, **draft_extra)
    cfg = build(
        {"method": "eagle3", "model": draft, "num_speculative_tokens": 3},
        target_model=mkmodel("target", **LLAMA_CONFIG),
    )
    assert cfg.eagle_aux_hidden_state_layer_ids == expected


def test_user_aux_layer_ids_win_over_the_draft_config(mkmodel):
    draft = mkmodel("head", **LLAMA_CONFIG, eagle_aux_hidden_state_layer_ids=[1, 10, 20])
    cfg = build(
        {"method": "eagle3", "model": draft, "num_speculative_tokens": 3, "eagle_aux_hidden_state_layer_ids": [4, 5, 6]}
    )
    assert cfg.eagle_aux_hidden_state_layer_ids == [4, 5, 6]


def test_hf_overrides_apply_before_the_mtp_rewrite(mkmodel):
    draft = mkmodel("small", **LLAMA_CONFIG)
    cfg = build({"model": draft, "hf_overrides": {"model_type": "qwen3_next", "num_nextn_predict_layers": 1}})
    assert cfg.method == "mtp" and cfg.draft_hf_config["model_type"] == "qwen3_next_mtp"


# ---------------------------------------------------------------- speculators format


def speculators(kind="eagle3", verifier="meta-llama/Llama-3.1-8B-Instruct", tokens=3, **extra):
    config = {
        "speculators_model_type": kind,
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": {"model_type": "llama", "vocab_size": 128256, "max_position_embeddings": 2048},
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}],
            "verifier": {"name_or_path": verifier},
        },
    }
    config.update(extra)
    return config


def test_speculators_target_replaces_the_user_spec(mkmodel):
    path = mkmodel("llama-speculator", **speculators())
    cfg = build({"method": "ngram", "num_speculative_tokens": 9}, target_model=path)
    assert (cfg.method, cfg.num_speculative_tokens, cfg.model) == ("eagle3", 3, path)
    assert cfg.target_model == "meta-llama/Llama-3.1-8B-Instruct"
    assert "speculators_model_type 'eagle3'" in cfg.resolution
    assert any("discarded" in w for w in cfg.warnings)
    hf = cfg.draft_hf_config
    assert hf["architectures"] == ["Eagle3LlamaForCausalLM"] and hf["vocab_size"] == 128256
    assert hf["norm_before_residual"] is True
    assert cfg.draft_max_model_len == 2048


def test_speculators_qwen3_eagle3_and_local_verifier(mkmodel):
    verifier = mkmodel("verifier", **{**LLAMA_CONFIG, "num_hidden_layers": 36})
    raw = speculators(verifier=verifier)
    raw["transformer_layer_config"]["model_type"] = "qwen3"
    cfg = SpeculativeConfig.from_target_speculators(mkmodel("q3-speculator", **raw))
    assert cfg.draft_hf_config["architectures"] == ["Eagle3Qwen3ForCausalLM"]
    assert cfg.target_hf_config["num_hidden_layers"] == 36
    assert cfg.eagle_aux_hidden_state_layer_ids == [2, 18, 33]


def test_speculators_peagle(mkmodel):
    cfg = build({}, target_model=mkmodel("p", **speculators("peagle", mask_token_id=7)))
    assert cfg.method == "eagle3" and cfg.parallel_drafting
    assert cfg.draft_hf_config["pard_token"] == 7 and "mask_token_id" not in cfg.draft_hf_config


def test_speculators_dflash(mkmodel):
    raw = speculators("dflash", mask_token_id=99, aux_hidden_state_layer_ids=[2, 10])
    cfg = build({}, target_model=mkmodel("d", **raw))
    assert cfg.method == "dflash" and cfg.parallel_drafting
    assert cfg.draft_hf_config["architectures"] == ["DFlashDraftModel"]
    assert cfg.draft_hf_config["dflash_config"] == {
        "mask_token_id": 99,
        "sample_from_anchor": False,
        "target_layer_ids": [1, 9],
    }
    assert cfg.eagle_aux_hidden_state_layer_ids == [2, 10]
    fails({}, "mask_token_id is required", target_model=mkmodel("nomask", **speculators("dflash")))


def test_speculators_dspark_keeps_its_arch(mkmodel):
    raw = speculators("dspark", tokens=4, aux_hidden_state_layer_ids=[2, 10])
    cfg = build({}, target_model=mkmodel("s", **raw))
    assert cfg.method == "dspark"
    assert cfg.draft_hf_config["architectures"] == ["Qwen3DSparkModel"]
    assert cfg.draft_hf_config["target_layer_ids"] == [1, 9]
    assert cfg.draft_hf_config["sample_from_anchor"] is False


def test_speculators_errors(mkmodel):
    no_verifier = speculators()
    del no_verifier["speculators_config"]["verifier"]
    no_layer = speculators()
    del no_layer["transformer_layer_config"]
    no_methods = speculators()
    no_methods["speculators_config"]["proposal_methods"] = []
    no_tokens = speculators()
    del no_tokens["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    for name, raw, needle in [
        ("a", no_verifier, "Invalid speculators config structure"),
        ("b", no_layer, "Must provide transformer_layer_config"),
        ("c", no_methods, "No proposal methods found in speculators config"),
        ("d", no_tokens, "Missing 'speculative_tokens'"),
        ("e", speculators("medusa"), "speculators_model_type='medusa'"),
    ]:
        fails({}, needle, target_model=mkmodel(name, **raw))


# ---------------------------------------------------------------- helpers


@pytest.mark.parametrize(
    "spec,use_eagle,slots",
    [
        ({"method": "ngram"}, False, 0),
        ({"method": "draft_model", "model": "org/small"}, False, 1),
        ({"method": "draft_model", "model": "org/small", "parallel_drafting": True}, False, 4),
        ({"method": "eagle", "model": "org/head"}, True, 0),
        ({"method": "eagle3", "model": "org/head"}, True, 0),
        ({"method": "dflash", "model": "org/drafter"}, True, 3),
        (
            {
                "method": "mlp_speculator",
                "model": "org/x",
                "hf_overrides": {"model_type": "mlp_speculator", "n_predict": 4},
            },
            False,
            0,
        ),
    ],
)
def test_use_eagle_and_drafting_slots(spec, use_eagle, slots):
    cfg = build({**spec, "num_speculative_tokens": 4})
    assert cfg.use_eagle() is use_eagle
    assert cfg.max_num_new_slots_for_drafting == slots


def test_method_predicates():
    cfg = build({"method": "ngram_gpu", "num_speculative_tokens": 2})
    assert cfg.use_ngram_gpu() and not cfg.use_dflash() and not cfg.uses_draft_model()
    assert build({"method": "dflash", "model": "org/d", "num_speculative_tokens": 2}).use_dflash()


def test_compute_hash_tracks_only_graph_factors(mkmodel):
    assert (
        build({"method": "ngram", "num_speculative_tokens": 2}).compute_hash()
        == build({"method": "ngram", "num_speculative_tokens": 5}).compute_hash()
    )
    head = mkmodel("head", **LLAMA_CONFIG)
    a = build(
        {"method": "eagle3", "model": head, "num_speculative_tokens": 2, "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    )
    b = build(
        {"method": "eagle3", "model": head, "num_speculative_tokens": 2, "eagle_aux_hidden_state_layer_ids": [1, 2, 4]}
    )
    assert a.compute_hash() != b.compute_hash()


@pytest.mark.parametrize("requested,expected", [(None, 4), (0, 0), (2, 2), (4, 4)])
def test_num_draft_tokens_for_request(requested, expected):
    cfg = build({"method": "ngram", "num_speculative_tokens": 4})
    assert cfg.num_draft_tokens_for_request(requested) == expected


@pytest.mark.parametrize("requested", [5, -1, True, 2.0])
def test_num_draft_tokens_for_request_errors(requested):
    cfg = build({"method": "ngram", "num_speculative_tokens": 4})
    with pytest.raises(SpeculativeConfigError, match="num_draft_tokens"):
        cfg.num_draft_tokens_for_request(requested)


SCHEDULE = [[5, 8, 3], [1, 4, 6], [17, 32, 0]]  # unsorted on purpose


@pytest.mark.parametrize(
    "batch_size,expected",
    [
        (1, 4),
        (4, 4),  # capped at num_speculative_tokens
        (5, 3),
        (8, 3),
        (12, 3),  # gap: carried forward
        (17, 0),
        (32, 0),
        (100, 0),  # tail: carried forward
    ],
)
def test_num_draft_tokens_for_batch_size(batch_size, expected):
    cfg = build({"method": "ngram", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": SCHEDULE})
    assert cfg.uses_dynamic_speculative_decoding()
    assert cfg.num_speculative_tokens_per_batch_size == [(1, 4, 6), (5, 8, 3), (17, 32, 0)]
    assert cfg.num_draft_tokens_for_batch_size(batch_size) == expected


def test_num_draft_tokens_for_batch_size_without_schedule():
    cfg = build({"method": "ngram", "num_speculative_tokens": 4})
    assert not cfg.uses_dynamic_speculative_decoding()
    assert cfg.num_draft_tokens_for_batch_size(64) == 4
    with pytest.raises(SpeculativeConfigError, match="batch_size"):
        cfg.num_draft_tokens_for_batch_size(0)


@pytest.mark.parametrize(
    "schedule,needle",
    [
        ([], "must not be empty"),
        ("1-4:3", "should be a list"),
        ([[1, 4]], "3-item sequence"),
        ([[1, 4, True]], "3-item sequence"),
        ([[0, 4, 1]], "must be positive"),
        ([[1, 4, 1], [6, 5, 1]], "start must be <= end"),
        ([[1, 4, -1]], "values must be >= 0"),
        ([[1, 4, 1], [4, 8, 1]], "non-overlapping and sorted"),
        ([[2, 4, 1]], "The first batch-size range must start at 1"),
    ],
)
def test_batch_schedule_validation(schedule, needle):
    fails(
        {"method": "ngram", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": schedule},
        "num_speculative_tokens_per_batch_size",
        needle,
    )


def test_to_dict_and_explain(mkmodel):
    import dataclasses

    cfg = build({"method": "draft_model", "model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 3})
    values = cfg.to_dict()
    assert {f.name for f in dataclasses.fields(SpeculativeConfig)} <= set(values)
    assert values["use_eagle"] is True and values["max_num_new_slots_for_drafting"] == 0
    text = cfg.explain()
    assert text.splitlines()[0] == "method: eagle  <- name contains 'eagle-'"
    assert "num_speculative_tokens: 3" in text and "draft_max_model_len: None" in text
