"""EAGLE-family drafters: `eagle` (EAGLE-1/2 heads) and `eagle3` (EAGLE-3 heads).

An EAGLE head is one decoder layer that drafts from the target's hidden states instead of
from tokens alone. Both methods load their checkpoints in the published layouts (see
/work/shared/reference/checkpoint_formats.md §2, §3); the layout is decided from config.json
and the state-dict keys, never from the directory name:

- EAGLE-1/2: Llama-style config.json with `num_hidden_layers` (1), state dict `fc.weight`
  [H, 2H] (+ `fc.bias` unless `"bias": false`), `layers.{i}.*` where layer 0 has no
  `input_layernorm`. No final norm; the target's LM head turns the layer output into logits
  and its embedding embeds the tokens (both borrowed when the checkpoint omits them).
- EAGLE-3: config.json with `draft_vocab_size` (or the speculators format:
  `speculators_model_type: eagle3` + `transformer_layer_config`), state dict `fc.weight`
  [H, 3·H_t] (no bias), `midlayer.*` or `layers.0.*` with 2H-wide q/k/v, `hidden_norm` and
  `input_layernorm` (on the embedding), `norm.weight`, `lm_head.weight` [V_d, H], `d2t`
  [V_d] offsets (target id = draft id + d2t[draft id]) and `t2d` [V] (ignored).

How hidden states line up with tokens (the "one-token shift")
------------------------------------------------------------
Let the sequence be x_0 .. x_{n-1}. The target has run x_0 .. x_{n-2}; x_{n-1} is the token it
just emitted. h_t is the target's hidden state at position t (computed from x_0..x_t; the
state that predicted x_{t+1}). EAGLE's input at draft position t is the pair
(x_{t+1}, h_t), at rotary position t; x_0 is never an input token. The head's output at
position n-2 gives the first draft d_1 and a hidden state g that replaces h for the next
position: pair (d_1, g) at position n-1 gives d_2, and so on (k drafts = k forwards; the
k-th draft is never fed).

Delivery contract (`DraftRequest.hidden_states`): a float tensor [r, len(hidden_layer_ids), H_t]
with one row per target position the drafter has not been given yet, in order, ending at
position n-2: row j is h_{n-1-r+j}, i.e. exactly what `TargetRunner.verify` returns as
`VerifyResult.hidden_states` (the pending tokens + accepted drafts), concatenated over every
verify step since the last draft call (steps where no draft was asked for included). Layer
ids come from `hidden_layer_ids`: (-1,) for eagle (the final normed state), the sorted aux
ids for eagle3 (default (2, L//2, L-3) as vLLM, or `eagle_aux_hidden_state_layer_ids`). Rows
may repeat positions already delivered (they are fed again); a gap is an error.
`hidden_states=None` means the target has not run yet (the first step): no drafts.

Draft-position KV entries computed from the drafter's own g are speculative: the next call
crops them (even for accepted drafts, which are re-fed with the target's h, as EAGLE does)
and keeps only the entries computed from target states whose tokens still match the
sequence (the token list is diffed as in draft_model).

Greedy drafts come without probabilities (one-hot, as in draft_model); `probabilistic`
drafts are sampled and come with [k, V_target] probabilities (eagle3 scatters its draft
vocabulary into the target's through d2t; target ids outside it get probability 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from backends.config import aux_layer_ids as checkpoint_aux_layer_ids
from backends.methods.draft_model import append_new_entries, gather_drafts, stack_caches
from backends.methods.head_checkpoint import Checkpoint, HeadCheckpointError, TargetInfo, load_checked, read_head_state
from backends.methods.head_proposer import HeadProposer
from backends.serving.proposer import Draft, DraftRequest

LAYOUTS = ("eagle", "eagle3")
_NAMES = {"eagle": "EAGLE-1", "eagle3": "EAGLE-3"}


class EagleCheckpointError(HeadCheckpointError):
    """An EAGLE checkpoint that does not fit the layout it claims or the target it drafts for."""


# ---------------------------------------------------------------------------- the heads


class EagleLayer(nn.Module):
    """A Llama decoder layer whose attention may read a wider input (EAGLE-3: 2H) and which
    registers only the norms its layout has."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int, attn_in: int, norms: tuple[str, ...]) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        if attn_in != cfg.hidden_size:
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(self.self_attn, name)
                setattr(self.self_attn, name, nn.Linear(attn_in, old.out_features, bias=old.bias is not None))
        self.mlp = LlamaMLP(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        for name in norms:
            setattr(self, name, LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def run(
        self, attn_input: torch.Tensor, residual: torch.Tensor, rope: tuple, mask: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        x = residual + self.self_attn(attn_input, position_embeddings=rope, attention_mask=mask, cache=cache)[0]
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """Shared by both layouts: `features` turns target hidden states [r, layers, H_t] into the
    head's input features, `forward` runs the decoder layer(s) and returns the hidden state to
    feed back, `logits` the draft-vocabulary logits of such states."""

    layout: str
    hidden_layer_ids: tuple[int, ...]

    def __init__(self, cfg: LlamaConfig, target: TargetInfo) -> None:
        super().__init__()
        self.config = cfg
        self.target_hidden_size = target.hidden_size  # the width of each delivered hidden state
        self.target_vocab_size = target.vocab_size
        # [V_d] the target id of each draft id (eagle3); None: the vocabularies are one.
        self.register_buffer("draft_to_target", None, persistent=False)
        self.embed_tokens = nn.Embedding(target.vocab_size, cfg.hidden_size)
        self.rotary_emb = LlamaRotaryEmbedding(cfg)

    def features(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        cache: DynamicCache | None,
        step: int = 0,
    ) -> torch.Tensor:
        """`step`: the draft step (0 = the pass over the target's states); only heads with a
        layer per step (multi-layer MTP) use it."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        raise NotImplementedError


class Eagle1Head(EagleHead):
    layout = "eagle"
    hidden_layer_ids = (-1,)  # the target's final normed state

    def __init__(self, cfg: LlamaConfig, target: TargetInfo, fc_bias: bool) -> None:
        super().__init__(cfg, target)
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        # Layer 0 reads fc's output directly (no input_layernorm); later layers are standard.
        self.layers = nn.ModuleList(
            EagleLayer(cfg, i, h, () if i == 0 else ("input_layernorm",)) for i in range(cfg.num_hidden_layers)
        )
        self.lm_head = nn.Linear(h, target.vocab_size, bias=False)

    def features(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states[:, 0]

    def forward(self, input_ids, features, position_ids, mask, cache, step=0):
        x = self.fc(torch.cat([self.embed_tokens(input_ids), features], dim=-1))  # embedding first
        rope = self.rotary_emb(x, position_ids)
        for i, layer in enumerate(self.layers):
            x = layer.run(x if i == 0 else layer.input_layernorm(x), x, rope, mask, cache)
        return x  # no final norm: the same tensor gives logits and is fed back

    def logits(self, hidden, step=0):
        return self.lm_head(hidden)


class Eagle3Head(EagleHead):
    layout = "eagle3"

    def __init__(
        self, cfg: LlamaConfig, target: TargetInfo, num_aux: int, draft_vocab_size: int, norm_before_residual: bool
    ) -> None:
        super().__init__(cfg, target)
        h = cfg.hidden_size
        self.fc = nn.Linear(num_aux * target.hidden_size, h, bias=False)
        self.layers = nn.ModuleList([EagleLayer(cfg, 0, 2 * h, ("input_layernorm", "hidden_norm"))])
        self.norm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.norm_before_residual = norm_before_residual
        self.hidden_layer_ids = ()

    def features(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc(hidden_states.flatten(1))  # aux layers concatenated low -> high

    def forward(self, input_ids, features, position_ids, mask, cache, step=0):
        layer = self.layers[0]
        normed = layer.hidden_norm(features)
        attn_input = torch.cat([layer.input_layernorm(self.embed_tokens(input_ids)), normed], dim=-1)
        residual = normed if self.norm_before_residual else features
        return layer.run(attn_input, residual, self.rotary_emb(features, position_ids), mask, cache)

    def logits(self, hidden, step=0):
        return self.lm_head(self.norm(hidden))


# ---------------------------------------------------------------------------- loading


def detect_layout(cfg: dict[str, Any], keys: set[str]) -> str:
    """eagle3 when the config or the keys say so (draft vocabulary, hidden_norm, midlayer)."""
    eagle3 = (
        cfg.get("speculators_model_type") in ("eagle3", "peagle")
        or "draft_vocab_size" in cfg
        or any(k == "d2t" or k.startswith("midlayer.") or ".hidden_norm." in k for k in keys)
    )
    return "eagle3" if eagle3 else "eagle"


def llama_config(cfg: dict[str, Any]) -> LlamaConfig:
    llama = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    llama._attn_implementation = "sdpa"
    return llama


def load_eagle(
    path: Path | str | Checkpoint,
    target: TargetInfo,
    dtype: str = "bfloat16",
    method: str | None = None,
    aux_layer_ids: list[int] | None = None,
) -> EagleHead:
    """Load an EAGLE-1/2 or EAGLE-3 checkpoint directory for `target`. `method` (eagle or
    eagle3), when given, must match the layout found. `aux_layer_ids` overrides eagle3's
    target layers (default: the checkpoint's, else vLLM's (2, L//2, L-3)). A Checkpoint
    comes with its config.json already read."""
    path, cfg = Checkpoint.open(path, EagleCheckpointError)
    state, spelled = read_head_state(path, EagleCheckpointError)
    layout = detect_layout(cfg, set(state))
    where = f"{_NAMES[layout]} checkpoint {path}"
    if method is not None and method != layout:
        raise EagleCheckpointError(
            f"{where}: method {method!r} needs an {_NAMES[method]} checkpoint, "
            f"but config.json and the keys are {_NAMES[layout]}'s"
        )
    if cfg.get("vocab_size") != target.vocab_size:
        raise EagleCheckpointError(
            f"{where}: vocab_size {cfg.get('vocab_size')} in config.json, but the "
            f"target's vocabulary has {target.vocab_size} ids"
        )
    llama = llama_config(cfg)
    borrowed = {"embed_tokens.weight"}  # taken from the target when absent
    if layout == "eagle":
        if llama.hidden_size != target.hidden_size:
            raise EagleCheckpointError(
                f"{where}: hidden_size {llama.hidden_size} in config.json, but the "
                f"target's hidden size is {target.hidden_size}"
            )
        head: EagleHead = Eagle1Head(llama, target, fc_bias=cfg.get("bias", True))
        borrowed.add("lm_head.weight")
    else:
        head = _eagle3_head(cfg, llama, target, state, where, aux_layer_ids)
    if llama.hidden_size != target.hidden_size:
        borrowed.discard("embed_tokens.weight")  # another width: the checkpoint must have its own
    one_vocab = layout == "eagle3" and head.lm_head.out_features == target.vocab_size
    defaults = {"d2t": head.d2t} if one_vocab else {}  # absent: zero offsets
    load_checked(head, state, spelled, target, where, EagleCheckpointError, borrowed, defaults)
    return head.to(getattr(torch, dtype)).eval()


def _eagle3_head(
    cfg: dict[str, Any],
    llama: LlamaConfig,
    target: TargetInfo,
    state: dict[str, torch.Tensor],
    where: str,
    aux_layer_ids: list[int] | None,
) -> Eagle3Head:
    if (cfg.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise EagleCheckpointError(
            f"{where}: the single-hidden-state variant (use_aux_hidden_state: false) is not supported"
        )
    if llama.num_hidden_layers != 1:
        raise EagleCheckpointError(
            f"{where}: num_hidden_layers {llama.num_hidden_layers}; only one-layer EAGLE-3 heads are supported"
        )
    target_hidden = cfg.get("target_hidden_size") or llama.hidden_size
    if target_hidden != target.hidden_size:
        raise EagleCheckpointError(
            f"{where}: target_hidden_size {target_hidden}, but the target's hidden size is {target.hidden_size}"
        )
    ids = aux_layer_ids or checkpoint_aux_layer_ids(cfg, {"num_hidden_layers": target.num_layers})
    # fc reads one target hidden state per id (then its shape is checked against that).
    if len(set(ids)) != len(ids) or not all(0 <= i < target.num_layers for i in ids):
        raise EagleCheckpointError(
            f"{where}: aux hidden-state layer ids {list(ids)} must be distinct target layers in "
            f"[0, {target.num_layers - 1}]; set eagle_aux_hidden_state_layer_ids"
        )
    head = Eagle3Head(
        llama,
        target,
        len(ids),
        cfg.get("draft_vocab_size") or target.vocab_size,
        bool(cfg.get("norm_before_residual", False)),
    )
    head.hidden_layer_ids = tuple(sorted(ids))  # vLLM collects them in ascending layer order
    return head


# ---------------------------------------------------------------------------- the proposers


@dataclass
class _SeqState:
    cache: DynamicCache
    # x_0..x_c: the cache's first c entries are the pairs (x_{t+1}, h_t) from target states;
    # entries past c came from the drafter's own states and are always cropped.
    token_ids: list[int] = field(default_factory=list)


@dataclass
class _Work:
    index: int
    state: _SeqState
    start: int  # first position fed this call
    new_ids: list[int]  # x_{start+1}..x_{n-1}
    features: torch.Tensor  # [len(new_ids), D]
    num_drafts: int
    temperature: float
    generator: torch.Generator | None  # the request's (SequenceProposer.generator_for)
    drafts: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # [num_drafts, V_target] on the head's device (probabilistic)


class EagleProposer(HeadProposer):
    method = "eagle"
    hidden_layer_ids = (-1,)  # EAGLE-1/2 read the target's final normed state
    _seqs: dict[int, _SeqState]

    @classmethod
    def load_head(cls, config: Any, target: TargetInfo, dtype: str) -> EagleHead:
        return load_eagle(cls.checkpoint(config), target, dtype, cls.method, config.eagle_aux_hidden_state_layer_ids)

    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest]) -> list[Draft]:
        drafts = [Draft() for _ in batch]
        work = [w for i, req in enumerate(batch) if (w := self._prepare(i, req)) is not None]
        if work:
            self._run(work)
        for w in work:
            drafts[w.index] = Draft(w.drafts, w.probs)
        return drafts

    def _prepare(self, index: int, req: DraftRequest) -> _Work | None:
        """Crop the sequence's cache back to where the delivered hidden states start; the work."""
        n, hidden = len(req.token_ids), req.hidden_states
        num_drafts = min(req.num_tokens, self.max_model_len - n)
        if hidden is None or num_drafts <= 0:
            return None  # the target has not run yet (first step), or no room
        width = len(self.hidden_layer_ids) * self.head.target_hidden_size
        if (
            hidden.dim() != 3
            or hidden.shape[1] != len(self.hidden_layer_ids)
            or hidden.shape[1] * hidden.shape[2] != width
            or not 0 < hidden.shape[0] < n
        ):
            raise ValueError(
                f"sequence {req.seq_id}: hidden_states has shape {list(hidden.shape)}; expected [rows, "
                f"{len(self.hidden_layer_ids)}, {width // len(self.hidden_layer_ids)}] (layers "
                f"{self.hidden_layer_ids}) with 1 <= rows <= {n - 1} (one per target position)"
            )
        start = n - 1 - hidden.shape[0]
        state = self._seqs.get(req.seq_id)
        if state is None:
            state = self._seqs[req.seq_id] = _SeqState(DynamicCache(config=self.head.config))
        valid = max(0, min(len(state.token_ids), req.num_kept) - 1)
        if valid < start:
            raise ValueError(
                f"sequence {req.seq_id}: hidden states start at position {start}, but the drafter has "
                f"target states up to position {valid - 1} only; deliver every position the target "
                "processed since the last draft call"
            )
        cached = state.cache.get_seq_length()
        if cached > start:
            state.cache.crop(start - cached)
        state.token_ids = list(req.token_ids)
        features = self.head.features(hidden.to(self.device, self.dtype))
        return _Work(
            index,
            state,
            start,
            req.token_ids[start + 1 :],
            features,
            num_drafts,
            req.temperature,
            self.generator_for(req),
        )

    def _run(self, work: list[_Work]) -> None:
        """One forward per draft position for the whole batch: caches left-padded and stacked
        (a lone sequence uses its own), new pairs right-padded, a mask over both pads."""
        lengths = [len(w.new_ids) for w in work]
        max_cached, max_len = max(w.start for w in work), max(lengths)
        alone = len(work) == 1
        cache = (
            work[0].state.cache
            if alone
            else stack_caches([w.state.cache for w in work], [w.start for w in work], self.head.config)
        )
        ids = torch.tensor([w.new_ids + [0] * (max_len - n) for w, n in zip(work, lengths)], device=self.device)
        features = torch.stack([F.pad(w.features, (0, 0, 0, max_len - n)) for w, n in zip(work, lengths)])
        keys = torch.tensor(
            [[0] * (max_cached - w.start) + [1] * (w.start + n) + [0] * (max_len - n) for w, n in zip(work, lengths)],
            dtype=torch.bool,
            device=self.device,
        )
        positions = torch.tensor([list(range(w.start, w.start + max_len)) for w in work], device=self.device)
        last = torch.tensor(lengths, device=self.device) - 1  # each row's last real pair
        rows = torch.arange(len(work), device=self.device)
        steps, sampled = max(w.num_drafts for w in work), []
        for step in range(steps):
            hidden = self.head(ids, features, positions, causal_mask(keys, ids.shape[1]), cache, step)
            hidden = hidden[rows, last]
            tokens = self._sample(self.head.logits(hidden, step), work, sampled)
            if step + 1 == steps:
                break
            # The next pair: the draft just made with the head's own state, one position on.
            ids, features = tokens.unsqueeze(1), hidden.unsqueeze(1)
            positions = positions[rows, last].unsqueeze(1) + 1
            keys = F.pad(keys, (0, 1), value=True)
            last = torch.zeros_like(last)
        for w, drafted, probs in zip(work, *gather_drafts(sampled, [w.num_drafts for w in work])):
            w.drafts, w.probs = drafted, probs
        if alone:
            return
        append_new_entries(
            cache, [w.state.cache for w in work], max_cached, lengths, max_len, [w.num_drafts - 1 for w in work]
        )

    def _sample(self, logits: torch.Tensor, work: list[_Work], steps: list[tuple]) -> torch.Tensor:
        """One draft per row of draft-vocabulary `logits` [B, V_d] (row i: work[i]), as target
        ids [B] that stay on the device; `steps` collects (tokens, target-vocabulary probs) for
        `gather_drafts`."""
        tokens, probs = self.sample(logits, [w.temperature for w in work], [w.generator for w in work])
        steps.append((tokens, probs))
        return tokens


class Eagle3Proposer(EagleProposer):
    method = "eagle3"

    @classmethod
    def layers_for(cls, config: Any, target_model: Any = None) -> tuple[int, ...]:
        """The aux layers `load_eagle` will pick: the config's, else the checkpoint's, else
        vLLM's default; ascending, as vLLM collects them."""
        ids = config.eagle_aux_hidden_state_layer_ids
        if not ids:
            _, cfg = Checkpoint.open(cls.checkpoint(config), EagleCheckpointError)
            ids = checkpoint_aux_layer_ids(cfg, {"num_hidden_layers": TargetInfo.load(target_model).num_layers})
        return tuple(sorted(ids))


def causal_mask(keys: torch.Tensor, num_new: int) -> torch.Tensor:
    """[B, 1, num_new, K] bool: query i (the i-th of the new positions, which are the last
    num_new keys) sees the valid keys up to and including itself."""
    total = keys.shape[1]
    causal = (
        torch.arange(total, device=keys.device)[None, :]
        <= torch.arange(total - num_new, total, device=keys.device)[:, None]
    )
    return (keys[:, None, :] & causal[None])[:, None]
