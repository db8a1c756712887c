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

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from backends.methods.block_checkpoint import (
    BlockCheckpointError,
    BlockSpec,
    config_field,
    load_head,
    read_block_config,
)
from backends.methods.drafts import DRAFT_KV_MEMORY_GB, GROW_SLACK_TOKENS
from backends.methods.head_checkpoint import TargetInfo
from backends.methods.head_proposer import HeadProposer
from backends.runtime.lean_lm import LeanDecoder, Row
from backends.serving.proposer import Draft, DraftRequest

# ---------------------------------------------------------------------------- the head


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


def load_dflash(
    path: Path | str, target: TargetInfo, dtype: str = "bfloat16", overrides: dict[str, Any] | None = None
) -> DFlashHead:
    return load_head(DFlashHead, path, target, dtype, overrides)


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
