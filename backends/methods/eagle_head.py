"""The EAGLE heads (EAGLE-1/2 and EAGLE-3) and their checkpoints: the modules a proposer runs,
and loading a checkpoint directory into one, refused by name where it does not fit the target.
The layouts are described in backends/methods/eagle.py's docstring."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from backends.config import aux_layer_ids as checkpoint_aux_layer_ids
from backends.methods.head_checkpoint import Checkpoint, HeadCheckpointError, TargetInfo, load_checked, read_head_state
from backends.runtime import cpu_kernels
from backends.runtime.lean_lm import KernelLinear

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


# run_layer(i, attention input, residual) -> decoder layer i's output: the head's layers over
# whichever cache runs them (a DynamicCache in `forward`, the lean runtime's pool when drafting).
RunLayer = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


class EagleHead(nn.Module):
    """Shared by both layouts: `features` turns target hidden states [r, layers, H_t] into the
    head's input features, `decode` feeds (token, feature) pairs through the decoder layer(s)
    and returns the hidden state to feed back, `logits` the draft-vocabulary logits of such
    states. `forward` is `decode` over a transformers DynamicCache (training and references);
    the proposer runs `decode` on the lean runtime."""

    layout: str
    hidden_layer_ids: tuple[int, ...]
    zero_first_embedding = False  # the pair at position 0 reads no embedding (DeepSeek's and MiMo's MTP)

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
        """`decode` over `cache` with an additive or boolean attention `mask`."""
        rope = self.rotary_emb(features, position_ids)

        def run_layer(i: int, attn_input: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            return self.layers[i].run(attn_input, residual, rope, mask, cache)

        return self.decode(input_ids, features, position_ids, run_layer, step)

    def decode(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        run_layer: RunLayer,
        step: int = 0,
    ) -> torch.Tensor:
        """The head's state after the pairs (input_ids, features) at `position_ids` (any
        leading shape). `step`: the draft step (0 = the pass over the target's states); only
        heads with a layer per step (multi-layer MTP) use it."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        raise NotImplementedError

    def chain_inputs(self) -> dict[str, Any] | None:
        """What `cpu_kernels.EagleChain` runs this head's greedy chain with: its LM head
        (`lm_head`, a KernelLinear) and its layout's layer inputs (`fc`, `pair_norms`,
        `attn_norm`, `final_norm`, `norm_before_residual`); None where the chain kernel does
        not run it (a layout it does not know, more than one layer, a linear off the packed
        kernel)."""
        return None


def on_packed_kernel(*linears: nn.Module) -> bool:
    return all(isinstance(linear, KernelLinear) for linear in linears)


def kernel_weights_of(linear: KernelLinear) -> cpu_kernels.LinearWeights:
    return cpu_kernels.LinearWeights.of(linear.kernel().kernel_weights())


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

    def decode(self, input_ids, features, position_ids, run_layer, step=0):
        x = self.fc(torch.cat([self.embed_tokens(input_ids), features], dim=-1))  # embedding first
        for i, layer in enumerate(self.layers):
            x = run_layer(i, x if i == 0 else layer.input_layernorm(x), x)
        return x  # no final norm: the same tensor gives logits and is fed back

    def logits(self, hidden, step=0):
        return self.lm_head(hidden)

    def chain_inputs(self) -> dict[str, Any] | None:
        if len(self.layers) != 1 or not on_packed_kernel(self.fc, self.lm_head):
            return None
        return {"lm_head": self.lm_head, "fc": kernel_weights_of(self.fc)}


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

    def decode(self, input_ids, features, position_ids, run_layer, step=0):
        layer = self.layers[0]
        normed = layer.hidden_norm(features)
        attn_input = torch.cat([layer.input_layernorm(self.embed_tokens(input_ids)), normed], dim=-1)
        return run_layer(0, attn_input, normed if self.norm_before_residual else features)

    def logits(self, hidden, step=0):
        return self.lm_head(self.norm(hidden))

    def chain_inputs(self) -> dict[str, Any] | None:
        if not on_packed_kernel(self.lm_head):
            return None
        layer = self.layers[0]
        return {
            "lm_head": self.lm_head,
            "pair_norms": (layer.input_layernorm.weight, layer.hidden_norm.weight),
            "final_norm": self.norm.weight,
            "norm_before_residual": self.norm_before_residual,
        }


class KernelRMSNorm(LlamaRMSNorm):
    """A transformers ``LlamaRMSNorm`` whose bf16 inference runs in ``cpu_kernels.rms_norm``: its
    bits (the kernel rounds as transformers does, tested), in one call instead of ~8 tensor ops
    (~40 us a norm here, three a draft position of an EAGLE-3 head). What ``kernel_norms``
    makes of a drafter head's norms; training (gradients wanted) keeps the tensor ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(x)
        return cpu_kernels.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.variance_epsilon).view(x.shape)


def kernel_norms(module: nn.Module) -> int:
    """Turn ``module``'s bf16 ``LlamaRMSNorm`` layers on the CPU into ``KernelRMSNorm`` where the
    kernel takes their width; how many."""
    turned = 0
    for m in module.modules():
        if (
            type(m) is LlamaRMSNorm
            and m.weight.dtype == torch.bfloat16
            and m.weight.device.type == "cpu"
            and cpu_kernels.layer_kernels_available(m.weight.shape[0], 16, 16)
        ):
            m.__class__ = KernelRMSNorm
            turned += 1
    return turned


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
