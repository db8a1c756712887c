"""DFlash: block-parallel drafting (z-lab, arXiv 2602.06036). The building block of `dspark`.

A DFlash drafter is a small stack of Qwen3-style decoder layers that fills a whole block of
mask tokens in one forward pass. Its queries are the block only; its keys and values are
the block plus a *context* made from the target's hidden states (z-lab's dflash/model.py,
https://github.com/z-lab/dflash; vLLM's https://github.com/vllm-project/vllm/blob/c314af1abfddff7b6cce9af578be72c496c6a5e4/vllm/model_executor/models/qwen3_dflash.py):

    ctx_t  = hidden_norm(fc(concat(target hidden states at position t, layer by layer)))
    block  = [anchor, MASK, ..., MASK]  (block_size tokens at positions p .. p+B-1)
    every layer: q from input_layernorm(block); K/V = k_norm(k_proj(ctx)) ++ k_norm(k_proj(
                 input_layernorm(block))) (no input_layernorm on ctx), RoPE at the absolute
                 positions; the block attends to all the context and all of itself
                 (non-causal; causal only where the config says so or on sliding layers)
    logits = lm_head(norm(block output)); slot j (1..B-1) is the draft for position p+j,
             the anchor slot's output is dropped.

Positions. The sequence is x_0 .. x_{n-1}; the target has run x_0 .. x_{n-2} (x_{n-1} is the
token it just emitted: the anchor, at p = n-1). The context covers positions 0 .. n-2, one
entry per target hidden state, so drafting needs no token shift: context entry t is built
from the target's states at position t. Hidden states arrive exactly as the EAGLE drafters
get them (the delivery contract in backends/methods/eagle.py's docstring): rows for the positions
the drafter has not been given yet, ending at n-2.

Layer numbering (Hugging Face's `output_hidden_states`). `dflash_config.target_layer_ids` count decoder layers from 0 and
name each layer's *output*: id i is Hugging Face's hidden_states[i+1], which the verifier
calls layer id i+1 (the residual stream entering layer i+1). The head's `hidden_layer_ids`
are those verifier ids, in the checkpoint's order (fc was trained on that concatenation).
`eagle_aux_hidden_state_layer_ids` in a config is already in verifier numbering. Without
any ids the DFlash reference's default applies (evenly spaced over 1 .. L-3, L//2 for a
one-layer drafter); vLLM falls back to EAGLE-3's (2, L//2, L-3) there, which cannot match fc.

Checkpoint (z-lab's format): config.json with `block_size` (top level or in `dflash_config`),
`dflash_config.{mask_token_id, target_layer_ids}`, Qwen3 dimensions; state dict `fc.weight`
[H, n·H_t], `hidden_norm`, `layers.{i}.*` (Qwen3 layers with q_norm/k_norm; `midlayer.` is
read as `layers.0.`), `norm`. No embedding or LM head: both are the target's. With
`draft_vocab_size` < V the checkpoint has its own `lm_head` [V_d, H] and `d2t` offsets. An
optional `mask_embedding.pt` replaces the mask token's embedding row. The layout is decided
from config.json, never from the directory name; unsupported variants are refused by field.

Drafts per pass: B-1. The drafter always runs its trained block size and returns the first
k drafts asked for (a shorter block would change every slot's output: the slots attend to
each other), so k above B-1 gives B-1. The drafter keeps, per sequence, only the context's
keys and values of every layer, in the lean runtime's paged KV pool (the block's own are
written after them for the block's forward and dropped again); the context never holds
anything speculative, so rollback is a truncation to where the new hidden states start.

Greedy drafts come without probabilities (one-hot); `probabilistic` drafts are sampled from
each slot's softmax at the request's temperature (a greedy request: the argmax) and come
with them, mapped to the target vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from backends.config import aux_layer_ids
from backends.methods.drafts import DRAFT_KV_MEMORY_GB, GROW_SLACK_TOKENS
from backends.methods.head_checkpoint import Checkpoint, HeadCheckpointError, TargetInfo, load_checked, read_head_state
from backends.methods.head_proposer import HeadProposer
from backends.runtime.lean_lm import LeanDecoder, Row
from backends.runtime.model_store import load_config
from backends.serving.proposer import Draft, DraftRequest

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


# ---------------------------------------------------------------------------- the head


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
        layers = cfg.get("num_hidden_layers")
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise BlockCheckpointError(
                f"{where}: num_hidden_layers={layers!r} in config.json; expected an integer >= 1"
            )
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
        types = cfg.get("layer_types") or ["full_attention"] * layers
        if len(types) != layers or not set(types) <= set(_LAYER_TYPES):
            raise BlockCheckpointError(
                f"{where}: layer_types {types} must give one of {_LAYER_TYPES} for each of the {layers} layers"
            )
        window = cfg.get("sliding_window")
        if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
            raise BlockCheckpointError(
                f"{where}: sliding_attention layers need a positive sliding_window, got {window!r}"
            )
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


def _qwen3_config(cfg: dict[str, Any]) -> Qwen3Config:
    qwen = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "auto_map")})
    qwen._attn_implementation = "sdpa"
    return qwen


class _BlockAttention(nn.Module):
    """Qwen3 attention whose queries are the block and whose keys/values are given."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = bool(cfg.attention_bias)
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm, then RoPE) and values of `x` [B, T, H]: each [B, kv_heads, T, head_dim]."""
        shape = (*x.shape[:2], self.kv_heads, self.head_dim)
        keys = _rotate(self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2), rope)
        return keys, self.v_proj(x).view(shape).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, rope: tuple, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        b, s = x.shape[:2]
        q = _rotate(self.q_norm(self.q_proj(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2), rope)
        groups = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(
            q,
            keys.repeat_interleave(groups, 1),
            values.repeat_interleave(groups, 1),
            attn_mask=mask,
            scale=self.head_dim**-0.5,
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


def _rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = (t.unsqueeze(1) for t in rope)  # over the heads
    return x * cos + rotate_half(x) * sin


class _BlockLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = _BlockAttention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple, context: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
    ) -> torch.Tensor:
        normed = self.input_layernorm(x)
        keys, values = self.self_attn.kv(normed, rope)
        keys, values = torch.cat([context[0], keys], dim=2), torch.cat([context[1], values], dim=2)
        x = x + self.self_attn(normed, rope, keys, values, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(nn.Module):
    """A block drafter built from its config.json dict and the target; also what a trainer
    trains and `save_head` writes back in the published layout.

    `context` + `context_kv` turn target hidden states into each layer's context keys and
    values; `forward` runs blocks over given context K/V (`key_valid` masks keys per row, so
    a trainer can run many anchors of one sequence as rows sharing one context); `logits`
    gives draft-vocabulary logits of forward's (normed) output."""

    layout = "dflash"
    # Taken from the target when a checkpoint lacks them, and not written by save_head:
    # published DFlash checkpoints carry no embedding or LM head.
    borrows = ("embed_tokens.weight", "lm_head.weight")
    omitted_on_save = borrows

    def __init__(self, cfg: dict[str, Any], target: TargetInfo, where: str = "DFlash head") -> None:
        super().__init__()
        if self.layout == "dflash" and config_field(cfg, "sample_from_anchor"):
            raise BlockCheckpointError(
                f"{where}: sample_from_anchor=true is DSpark's slot convention; a DFlash "
                "drafter fills slots 1..B-1 (vLLM refuses it too)"
            )
        self.spec = BlockSpec.parse(cfg, target, where)
        self.config = dict(cfg)  # written back as config.json by save_head
        qwen = _qwen3_config(cfg)
        h = qwen.hidden_size
        self.fc = nn.Linear(len(self.spec.hidden_layer_ids) * self.spec.target_hidden_size, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=qwen.rms_norm_eps)
        self.layers = nn.ModuleList(_BlockLayer(qwen) for _ in range(qwen.num_hidden_layers))
        self.norm = Qwen3RMSNorm(h, eps=qwen.rms_norm_eps)
        self.embed_tokens = nn.Embedding(target.vocab_size, h)
        self.target_vocab_size = target.vocab_size
        self.lm_head = nn.Linear(h, self.spec.draft_vocab_size, bias=False)
        self.rotary_emb = Qwen3RotaryEmbedding(qwen)
        # [V_d] the target id of each draft id; None: one vocabulary.
        self.register_buffer("draft_to_target", None, persistent=False)
        if self.spec.draft_vocab_size != target.vocab_size:
            self.register_buffer("d2t", torch.zeros(self.spec.draft_vocab_size, dtype=torch.long))
            self.borrows = ("embed_tokens.weight",)  # the LM head is the checkpoint's own
            self.omitted_on_save = tuple(k for k in self.omitted_on_save if k != "lm_head.weight")

    @property
    def hidden_layer_ids(self) -> tuple[int, ...]:
        return self.spec.hidden_layer_ids

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def draft_slots(self) -> range:
        """Block slots whose outputs are drafts, in order: 1..B-1 (the anchor's is dropped)."""
        return range(1, self.spec.block_size)

    def context(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[..., len(hidden_layer_ids), H_t] target states -> [..., H] context entries."""
        return self.hidden_norm(self.fc(hidden_states.flatten(-2)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's context keys and values for `ctx` [B, T, H] at `positions` [B, T]."""
        rope = self.rotary_emb(ctx, positions)
        return [layer.self_attn.kv(ctx, rope) for layer in self.layers]

    def forward(
        self,
        block_ids: torch.Tensor,
        positions: torch.Tensor,
        context: list[tuple[torch.Tensor, torch.Tensor]],
        key_positions: torch.Tensor,
        key_valid: torch.Tensor,
    ) -> torch.Tensor:
        """Normed block outputs [B, S, H] for `block_ids` [B, S] at `positions` [B, S], over the
        per-layer `context` K/V [B, kv_heads, C, head_dim]; `key_positions` and `key_valid`
        [B, C + S] describe every key (context, then block)."""
        x = self.embed_tokens(block_ids)
        rope = self.rotary_emb(x, positions)
        distance = positions[:, :, None] - key_positions[:, None, :]  # query - key, [B, S, C+S]
        for layer, kv, causal, window in zip(self.layers, context, self.spec.causal, self.spec.windows):
            visible = key_valid[:, None, :].expand_as(distance)
            if causal:
                visible = visible & (distance >= 0)
            if window is not None:
                visible = visible & (distance < window)
            x = layer(x, rope, kv, visible[:, None])
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def defaults(self) -> dict[str, torch.Tensor]:
        """Tensors a checkpoint may leave out, with the value they then take."""
        return {}

    @torch.no_grad()
    def take_target_weights(self, target: TargetInfo) -> None:
        """Copy the target's embedding (and LM head, over one vocabulary) into a new head."""
        for key in self.borrows:
            param = self.get_parameter(key)
            param.copy_(target.weight("embed" if key.startswith("embed") else "lm_head").to(param.dtype))


# ---------------------------------------------------------------------------- loading, saving


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


def load_dflash(
    path: Path | str, target: TargetInfo, dtype: str = "bfloat16", overrides: dict[str, Any] | None = None
) -> DFlashHead:
    return load_head(DFlashHead, path, target, dtype, overrides)


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


# ---------------------------------------------------------------------------- the proposer


def block_mask(context: int, size: int, causal: bool, window: int | None) -> torch.Tensor:
    """What a block of `size` slots after `context` entries sees, [size, context + size]: the
    context and the whole block, only up to itself where causal, and only keys less than
    `window` positions back on a sliding layer."""
    query = torch.arange(context, context + size)[:, None]
    key = torch.arange(context + size)[None]
    visible = torch.ones(size, context + size, dtype=torch.bool)
    if causal:
        visible &= key <= query
    if window is not None:
        visible &= query - key < window
    return visible


@dataclass
class BlockWork:
    index: int
    seq_id: int
    context: torch.Tensor  # [rows, H] the context entries this call adds (positions start .. n-2)
    anchor: int  # x_{n-1}
    position: int  # n - 1: the anchor's position, the context's length once they are in
    num_drafts: int
    temperature: float
    generator: torch.Generator | None  # the request's (SequenceProposer.generator_for)
    drafts: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # [num_drafts, V]


class DFlashProposer(HeadProposer):
    """The head's layers run on the lean runtime (backends/runtime): each sequence's context
    entries are its keys and values in one paged KV pool. A propose call is two ragged steps
    over the batch: the new context entries' keys and values into the pool, then every
    sequence's block over its context, whose entries are dropped again."""

    method = "dflash"
    head_class: type[DFlashHead] = DFlashHead
    _seqs: dict[int, None]  # the sequences with a context in the pool

    def __init__(
        self, head: DFlashHead, max_model_len: int, sample_method: str = "greedy", seed: int | None = None
    ) -> None:
        super().__init__(head, max_model_len, sample_method, seed)
        # The runtime's layers see all keys of a row as the step's masks say (see _block_steps):
        # its config keeps the head's dimensions and RoPE, not its sliding windows.
        config = _qwen3_config({**head.config, "layer_types": None, "use_sliding_window": False})
        self.decoder = LeanDecoder.from_layers(config, list(head.layers), self.dtype, input_norm=True)
        self.pool = self.decoder.new_pool(memory_gb=DRAFT_KV_MEMORY_GB)

    @classmethod
    def load_head(cls, config: Any, target: TargetInfo, dtype: str) -> DFlashHead:
        return load_head(cls.head_class, cls.checkpoint(config), target, dtype, cls._overrides(config))

    @classmethod
    def layers_for(cls, config: Any, target_model: Any = None) -> tuple[int, ...]:
        path, cfg = read_block_config(cls.checkpoint(config), cls._overrides(config))
        return BlockSpec.parse(cfg, TargetInfo.load(target_model), f"{cls.method} checkpoint {path}").hidden_layer_ids

    @staticmethod
    def _overrides(config: Any) -> dict[str, Any]:
        overrides = dict(config.hf_overrides or {})
        # Layer ids the user gave (top level or hf_overrides) win, as in vLLM; the resolved
        # config.eagle_aux_hidden_state_layer_ids would also carry vLLM's EAGLE-3 fallback.
        ids = (config.draft_hf_config or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids:
            overrides["eagle_aux_hidden_state_layer_ids"] = ids
        return overrides

    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest]) -> list[Draft]:
        drafts = [Draft() for _ in batch]
        work = [w for i, req in enumerate(batch) if (w := self._prepare(i, req)) is not None]
        if work:
            self._store_context(work)
            self._draft(self._run_block(work), work)
        for w in work:
            drafts[w.index] = Draft(w.drafts, w.probs)
        return drafts

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self.pool.release(seq_id)

    def _prepare(self, index: int, req: DraftRequest) -> BlockWork | None:
        """Crop the sequence's context back to where the delivered hidden states start and
        make room for them and the block; the work."""
        n, hidden = len(req.token_ids), req.hidden_states
        num_drafts = min(req.num_draft_tokens, len(self.head.draft_slots), self.max_model_len - n)
        if hidden is None or num_drafts <= 0:
            return None  # the target has not run yet (first step), or no room
        layers, width = len(self.hidden_layer_ids), self.head.spec.target_hidden_size
        if hidden.dim() != 3 or tuple(hidden.shape[1:]) != (layers, width) or not 0 < hidden.shape[0] < n:
            raise ValueError(
                f"sequence {req.seq_id}: hidden_states has shape {list(hidden.shape)}; expected [rows, {layers}, "
                f"{width}] (layers {self.hidden_layer_ids}) with 1 <= rows <= {n - 1} (one per target position)"
            )
        start, need = n - 1 - hidden.shape[0], n - 1 + self.head.block_size
        if req.seq_id not in self._seqs:
            self.pool.admit(req.seq_id, need + GROW_SLACK_TOKENS)
            self._seqs[req.seq_id] = None
        valid = min(self.pool.length(req.seq_id), req.num_kept)
        if valid < start:
            raise ValueError(
                f"sequence {req.seq_id}: hidden states start at position {start}, but the drafter has target "
                f"states up to position {valid - 1} only; deliver every position the target processed since "
                "the last draft call"
            )
        self.pool.truncate(req.seq_id, start)
        if self.pool.reserved(req.seq_id) < need:
            self.pool.grow(req.seq_id, need + GROW_SLACK_TOKENS)
        context = self.head.context(hidden.to(self.device, self.dtype))
        return BlockWork(
            index, req.seq_id, context, req.token_ids[-1], n - 1, num_drafts, req.temperature, self.generator_for(req)
        )

    def _store_context(self, work: list[BlockWork]) -> None:
        """Every layer's keys and values of the new context entries, after each sequence's kept ones."""
        rows = [Row(w.seq_id, torch.zeros(len(w.context), dtype=torch.long)) for w in work]
        step = self.decoder.plan(self.pool, rows)
        order = sorted(range(len(work)), key=lambda i: step.spans[i][0])  # the step's token order
        context = torch.cat([work[i].context for i in order])
        for index in range(self.decoder.num_layers):
            self.decoder.store_kv(index, context, self.pool, step)

    def _run_block(self, work: list[BlockWork]) -> torch.Tensor:
        """One forward of every sequence's block over its context; the normed block outputs
        [batch, B, H]. The block's own keys and values leave the pool afterwards."""
        mask_ids = [self.head.spec.mask_token_id] * (self.head.block_size - 1)
        steps = self._block_steps([Row(w.seq_id, [w.anchor, *mask_ids]) for w in work], [w.position for w in work])
        x = self.head.embed_tokens(steps[0].ids.to(self.device))
        for index, step in enumerate(steps):
            x = self.decoder.layer(index, x, self.pool, step)
        for w in work:
            self.pool.truncate(w.seq_id, w.position)
        x = self.head.norm(x)
        return torch.stack([x[a:b] for a, b in steps[0].spans])

    def _block_steps(self, rows: list[Row], contexts: list[int]) -> list[Any]:
        """The block step, planned once, for each layer: attending as that layer's kind (causal,
        window) sees. contexts[i]: row i's context length."""
        kinds = list(zip(self.head.spec.causal, self.head.spec.windows))

        def masked(kind: tuple[bool, int | None]) -> list[Row]:
            return [replace(row, mask=block_mask(c, self.head.block_size, *kind)) for row, c in zip(rows, contexts)]

        first = self.decoder.plan(self.pool, masked(kinds[0]))
        steps = {kinds[0]: first}
        for kind in kinds[1:]:
            if kind not in steps:
                steps[kind] = self.decoder.remask(self.pool, first, masked(kind))
        return [steps[kind] for kind in kinds]

    def _draft(self, hidden: torch.Tensor, work: list[BlockWork]) -> None:
        """DFlash: every slot's draft at once, from the slot's own logits (only the slots a
        sequence of the batch asks for: the LM head is most of a pass's cost)."""
        slots = list(self.head.draft_slots)[: max(w.num_drafts for w in work)]
        tokens, probs = self._sample(self.head.logits(hidden[:, slots]), work)
        for row, w in enumerate(work):
            w.drafts = tokens[row, : w.num_drafts].tolist()
            if probs is not None:
                w.probs = probs[row, : w.num_drafts]

    def _sample(self, logits: torch.Tensor, work: list[BlockWork]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft-vocabulary logits [B, ..., V_d] (row i: work[i]) -> target ids [B, ...] and,
        when sampled, the probabilities they were drawn from in the target vocabulary [B, ..., V]."""
        return self.sample(logits, [w.temperature for w in work], [w.generator for w in work])
