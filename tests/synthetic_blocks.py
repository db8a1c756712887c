"""Tiny random DFlash and DSpark checkpoints in the published layouts (same config.json
fields, same state-dict keys and shapes as z-lab/*-DFlash-*, DeepSpec's `save_pretrained`
of Qwen3DSparkModel, and the speculators-format dspark export; see
/work/shared/reference/checkpoint_formats.md §7, §8, §12), sized for a tiny target. Keys
are spelled out here, independently of the loader under test."""
from __future__ import annotations

import torch

from tests.synthetic_checkpoints import _rand, _target_config, save_checkpoint


def _qwen3_fields(t: dict, num_layers: int) -> dict:
    """The Qwen3 dimensions block drafters publish (head_dim explicit, no attention bias)."""
    return {
        "model_type": "qwen3", "hidden_size": t["hidden_size"], "intermediate_size": t["intermediate_size"],
        "num_hidden_layers": num_layers, "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t["num_key_value_heads"], "head_dim": t["hidden_size"] // t["num_attention_heads"],
        "vocab_size": t["vocab_size"], "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
        "max_position_embeddings": 2048, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def _qwen3_layer(prefix: str, t: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, i = t["hidden_size"], t["intermediate_size"]
    hd = h // t["num_attention_heads"]
    q, kv = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
    shapes = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
              "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
              "mlp.down_proj.weight": (h, i)}
    out = {f"{prefix}{k}": _rand(shape, gen) for k, shape in shapes.items()}
    for norm, size in (("self_attn.q_norm", hd), ("self_attn.k_norm", hd), ("input_layernorm", h),
                       ("post_attention_layernorm", h)):
        out[f"{prefix}{norm}.weight"] = 1 + 0.1 * _rand((size,), gen)
    return out


def _backbone(t: dict, num_layers: int, num_sel: int, gen: torch.Generator, first_layer: str) -> dict:
    h = t["hidden_size"]
    state = {"fc.weight": _rand((h, num_sel * h), gen), "hidden_norm.weight": 1 + 0.1 * _rand((h,), gen),
             "norm.weight": 1 + 0.1 * _rand((h,), gen)}
    for i in range(num_layers):
        state.update(_qwen3_layer(first_layer if i == 0 else f"layers.{i}.", t, gen))
    return state


def write_dflash(out, target_dir, *, block_size: int = 4, num_layers: int = 2, target_layer_ids=(0, 1),
                 mask_token_id: int = 383, first_layer: str = "layers.0.", causal: bool = False,
                 sliding_window: int | None = None, draft_vocab_size: int | None = None, fmt: str = "safetensors",
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """z-lab DFlash (Qwen3-8B-DFlash-b16 style): block_size at the top level,
    dflash_config.{mask_token_id, target_layer_ids}, no embedding / lm_head. Options: the
    causal flag, sliding layers (all but the first), a draft vocabulary (own lm_head + d2t),
    the `midlayer.` spelling some exports use; target_layer_ids=None leaves them out."""
    t = _target_config(target_dir)
    gen = torch.Generator().manual_seed(seed)
    dflash_config = {"mask_token_id": mask_token_id}
    if target_layer_ids is not None:
        dflash_config["target_layer_ids"] = list(target_layer_ids)
    if causal:
        dflash_config["causal"] = True
    config = {**_qwen3_fields(t, num_layers), "architectures": ["DFlashDraftModel"],
              "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": block_size,
              "num_target_layers": t["num_hidden_layers"], "dflash_config": dflash_config,
              "layer_types": ["full_attention"] * num_layers}
    if sliding_window:
        config.update(sliding_window=sliding_window,
                      layer_types=["full_attention"] + ["sliding_attention"] * (num_layers - 1))
    num_sel = len(target_layer_ids) if target_layer_ids is not None else num_layers
    state = _backbone(t, num_layers, num_sel, gen, first_layer)
    if draft_vocab_size:
        vocab = t["vocab_size"]
        targets = torch.randperm(vocab, generator=gen)[:draft_vocab_size].sort().values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[targets] = True
        config["draft_vocab_size"] = draft_vocab_size
        state.update({"lm_head.weight": _rand((draft_vocab_size, t["hidden_size"]), gen, std=0.5),
                      "d2t": targets - torch.arange(draft_vocab_size), "t2d": t2d})
    return save_checkpoint(out, config, state, fmt)


def _markov(prefix: str, kind: str, rank: int, vocab: int, h: int, gen: torch.Generator) -> dict:
    state = {f"{prefix}markov_w1.weight": _rand((vocab, rank), gen, std=0.5),
             f"{prefix}markov_w2.weight": _rand((vocab, rank), gen, std=0.5)}
    if kind == "gated":
        state.update({f"{prefix}gate_proj.weight": _rand((rank, h + rank), gen, std=0.5),
                      f"{prefix}gate_proj.bias": _rand((rank,), gen)})
    elif kind == "rnn":
        state.update({f"{prefix}joint_proj.weight": _rand((3 * rank, 2 * rank + h), gen, std=0.5),
                      f"{prefix}joint_proj.bias": _rand((3 * rank,), gen)})
    return state


def write_dspark(out, target_dir, *, style: str = "deepspec", block_size: int = 4, num_layers: int = 2,
                 target_layer_ids=(0, 1), mask_token_id: int = 383, markov_head_type: str = "vanilla",
                 markov_rank: int = 8, confidence: bool = True, confidence_with_markov: bool = True,
                 sample_from_anchor: bool | None = None, fmt: str = "safetensors",
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """DSpark checkpoints:
    - "deepspec": DeepSpec's Qwen3DSparkModel (dspark_qwen3_4b_block7 style), fields at the
      top level, frozen copies of the target's embedding and LM head, markov_head.* and
      confidence_head.*; anchor slot convention.
    - "speculators": speculators_model_type "dspark" with transformer_layer_config and
      aux_hidden_state_layer_ids (EAGLE-3 numbering); fill-in slot convention.
    - "hybrid": architectures DFlashDraftModel with dflash_config.projector_type "dspark" and
      the Markov fields inside dflash_config (speculators-trained); it does not say its slot
      convention unless `sample_from_anchor` is given."""
    from safetensors.torch import load_file

    t = _target_config(target_dir)
    gen = torch.Generator().manual_seed(seed)
    h, vocab = t["hidden_size"], t["vocab_size"]
    target = load_file(target_dir / "model.safetensors")
    state = _backbone(t, num_layers, len(target_layer_ids), gen, "layers.0.")
    state.update({"embed_tokens.weight": target["model.embed_tokens.weight"].clone(),
                  "lm_head.weight": target["lm_head.weight"].clone()})
    if markov_rank:
        state.update(_markov("markov_head.", markov_head_type, markov_rank, vocab, h, gen))
    if confidence:
        width = h + (markov_rank if confidence_with_markov else 0)
        state.update({"confidence_head.proj.weight": _rand((1, width), gen), "confidence_head.proj.bias": _rand((1,), gen)})
    markov = {"markov_rank": markov_rank, "markov_head_type": markov_head_type, "enable_confidence_head": confidence,
              "confidence_head_with_markov": confidence_with_markov}
    base = {**_qwen3_fields(t, num_layers), "layer_types": ["full_attention"] * num_layers}
    if style == "deepspec":
        config = {**base, "architectures": ["Qwen3DSparkModel"], "block_size": block_size,
                  "mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids),
                  "num_target_layers": t["num_hidden_layers"], "num_anchors": 512, **markov}
    elif style == "speculators":
        config = {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
                  "transformer_layer_config": {**base, "architectures": ["Qwen3ForCausalLM"]},
                  "block_size": block_size, "mask_token_id": mask_token_id,
                  "aux_hidden_state_layer_ids": [i + 1 for i in target_layer_ids], **markov,
                  "speculators_config": {
                      "algorithm": "dspark", "default_proposal_method": "greedy",
                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block_size - 1}],
                      "verifier": {"name_or_path": str(target_dir), "architectures": ["LlamaForCausalLM"]}}}
    else:
        dflash_config = {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids),
                         "projector_type": "dspark", "use_confidence_head": confidence, "shift_label": True,
                         **{k: v for k, v in markov.items() if k != "enable_confidence_head"}}
        if sample_from_anchor is not None:
            dflash_config["sample_from_anchor"] = sample_from_anchor
        config = {**base, "architectures": ["DFlashDraftModel"], "block_size": block_size,
                  "num_target_layers": t["num_hidden_layers"], "dflash_config": dflash_config}
    if sample_from_anchor is not None and style != "hybrid":
        config["sample_from_anchor"] = sample_from_anchor
    return save_checkpoint(out, config, state, fmt)
