"""vLLM conformance items of backends/config (issue 18): fields accepted but without effect
here, extract_hidden_states refused at build rather than parse, the `tritonspec serve`
shorthand flags, and the resolved DrafterConfig a proposer takes."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from backends.config import NO_EFFECT_FIELDS, DrafterConfig, SpeculativeConfig
from backends.serving.proposer import build_proposer
from client.cli.main import build_parser
from client.cli.serve_command import with_spec_shorthands
from tests.fixtures.helpers import LLAMA_CONFIG

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def no_effect_warnings(cfg: SpeculativeConfig) -> list[str]:
    return [w for w in cfg.warnings if "has no effect on this server" in w]


# ---------------------------------------------------------------- fields with no effect here


@pytest.mark.parametrize(
    "name,value",
    [
        ("attention_backend", "flash_attn"),
        ("kv_cache_dtype", "fp8"),
        ("enforce_eager", True),
        ("enforce_eager", False),
        ("moe_backend", "triton"),
        ("revision", "main"),
        ("code_revision", "v1"),
        ("disable_padded_drafter_batch", True),
        ("use_local_argmax_reduction", True),
        ("parallel_drafting", True),
        ("draft_load_config", {"load_format": "auto"}),
    ],
)
def test_no_effect_field_is_warned_once_and_marked(name, value, caplog):
    with caplog.at_level(logging.WARNING, logger="backends.config"):
        cfg = SpeculativeConfig.from_json({**NGRAM, name: value})
    [warning] = no_effect_warnings(cfg)
    assert warning.startswith(f"{name}=") and warning in caplog.text
    assert cfg.no_effect_fields == [name]
    line = next(line for line in cfg.explain().splitlines() if line.startswith(f"{name}: "))
    assert line.endswith("(no effect here)")


def test_defaults_and_resolved_values_are_not_warned(mkmodel):
    assert not no_effect_warnings(SpeculativeConfig.from_json({**NGRAM, "attention_backend": "auto"}))
    # Resolution sets enforce_eager (deepseek_v32 MTP) and parallel_drafting (dflash) itself.
    target = mkmodel("target", model_type="deepseek_v32", num_nextn_predict_layers=1)
    mtp = SpeculativeConfig.from_json({"method": "mtp", "num_speculative_tokens": 1}, target_model=target)
    draft = mkmodel("block-draft", **LLAMA_CONFIG)
    dflash = SpeculativeConfig.from_json({"method": "dflash", "model": draft, "num_speculative_tokens": 4})
    assert mtp.enforce_eager and dflash.parallel_drafting
    assert not no_effect_warnings(mtp) and not no_effect_warnings(dflash)
    # Every always-ignored field is still marked in explain, set or not.
    marked = {line.split(":")[0] for line in mtp.explain().splitlines() if line.endswith("(no effect here)")}
    assert marked == set(NO_EFFECT_FIELDS)


def test_block_rejection_is_no_effect_but_synthetic_is_kept():
    block = SpeculativeConfig.from_json({**NGRAM, "rejection_sample_method": "block"})
    assert block.no_effect_fields == ["rejection_sample_method"]
    assert "standard rejection sampling runs" in no_effect_warnings(block)[0]
    synthetic = SpeculativeConfig.from_json(
        {**NGRAM, "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.9, 0.5, 0.1]}
    )
    assert not no_effect_warnings(synthetic)
    assert "rejection_sample_method: 'synthetic'\n" in synthetic.explain() + "\n"


@pytest.mark.parametrize(
    "spec,flagged",
    [
        ({**NGRAM, "draft_tensor_parallel_size": 2}, ["draft_tensor_parallel_size"]),
        ({"method": "suffix", "draft_tensor_parallel_size": 4}, ["draft_tensor_parallel_size"]),
        ({**NGRAM, "draft_tensor_parallel_size": 1}, []),
        (
            {"method": "eagle", "model": "org/EAGLE-x", "num_speculative_tokens": 3, "quantization": "fp8"},
            ["quantization"],
        ),
        ({"method": "draft_model", "model": "org/small", "num_speculative_tokens": 3, "quantization": "int8"}, []),
        ({"method": "eagle3", "model": "org/EAGLE3-x", "num_speculative_tokens": 3, "quantization": "int8"}, []),
    ],
)
def test_method_dependent_no_effect_fields(spec, flagged):
    assert SpeculativeConfig.from_json(spec).no_effect_fields == flagged


# ---------------------------------------------------------------- extract_hidden_states


def test_extract_hidden_states_without_layers_is_refused_at_build():
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1}
    cfg = SpeculativeConfig.from_json(spec)  # accepted, as vLLM's parse does
    for config in (cfg, DrafterConfig.from_speculative(cfg)):
        with pytest.raises(
            ValueError,
            match="eagle_aux_hidden_state_layer_ids must be set in the draft model "
            "config for extract_hidden_states method",
        ):
            build_proposer(config, max_model_len=128, target_model=None)


# ---------------------------------------------------------------- serve shorthand flags


def serve_config(*argv: str) -> str | None:
    parser = build_parser()
    return with_spec_shorthands(parser.parse_args(["serve", *argv]), parser)


def test_shorthands_give_the_same_config_as_sc():
    by_flags = serve_config("--spec-method", "ngram", "--spec-model", "ngram", "--spec-tokens", "3")
    by_json = serve_config("-sc", json.dumps({"method": "ngram", "model": "ngram", "num_speculative_tokens": 3}))
    assert SpeculativeConfig.from_json(by_flags).to_dict() == SpeculativeConfig.from_json(by_json).to_dict()


def test_shorthands_merge_with_other_sc_keys():
    merged = json.loads(
        serve_config("--speculative-config", '{"prompt-lookup-max": 4}', "--spec-method", "ngram", "--spec-tokens", "2")
    )
    assert merged == {"prompt-lookup-max": 4, "method": "ngram", "num_speculative_tokens": 2}
    assert serve_config("-sc", '{"method": "suffix"}') == '{"method": "suffix"}'  # untouched without shorthands
    assert serve_config() is None


@pytest.mark.parametrize(
    "flag,value,sc",
    [
        ("--spec-tokens", "3", '{"num_speculative_tokens": 4}'),
        ("--spec-tokens", "3", '{"num-speculative-tokens": 4}'),
        ("--spec-method", "ngram", '{"method": "suffix"}'),
        ("--spec-model", "x", '{"model": "y"}'),
    ],
)
def test_shorthand_and_sc_key_are_mutually_exclusive(flag, value, sc, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve_config(flag, value, "-sc", sc)
    assert exit_info.value.code == 2
    key = json.loads(sc).popitem()[0].replace("-", "_")
    assert f"{flag} and --speculative-config['{key}'] are mutually exclusive" in capsys.readouterr().err


# ---------------------------------------------------------------- DrafterConfig


def test_drafter_config_ngram_with_schedule_and_synthetic_rates():
    cfg = SpeculativeConfig.from_json(
        {
            **NGRAM,
            "prompt_lookup_min": 2,
            "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 64, 1]],
            "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": 2.5,
        },
        target_max_model_len=1024,
    )
    drafter = DrafterConfig.from_speculative(cfg)
    assert (drafter.method, drafter.model, drafter.num_speculative_tokens) == ("ngram", "ngram", 3)
    assert (drafter.prompt_lookup_min, drafter.prompt_lookup_max, drafter.max_model_len) == (2, 2, 1024)
    assert drafter.num_speculative_tokens_per_batch_size == ((1, 4, 3), (5, 64, 1))
    assert drafter.synthetic_acceptance_rates == (1.0, 0.5, 0.0)
    assert drafter.rejection_sample_method == "synthetic"
    for batch_size in (1, 4, 5, 100):
        assert drafter.num_draft_tokens_for_batch_size(batch_size) == cfg.num_draft_tokens_for_batch_size(batch_size)
    assert drafter.num_draft_tokens_for_request(None) == 3 and drafter.num_draft_tokens_for_request(0) == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        drafter.num_speculative_tokens = 5


def test_drafter_config_draft_model_reads_nothing_again(mkmodel):
    target = mkmodel("target", **LLAMA_CONFIG)
    draft = mkmodel("small", **{**LLAMA_CONFIG, "max_position_embeddings": 2048})
    cfg = SpeculativeConfig.from_json(
        {"model": draft, "num_speculative_tokens": 4, "quantization": "int8", "draft_sample_method": "probabilistic"},
        target_model=target,
    )
    drafter = DrafterConfig.from_speculative(cfg)
    assert (drafter.method, drafter.model, drafter.quantization) == ("draft_model", draft, "int8")
    assert drafter.draft_sample_method == "probabilistic" and drafter.max_model_len == 2048
    assert drafter.draft_hf_config == cfg.draft_hf_config and drafter.draft_hf_config is not cfg.draft_hf_config
    assert drafter.checkpoint_config == cfg.checkpoint_config and drafter.checkpoint_config is not cfg.checkpoint_config
    assert drafter.draft_tensor_parallel_size == 1 and drafter.eagle_aux_hidden_state_layer_ids is None


def test_drafter_config_aux_layers_and_mtp_on_the_target(mkmodel):
    target = mkmodel("target", **LLAMA_CONFIG)
    head = mkmodel("head", **LLAMA_CONFIG)
    eagle3 = DrafterConfig.from_speculative(
        SpeculativeConfig.from_json(
            {"method": "eagle3", "model": head, "num_speculative_tokens": 3}, target_model=target
        )
    )
    assert eagle3.eagle_aux_hidden_state_layer_ids == (2, 16, 29)  # vLLM's default for 32 layers
    assert eagle3.draft_hf_config["architectures"] == ["Eagle3LlamaForCausalLM"]
    mtp_target = mkmodel("dsv3", model_type="deepseek_v3", num_nextn_predict_layers=1, max_position_embeddings=8192)
    mtp = DrafterConfig.from_speculative(
        SpeculativeConfig.from_json({"method": "mtp", "num_speculative_tokens": 1}, target_model=mtp_target)
    )
    assert (mtp.method, mtp.model, mtp.max_model_len) == ("mtp", mtp_target, 8192)
    assert mtp.draft_hf_config["model_type"] == "deepseek_mtp"


def test_drafter_config_extract_hidden_states_and_suffix():
    extract = DrafterConfig.from_speculative(
        SpeculativeConfig.from_json(
            {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 5]}},
            }
        )
    )
    assert extract.eagle_aux_hidden_state_layer_ids == (1, 5)
    assert extract.draft_hf_config["architectures"] == ["ExtractHiddenStatesModel"]
    suffix = DrafterConfig.from_speculative(
        SpeculativeConfig.from_json(
            {"method": "suffix", "suffix_decoding_max_tree_depth": 8, "suffix_decoding_min_token_prob": 0.2}
        )
    )
    assert (suffix.num_speculative_tokens, suffix.suffix_decoding_max_tree_depth) == (8, 8)
    assert suffix.suffix_decoding_min_token_prob == 0.2 and suffix.draft_hf_config == {}
