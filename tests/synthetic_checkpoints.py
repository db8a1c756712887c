"""Tiny random EAGLE checkpoints in the published layouts (same config.json fields, same
state-dict key names and shapes as yuhuili/EAGLE-*, yuhuili/EAGLE3-* and speculators-format
eagle3 checkpoints; see /work/shared/reference/checkpoint_formats.md §2, §3, §12), sized for
a tiny target. Keys are spelled out here, independently of the loader under test."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


def _target_config(target_dir: Path) -> dict:
    return json.loads((target_dir / "config.json").read_text())


def _llama_fields(t: dict) -> dict:
    """The Llama config of a one-layer head as the official repos write it."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": t["hidden_size"], "intermediate_size": t["intermediate_size"],
        "num_attention_heads": t["num_attention_heads"], "num_key_value_heads": t["num_key_value_heads"],
        "num_hidden_layers": 1, "vocab_size": t["vocab_size"], "rms_norm_eps": t["rms_norm_eps"],
        "rope_theta": 10000.0, "max_position_embeddings": 2048, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float16",
    }


def _layer(prefix: str, t: dict, attn_in: int, gen: torch.Generator, norms: tuple[str, ...]) -> dict:
    h, i = t["hidden_size"], t["intermediate_size"]
    hd = h // t["num_attention_heads"]
    q, kv = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
    shapes = {"self_attn.q_proj.weight": (q, attn_in), "self_attn.k_proj.weight": (kv, attn_in),
              "self_attn.v_proj.weight": (kv, attn_in), "self_attn.o_proj.weight": (h, q),
              "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    out = {f"{prefix}{k}": _rand(shape, gen) for k, shape in shapes.items()}
    for norm in ("post_attention_layernorm", *norms):
        out[f"{prefix}{norm}.weight"] = 1 + 0.1 * _rand((h,), gen)
    return out


def _rand(shape: tuple[int, ...], gen: torch.Generator, std: float = 0.15) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * std


def save_checkpoint(out: Path, config: dict, state: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors")
    else:
        torch.save(state, out / "pytorch_model.bin")
    return state


def assert_refused(case: tuple, checkpoints: dict, out: Path, error: type[Exception],
                   load: Callable[[Path], object]) -> None:
    """A REFUSALS case (checkpoint name, state edit or None, config.json edit or None, message):
    that checkpoint, edited so and written to `out`, makes load(out) raise `error` with the
    message."""
    name, edit_state, edit_config, message = case
    path, written = checkpoints[name]
    config = {**json.loads((path / "config.json").read_text()), **(edit_config or {})}
    save_checkpoint(out, config, (edit_state or dict)(dict(written)), "safetensors")
    with pytest.raises(error, match=message):
        load(out)


def write_eagle1(out: Path, target_dir: Path, *, bias: bool = True, fmt: str = "bin",
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """EAGLE-1/2 (yuhuili/EAGLE-llama2-chat-7B style): fc over [embedding, feature], one
    layer without input_layernorm, no embedding, no norm, no lm_head. `"bias": false` as the
    LLaMA-3 configs write it; absent means fc has a bias."""
    t = _target_config(target_dir)
    gen = torch.Generator().manual_seed(seed)
    h = t["hidden_size"]
    config = _llama_fields(t)
    if not bias:
        config["bias"] = False
    state = {"fc.weight": _rand((h, 2 * h), gen)}
    if bias:
        state["fc.bias"] = _rand((h,), gen)
    state.update(_layer("layers.0.", t, h, gen, ()))
    return save_checkpoint(out, config, state, fmt)


def write_eagle3(out: Path, target_dir: Path, *, draft_vocab_size: int = 200, spelling: str = "midlayer.",
                 fmt: str = "safetensors", speculators: bool = False, with_embedding: bool = False,
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """EAGLE-3 (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B style, or the speculators format with
    `layers.0.` keys and its nested transformer_layer_config): fc over three target layers,
    one layer with 2H-wide q/k/v, its own norm and lm_head over a draft vocabulary mapped to
    the target's by d2t offsets (non-trivial: a random sorted subset of target ids)."""
    t = _target_config(target_dir)
    gen = torch.Generator().manual_seed(seed)
    h, vocab = t["hidden_size"], t["vocab_size"]
    targets = torch.randperm(vocab, generator=gen)[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    state = {"fc.weight": _rand((h, 3 * h), gen),
             **_layer(spelling, t, 2 * h, gen, ("input_layernorm", "hidden_norm")),
             "norm.weight": 1 + 0.1 * _rand((h,), gen),
             "lm_head.weight": _rand((draft_vocab_size, h), gen, std=0.5),
             "d2t": targets - torch.arange(draft_vocab_size), "t2d": t2d}
    if with_embedding:
        state["embed_tokens.weight"] = _rand((vocab, h), gen, std=0.5)
    llama = {**_llama_fields(t), "architectures": ["LlamaForCausalLMEagle3"]}
    if not speculators:
        return save_checkpoint(out, {**llama, "draft_vocab_size": draft_vocab_size}, state, fmt)
    config = {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": {**llama, "architectures": ["LlamaForCausalLM"]},
        "draft_vocab_size": draft_vocab_size, "norm_before_residual": True, "target_hidden_size": h,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": str(target_dir), "architectures": ["LlamaForCausalLM"]},
        },
    }
    return save_checkpoint(out, config, state, fmt)
