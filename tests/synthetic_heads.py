"""Tiny random Medusa, MLP speculator and MTP checkpoints in their published layouts (the
config.json fields and state-dict keys of FasterDecoding / vLLM Medusa heads, IBM's fms-extras
speculators, DeepSeek-V3 / MiMo / Step-3.5 MTP layers; /work/shared/reference/
checkpoint_formats.md §4-6, §12), sized for a tiny target. Keys are spelled out here,
independently of the loaders under test."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.synthetic_checkpoints import _layer, _rand, _target_config, save_checkpoint


def write_medusa(out: Path, target_dir: Path, *, layout: str = "medusa", num_heads: int = 4, num_layers: int = 1,
                 config_heads: int | None = None, fmt: str = "pt", prefix: str = "", bias: bool = True,
                 shared_lm_head: bool = False, draft_vocab_size: int | None = None,
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """layout "medusa": FasterDecoding (`medusa_lm_head.pt` or `.safetensors`, an old config
    with only medusa_num_heads / medusa_num_layers: `config_heads` under-reports the heads as
    one official upload does). Its ResBlocks are one module repeated, so with several layers
    a head's blocks hold equal tensors. layout "vllm": the converted format."""
    t = _target_config(target_dir)
    gen = torch.Generator().manual_seed(seed)
    h, vocab = t["hidden_size"], t["vocab_size"]
    rows = draft_vocab_size or vocab
    state = {}
    for head in range(num_heads):
        weight, b = _rand((h, h), gen), _rand((h,), gen)
        for layer in range(num_layers):
            if layout == "medusa":
                state[f"{prefix}{head}.{layer}.linear.weight"] = weight.clone()
                state[f"{prefix}{head}.{layer}.linear.bias"] = b.clone()
            else:
                state[f"blocks.{head}.layers.{layer}.weight"] = _rand((h, h), gen)
                if bias:
                    state[f"blocks.{head}.layers.{layer}.bias"] = _rand((h,), gen)
        if layout == "medusa":
            state[f"{prefix}{head}.{num_layers}.weight"] = _rand((vocab, h), gen, std=0.5)
        elif head == 0 or not shared_lm_head:
            state[f"lm_heads.{head}.weight"] = _rand((rows, h), gen, std=0.5)
    if layout == "medusa":
        config = {"medusa_num_heads": config_heads or num_heads, "medusa_num_layers": num_layers,
                  "base_model_name_or_path": str(target_dir), "transformers_version": "4.31.0"}
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        if fmt == "pt":
            torch.save(state, out / "medusa_lm_head.pt")
        else:
            from safetensors.torch import save_file

            save_file(state, out / "medusa_lm_head.safetensors")
        return state
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": h, "vocab_size": vocab,
              "num_heads": num_heads, "num_hidden_layers": num_layers, "medusa_fc_bias": bias,
              "original_lm_head": shared_lm_head}
    if draft_vocab_size:
        config["truncated_vocab_size"] = draft_vocab_size
        state["token_map"] = torch.randperm(vocab, generator=gen)[:draft_vocab_size].sort().values
    return save_checkpoint(out, config, state, fmt)


def write_mlp_speculator(out: Path, target_dir: Path, *, n_predict: int = 3, inner_dim: int = 0,
                         tie_weights: bool = False, scale_input: bool = True, prefix: str = "",
                         repeat_tied: bool = True, fmt: str = "safetensors", seed: int = 0) -> dict[str, torch.Tensor]:
    """IBM's format (fms-extras / ibm-fms accelerators). With tie_weights the file holds the
    shared tensors repeated under every stage (`repeat_tied`) or once."""
    t = _target_config(target_dir)
    gen = torch.Generator().manual_seed(seed)
    emb_dim, vocab = t["hidden_size"], t["vocab_size"]
    d = inner_dim or emb_dim

    def stage(i: int) -> dict[str, torch.Tensor]:
        return {f"emb.{i}.weight": _rand((vocab, d), gen, 0.5), f"head.{i}.weight": _rand((vocab, d), gen, 0.5),
                f"ln.{i}.weight": 1 + _rand((d,), gen, 0.1), f"ln.{i}.bias": _rand((d,), gen, 0.1),
                f"proj.{i}.weight": _rand((d, emb_dim if i == 0 else d), gen)}

    state = stage(0)
    for i in range(1, n_predict):
        if not tie_weights:
            state.update(stage(i))
            continue
        if i == 1:  # the one projection stages >= 1 share
            state["proj.1.weight"] = _rand((d, d), gen)
        if repeat_tied:
            state.update({f"{kind}.{i}.{p}": state[f"{kind}.0.{p}"].clone()
                          for kind, p in (("emb", "weight"), ("head", "weight"), ("ln", "weight"), ("ln", "bias"))})
            state[f"proj.{i}.weight"] = state["proj.1.weight"].clone()
    state = {prefix + k: v for k, v in state.items()}
    config = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
              "emb_dim": emb_dim, "inner_dim": inner_dim, "vocab_size": vocab, "n_predict": n_predict,
              "top_k_tokens_per_head": [4, 3, 2, 2, 2][:n_predict], "n_candidates": 5,
              "tie_weights": tie_weights, "scale_input": scale_input, "torch_dtype": "float16"}
    return save_checkpoint(out, config, state, fmt)


def _block_config(t: dict) -> dict:
    return {k: t[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                              "rms_norm_eps", "vocab_size", "max_position_embeddings", "hidden_act")} | \
        {"rope_theta": 10000.0, "tie_word_embeddings": False}


def write_mtp(out: Path, target_dir: Path, *, family: str = "deepseek", num_layers: int = 1,
              with_shared: bool = False, model_type: str | None = None, inside_target: bool = False,
              fmt: str = "safetensors", seed: int = 0) -> dict[str, torch.Tensor]:
    """MTP layers after the tiny target's layers. family "deepseek": DeepSeek-V3's keys under
    `model.layers.{L+j}.` (`with_shared`: the duplicated embed_tokens and shared_head.head
    too), as a standalone head with a deepseek_v3 config (`model_type` "step3p5" writes a
    Step-3.5-style multi-layer head: every layer its own shared_head.head). family "mimo":
    `model.mtp_layers.{j}.` with a Qwen2 block (q/k/v biases) and a MiMoForCausalLM config.
    `inside_target`: the target's own tensors are in the same file, as when the MTP layers
    ship with the model."""
    t = _target_config(target_dir)
    gen = torch.Generator().manual_seed(seed)
    h, vocab, L = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    state = {}
    for j in range(num_layers):
        if family == "deepseek":
            p = f"model.layers.{L + j}."
            parts = {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
                     "shared_head.norm.weight": (h,)}
            if with_shared or model_type == "step3p5":
                parts["shared_head.head.weight"] = (vocab, h)
            if with_shared and j == 0:
                parts["embed_tokens.weight"] = (vocab, h)
        else:
            p = f"model.mtp_layers.{j}."
            parts = {"token_layernorm.weight": (h,), "hidden_layernorm.weight": (h,),
                     "input_proj.weight": (h, 2 * h), "final_layernorm.weight": (h,)}
        for name, shape in parts.items():
            norm = len(shape) == 1
            std = 0.5 if shape[0] == vocab else 0.15
            state[p + name] = 1 + 0.1 * _rand(shape, gen) if norm else _rand(shape, gen, std)
        state.update(_layer(p, t, h, gen, ("input_layernorm",)))
        if family == "mimo":
            hd = h // t["num_attention_heads"]
            for proj, rows in (("q_proj", t["num_attention_heads"] * hd), ("k_proj", t["num_key_value_heads"] * hd),
                               ("v_proj", t["num_key_value_heads"] * hd)):
                state[f"{p}self_attn.{proj}.bias"] = _rand((rows,), gen)
    config = {**_block_config(t), "num_hidden_layers": L, "num_nextn_predict_layers": num_layers}
    if family == "mimo":
        config.update(architectures=["MiMoForCausalLM"], model_type="mimo")
    elif model_type == "step3p5":
        config.update(architectures=["Step3p5ForCausalLM"], model_type="step3p5")
    else:
        config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    written = dict(state)
    if inside_target:
        from safetensors.torch import load_file

        state.update(load_file(target_dir / "model.safetensors"))
    save_checkpoint(out, config, state, fmt)
    return written
