"""A block drafter's checkpoint (DFlash, and DSpark on top of it): what its config.json
decides (`BlockSpec`, checked against the target), reading, loading and writing it, and the
config.json of a new head. The layout is described in backends/methods/dflash.py's docstring."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from backends.config import aux_layer_ids
from backends.methods.head_checkpoint import Checkpoint, HeadCheckpointError, TargetInfo, load_checked, read_head_state
from backends.runtime.model_store import load_config

if TYPE_CHECKING:
    from backends.methods.dflash import DFlashHead

# vLLM's order for the mask token's id (qwen3_dspark.py, then V1 DFlash's pard_token / ptd_token_id);
# dflash_config first, then the top level.
_MASK_KEYS = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")
_LAYER_TYPES = ("full_attention", "sliding_attention")


class BlockCheckpointError(HeadCheckpointError):
    """A DFlash / DSpark checkpoint that does not fit its layout or the target."""


def config_field(cfg: dict[str, Any], *names: str) -> Any:
    """The first of `names` found in `dflash_config`, then at the top level."""
    nested = cfg.get("dflash_config") or {}
    for source in (nested, cfg):
        for name in names:
            if source.get(name) is not None:
                return source[name]
    return None


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The DFlash reference's choice when a checkpoint names none (0-based layer outputs)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 3 - 1
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class BlockSpec:
    """What a block drafter's config.json decides, checked against the target."""

    block_size: int
    mask_token_id: int
    hidden_layer_ids: tuple[int, ...]  # verifier numbering, checkpoint order
    target_hidden_size: int
    draft_vocab_size: int
    causal: list[bool]  # per draft layer
    windows: list[int | None]  # per draft layer: sliding window, None = full attention

    @classmethod
    def parse(cls, cfg: dict[str, Any], target: TargetInfo, where: str) -> BlockSpec:
        _refuse_unsupported(cfg, where)
        block, mask = _block_and_mask(cfg, target, where)
        layers, ids = _draft_layers(cfg, target, where)
        types, window = _layer_attention(cfg, layers, where)
        causal = bool(config_field(cfg, "causal") or cfg.get("is_causal"))
        target_hidden = cfg.get("target_hidden_size") or cfg.get("hidden_size")
        if target_hidden != target.hidden_size:
            raise BlockCheckpointError(
                f"{where}: target_hidden_size {target_hidden} (hidden_size when absent) "
                f"in config.json, but the target's hidden size is {target.hidden_size}"
            )
        return cls(
            block,
            mask,
            tuple(ids),
            target_hidden,
            cfg.get("draft_vocab_size") or target.vocab_size,
            [causal or t == "sliding_attention" for t in types],
            [window if t == "sliding_attention" else None for t in types],
        )


def _refuse_unsupported(cfg: dict[str, Any], where: str) -> None:
    """The variants this drafter does not implement, refused by field."""
    for name, bad, why in (
        ("dflash_config.use_swa", config_field(cfg, "use_swa"), "use layer_types + sliding_window instead"),
        ("dflash_config.attention_sink_bias", config_field(cfg, "attention_sink_bias"), "no attention sinks here"),
        ("is_neox_style", cfg.get("is_neox_style") is False, "only the neox RoPE layout is implemented"),
        (
            "dflash_config.use_aux_hidden_state",
            config_field(cfg, "use_aux_hidden_state") is False,
            "the drafter reads the target layers in target_layer_ids",
        ),
        (
            "dflash_config.projector_type",
            config_field(cfg, "projector_type") not in (None, "dspark"),
            "only the plain projector (and DSpark's) are implemented",
        ),
    ):
        if bad:
            raise BlockCheckpointError(
                f"{where}: {name}={config_field(cfg, name.rpartition('.')[2])!r} is not supported ({why})"
            )


def _block_and_mask(cfg: dict[str, Any], target: TargetInfo, where: str) -> tuple[int, int]:
    """The block size (>= 2) and the mask token's id (a row of the target's embedding)."""
    block = config_field(cfg, "block_size", "dspark_block_size")
    if not isinstance(block, int) or isinstance(block, bool) or block < 2:
        raise BlockCheckpointError(
            f"{where}: block_size={block!r} in config.json (top level or dflash_config); expected an integer >= 2"
        )
    mask = config_field(cfg, *_MASK_KEYS)
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < target.vocab_size:
        raise BlockCheckpointError(
            f"{where}: mask_token_id={mask!r} (dflash_config.mask_token_id) must be "
            f"a row of the target's embedding, in [0, {target.vocab_size})"
        )
    return block, mask


def _draft_layers(cfg: dict[str, Any], target: TargetInfo, where: str) -> tuple[int, list[int]]:
    """The draft's layer count and the target layers it reads (verifier numbering)."""
    layers = cfg.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise BlockCheckpointError(f"{where}: num_hidden_layers={layers!r} in config.json; expected an integer >= 1")
    num_target_layers = cfg.get("num_target_layers")
    if num_target_layers is not None and num_target_layers != target.num_layers:
        raise BlockCheckpointError(
            f"{where}: num_target_layers {num_target_layers} in config.json, but the "
            f"target has {target.num_layers} decoder layers"
        )
    ids = aux_layer_ids(cfg, {}) or [i + 1 for i in default_target_layer_ids(target.num_layers, layers)]
    if len(set(ids)) != len(ids) or not all(0 <= i <= target.num_layers for i in ids):
        raise BlockCheckpointError(
            f"{where}: target layer ids {[i - 1 for i in ids]} (dflash_config.target_layer_ids) must be "
            f"distinct layers of the target, in [-1, {target.num_layers - 1}]"
        )
    return layers, ids


def _layer_attention(cfg: dict[str, Any], layers: int, where: str) -> tuple[list[str], Any]:
    """Each draft layer's attention type, and the sliding window its sliding layers use."""
    types = cfg.get("layer_types") or ["full_attention"] * layers
    if len(types) != layers or not set(types) <= set(_LAYER_TYPES):
        raise BlockCheckpointError(
            f"{where}: layer_types {types} must give one of {_LAYER_TYPES} for each of the {layers} layers"
        )
    window = cfg.get("sliding_window")
    if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
        raise BlockCheckpointError(f"{where}: sliding_attention layers need a positive sliding_window, got {window!r}")
    return types, window


def read_block_config(
    path: Path | str | Checkpoint, overrides: dict[str, Any] | None = None
) -> tuple[Path, dict[str, Any]]:
    """The checkpoint directory and its config.json (speculators format flattened as vLLM does;
    a Checkpoint's as already read) with `hf_overrides` on top."""
    path, cfg = Checkpoint.open(path, BlockCheckpointError)
    return path, {**cfg, **(overrides or {})}


def detect_layout(cfg: dict[str, Any]) -> str | None:
    """ "dspark", "dflash", or None (not a block drafter) from config fields alone."""
    archs = cfg.get("architectures") or []
    if (
        "Qwen3DSparkModel" in archs
        or config_field(cfg, "projector_type") == "dspark"
        or config_field(cfg, "markov_rank")
    ):
        return "dspark"
    if "dflash_config" in cfg or any(a.startswith("DFlash") for a in archs):
        return "dflash"
    return None


def load_head(
    head_class: type[DFlashHead],
    path: Path | str | Checkpoint,
    target: TargetInfo,
    dtype: str = "bfloat16",
    overrides: dict[str, Any] | None = None,
) -> DFlashHead:
    """Load a checkpoint directory of `head_class`'s layout for `target` (a Checkpoint comes
    with its config.json already read), refusing a checkpoint of another layout, or whose keys,
    shapes or vocabulary do not fit, by name."""
    path, cfg = read_block_config(path, overrides)
    layout = detect_layout(cfg)
    names = {"dflash": "DFlash", "dspark": "DSpark"}
    where = f"{names[head_class.layout]} checkpoint {path}"
    bundled = [k for k in ("dspark_block_size", "dspark_target_layer_ids", "dspark_markov_rank") if k in cfg]
    if bundled:
        raise BlockCheckpointError(
            f"{where}: config.json has {', '.join(bundled)}: a DeepSeek-V4 drafter bundled "
            "in the target checkpoint (mtp.* weights), which is not supported here"
        )
    if layout != head_class.layout:
        found = (
            f"config.json describes a {names[layout]} drafter"
            if layout
            else ("config.json has neither dflash_config nor a DFlash/DSpark architecture")
        )
        raise BlockCheckpointError(
            f"{where}: method {head_class.layout!r} needs a {names[head_class.layout]} checkpoint, but {found}"
        )
    if cfg.get("vocab_size") != target.vocab_size:
        raise BlockCheckpointError(
            f"{where}: vocab_size {cfg.get('vocab_size')} in config.json, but the target's "
            f"vocabulary has {target.vocab_size} ids"
        )
    head = head_class(cfg, target, where)
    state, spelled = read_head_state(path, BlockCheckpointError)
    borrowed = head.borrows if head.config["hidden_size"] == target.hidden_size else ()
    load_checked(head, state, spelled, target, where, BlockCheckpointError, borrowed, head.defaults())
    mask_file = path / "mask_embedding.pt"
    if mask_file.exists():
        row = torch.load(mask_file, map_location="cpu", weights_only=True).reshape(-1)
        if row.numel() != head.embed_tokens.embedding_dim:
            raise BlockCheckpointError(
                f"{where}: mask_embedding.pt has {row.numel()} values, expected "
                f"{head.embed_tokens.embedding_dim} (the hidden size)"
            )
        with torch.no_grad():
            head.embed_tokens.weight[head.spec.mask_token_id] = row
    return head.to(getattr(torch, dtype)).eval()


def save_head(head: DFlashHead, out: Path | str, dtype: str = "bfloat16") -> Path:
    """Write `head` in its published layout: config.json + model.safetensors with the
    checkpoint's keys (without what the loader borrows from the target)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(head.config, indent=2))
    state = {k: v.detach().to("cpu") for k, v in head.state_dict().items() if k not in head.omitted_on_save}
    state = {k: (v.to(getattr(torch, dtype)) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    save_file(state, out / "model.safetensors")
    return out


def default_config(
    target: TargetInfo,
    *,
    mask_token_id: int,
    block_size: int = 8,
    num_hidden_layers: int = 1,
    target_layer_ids: list[int] | None = None,
) -> dict[str, Any]:
    """A DFlash config.json for a new head on `target` (z-lab's field names), its layers
    shaped like the target's."""
    t = load_config(target.path).get_text_config()
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    ids = target_layer_ids or default_target_layer_ids(target.num_layers, num_hidden_layers)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "num_target_layers": target.num_layers,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(ids)},
        "hidden_size": target.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": head_dim,
        "vocab_size": target.vocab_size,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": _rope_theta(t),
        "hidden_act": "silu",
        "max_position_embeddings": t.max_position_embeddings,
        "attention_bias": False,
        "layer_types": ["full_attention"] * num_hidden_layers,
        "tie_word_embeddings": False,
    }


def _rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)
