"""`mtp`: multi-token-prediction layers (DeepSeek-V3 style, MiMo) drafting from the target's
hidden states (DeepSeek-V3, arXiv 2412.19437; vLLM's https://github.com/vllm-project/vllm/blob/c314af1abfddff7b6cce9af578be72c496c6a5e4/vllm/model_executor/models/deepseek_mtp.py).

An MTP layer is structurally an EAGLE head: at position t it reads the pair (x_{t+1}, h_t)
with h_t the target's final normed hidden state (layer id -1, what vLLM passes; the layer's
own `hnorm` renormalises it), keeps its own KV cache over those pairs and feeds its output
back for the next draft. So it reuses backends/methods/eagle.py's batched chain proposer (cache per
sequence, rollback, probabilistic drafts) with this head:

    e = embed(x_{t+1}), zeroed at position 0 (vLLM)
    u = eh_proj(concat(enorm(e), hnorm(h)))     DeepSeek / GLM: embedding first
    u = input_proj(concat(hidden_layernorm(h), token_layernorm(e)))   MiMo: hidden first
    x = decoder_block(u)                         own KV cache
    DeepSeek: feed back x, logits = shared_head.head(shared_head.norm(x))
    MiMo:     feed back final_layernorm(x), logits = the target's lm_head of that

Layouts, decided from the keys:
- DeepSeek-V3 (also GLM-4.5, Step-3.5): `model.layers.{L+j}.` with L = config.json
  `num_hidden_layers`, j < `num_nextn_predict_layers`: `enorm`, `hnorm`, `eh_proj` [H, 2H],
  `shared_head.norm`, `shared_head.head` [V, H] and `embed_tokens` [V, H] (both optional: the
  target's are used when absent), plus the block's `self_attn.*`, `mlp.*`, `input_layernorm`,
  `post_attention_layernorm`.
- MiMo: `model.mtp_layers.{j}.`: `token_layernorm`, `hidden_layernorm`, `input_proj`,
  `final_layernorm` and a Qwen2 block (q/k/v biases).
Only Llama/Qwen2-style dense blocks run here (q/k/v/o_proj, gate/up/down_proj); DeepSeek's MLA
attention or MoE experts are refused naming the keys. The layers may sit inside the target's
own checkpoint (`model` omitted: vLLM then uses the target path), read without loading the
rest of it, or in a directory of their own.

Layer selection as vLLM: every draft step reuses MTP layer 0 (further layers are not loaded).
When the draft model_type is Step-3.5's (`step3p5_mtp`, one lm_head per layer), draft step s
uses layer s mod n; here every layer runs over every pair so all layers' caches cover the
whole chain, and step s reads layer s mod n's output.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from backends.config import MULTI_STEP_MTP_TYPES, hf_config_override
from backends.methods.eagle import EagleProposer
from backends.methods.eagle_head import EagleHead, EagleLayer, kernel_weights_of, llama_config, on_packed_kernel
from backends.methods.head_checkpoint import Checkpoint, HeadCheckpointError, TargetInfo, check_keys, read_state_dict

FAMILIES = ("deepseek", "mimo")
# MiMo's names for the DeepSeek parts (the head uses DeepSeek's).
_MIMO_NAMES = {"token_layernorm": "enorm", "hidden_layernorm": "hnorm", "input_proj": "eh_proj"}
_MIMO_SPELLING = {v: k for k, v in _MIMO_NAMES.items()}
_BLOCK_KEYS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


class MTPCheckpointError(HeadCheckpointError):
    """MTP layers that are malformed, of an unsupported kind, or do not fit the target."""


class _SharedHead(nn.Module):
    def __init__(self, cfg: LlamaConfig, vocab_size: int) -> None:
        super().__init__()
        self.norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, vocab_size, bias=False)


class _MTPLayer(EagleLayer):
    """One MTP layer: the input norms and projection, a Llama/Qwen2 decoder block, and the
    family's output part (DeepSeek: shared_head; MiMo: final_layernorm)."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int, family: str, vocab_size: int) -> None:
        super().__init__(cfg, layer_idx, cfg.hidden_size, ("input_layernorm",))
        h = cfg.hidden_size
        self.family = family
        if family == "mimo":  # Qwen2 attention: q/k/v biases, none on o_proj
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                old = getattr(self.self_attn, name)
                setattr(self.self_attn, name, nn.Linear(old.in_features, old.out_features, bias=name != "o_proj"))
            self.final_layernorm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        else:
            self.shared_head = _SharedHead(cfg, vocab_size)
        self.enorm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)

    def predict(
        self, embeds: torch.Tensor, hidden: torch.Tensor, run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """`run(attention input, residual)`: this layer's decoder block over its cache."""
        e, h = self.enorm(embeds), self.hnorm(hidden)
        u = self.eh_proj(torch.cat([h, e] if self.family == "mimo" else [e, h], dim=-1))
        x = run(self.input_layernorm(u), u)
        return self.final_layernorm(x) if self.family == "mimo" else x


class MTPHead(EagleHead):
    """MTP layers as an EAGLE head: `features` = the target's final state, `forward` = the
    fed-back state, `logits` = the draft logits of such states.

    Build from the block's Llama/Qwen2-style config dict (usually the target's config.json)
    and the target: `family` "deepseek" or "mimo", `num_layers` MTP layers (several only for
    per-step layers, see the module docstring). The embedding and the LM head (DeepSeek:
    every layer's shared_head.head; MiMo: `lm_head`) start as copies of the target's when
    `borrow` is true; `borrowed` lists them, and `save_mtp` leaves them out of the file."""

    layout = "mtp"
    hidden_layer_ids = (-1,)  # the target's final normed state

    def __init__(
        self,
        config: dict[str, Any],
        target: TargetInfo,
        family: str = "deepseek",
        num_layers: int = 1,
        zero_first_embedding: bool = True,
        borrow: bool = True,
    ) -> None:
        if family not in FAMILIES:
            raise ValueError(f"MTP family must be one of {FAMILIES}, got {family!r}")
        llama = llama_config({**config, "num_hidden_layers": num_layers})  # one cache layer per MTP layer
        super().__init__(llama, target)
        self.block_config = dict(config)
        self.family, self.first_layer = family, target.num_layers  # DeepSeek numbers MTP layers after the target's
        self.zero_first_embedding = zero_first_embedding
        self.layers = nn.ModuleList(_MTPLayer(llama, j, family, target.vocab_size) for j in range(num_layers))
        if family == "mimo":
            self.lm_head = nn.Linear(llama.hidden_size, target.vocab_size, bias=False)
        lm_heads = (
            ["lm_head.weight"]
            if family == "mimo"
            else [f"layers.{j}.shared_head.head.weight" for j in range(num_layers)]
        )
        self.borrowed: set[str] = set()
        if borrow:
            lm_head = target.weight("lm_head")
            weights = {"embed_tokens.weight": target.weight("embed"), **{name: lm_head for name in lm_heads}}
            self.load_state_dict(weights, strict=False)
            self.borrowed = set(weights)

    def features(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states[:, 0]

    def decode(self, input_ids, features, position_ids, run_layer, step=0):
        embeds = self.embed_tokens(input_ids)
        if self.zero_first_embedding:  # DeepSeek / MiMo (vLLM): position 0 has no embedding input
            embeds = embeds.masked_fill((position_ids == 0).unsqueeze(-1), 0.0)
        # With per-step layers every layer keeps its cache over the same chain of pairs.
        outputs = [
            layer.predict(embeds, features, lambda a, r, j=j: run_layer(j, a, r)) for j, layer in enumerate(self.layers)
        ]
        return outputs[step % len(outputs)]

    def logits(self, hidden, step=0):
        if self.family == "mimo":
            return self.lm_head(hidden)
        head = self.layers[step % len(self.layers)].shared_head
        return head.head(head.norm(hidden))

    def chain_inputs(self) -> dict[str, Any] | None:
        """DeepSeek's layout with one layer (MiMo's concatenates the state first and norms the
        layer's output)."""
        if self.family != "deepseek" or len(self.layers) != 1:
            return None
        layer = self.layers[0]
        if not on_packed_kernel(layer.eh_proj, layer.shared_head.head):
            return None
        return {
            "lm_head": layer.shared_head.head,
            "fc": kernel_weights_of(layer.eh_proj),
            "pair_norms": (layer.enorm.weight, layer.hnorm.weight),
            "attn_norm": layer.input_layernorm.weight,
            "final_norm": layer.shared_head.norm.weight,
        }


# ---------------------------------------------------------------------------- loading


def load_mtp(path: Path | str | Checkpoint, target: TargetInfo, dtype: str = "bfloat16") -> MTPHead:
    """Load the MTP layers of `path` (a target checkpoint that holds them, or a directory of
    their own; a Checkpoint comes with its config.json already read) for `target`."""
    path, cfg = Checkpoint.open(path, MTPCheckpointError)
    where = f"MTP checkpoint {path}"
    model_type = hf_config_override(cfg).get("model_type")
    per_step = model_type in MULTI_STEP_MTP_TYPES
    first = cfg.get("num_hidden_layers")
    declared = cfg.get("num_nextn_predict_layers")
    mtp_key = re.compile(r"model\.(?:mtp_layers\.\d+|layers\.(\d+))\..*")

    def is_mtp(key: str) -> bool:  # the MTP layers only; the target's own layers stay unread
        m = mtp_key.fullmatch(key)
        return m is not None and (m.group(1) is None or first is None or int(m.group(1)) >= first)

    raw = read_state_dict(path, keep=is_mtp, error=MTPCheckpointError)
    family, prefixes = _find_layers(raw, cfg, where)
    for name, wanted in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if cfg.get(name) != wanted:
            raise MTPCheckpointError(f"{where}: {name} {cfg.get(name)} in config.json, but the target's is {wanted}")
    if declared is not None and len(prefixes) < declared:
        raise MTPCheckpointError(
            f"{where}: num_nextn_predict_layers is {declared}, but only {len(prefixes)} MTP "
            f"layer(s) found ({', '.join(prefixes)})"
        )
    used = prefixes if per_step else prefixes[:1]
    state, spelled = _head_names(raw, used, family)
    missing = [p + k for p in used for k in _BLOCK_KEYS if p + k not in raw]
    if missing:
        known = {p + k.replace(".weight", ".bias") for p in used for k in _BLOCK_KEYS} | {
            p + k for p in used for k in _BLOCK_KEYS
        }
        others = sorted(
            k for k in raw if k.startswith(tuple(used)) and ("self_attn." in k or "mlp." in k) and k not in known
        )[:4]
        raise MTPCheckpointError(
            f"{where}: the MTP block is not a Llama/Qwen2-style dense layer (missing {missing[0]!r}; it has "
            f"{others}); only q/k/v/o_proj attention with a gate/up/down MLP runs here"
        )
    head = MTPHead(cfg, target, family, len(used), zero_first_embedding=model_type != "step3p5_mtp")
    head.borrowed -= set(state)  # the checkpoint's own copies win
    check_keys(
        head,
        state,
        spelled,
        set(head.borrowed),
        {},
        where,
        lambda k: _file_key(k, used, family),
        error=MTPCheckpointError,
    )
    head.load_state_dict(state, strict=False)  # complete but for the borrowed copies (checked above)
    return head.to(getattr(torch, dtype)).eval()


def _find_layers(raw: dict[str, torch.Tensor], cfg: dict[str, Any], where: str) -> tuple[str, list[str]]:
    """The family and the key prefix of each MTP layer, in order."""
    mimo = sorted({int(m.group(1)) for k in raw if (m := re.match(r"model\.mtp_layers\.(\d+)\.", k))})
    if mimo:
        prefixes = [f"model.mtp_layers.{j}." for j in mimo]
        family = "mimo"
    else:
        first = cfg.get("num_hidden_layers")
        found = sorted({int(m.group(1)) for k in raw if (m := re.match(r"model\.layers\.(\d+)\.eh_proj\.", k))})
        if not found:
            raise MTPCheckpointError(
                f"{where}: no MTP layers: expected 'model.layers.{{num_hidden_layers}}.eh_proj.weight' "
                "(DeepSeek layout) or 'model.mtp_layers.0.*' (MiMo layout)"
            )
        if first is None or found[0] != first:
            raise MTPCheckpointError(
                f"{where}: the first MTP layer is 'model.layers.{found[0]}.', but config.json has "
                f"num_hidden_layers {first} (MTP layers follow the target's layers)"
            )
        prefixes = [f"model.layers.{i}." for i in found]
        family = "deepseek"
        mimo = [i - first for i in found]
    if mimo != list(range(len(mimo))):
        raise MTPCheckpointError(f"{where}: MTP layers {prefixes} are not consecutive")
    return family, prefixes


def _head_names(
    raw: dict[str, torch.Tensor], used: list[str], family: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The used layers' tensors under the head's names; later layers' keys are not read."""
    state, spelled = {}, {}
    for key, value in raw.items():
        for j, prefix in enumerate(used):
            if key.startswith(prefix):
                rest = key.removeprefix(prefix)
                if family == "mimo":
                    part, _, tail = rest.partition(".")
                    rest = f"{_MIMO_NAMES.get(part, part)}.{tail}"
                # The embedding is shared: DeepSeek files repeat it in every layer (vLLM reads the first).
                name = "embed_tokens.weight" if rest == "embed_tokens.weight" else f"layers.{j}.{rest}"
                if name == "embed_tokens.weight" and j > 0:
                    continue
                state[name], spelled[name] = value, key
    return state, spelled


def _file_key(name: str, used: list[str], family: str) -> str:
    """A head parameter's key in the checkpoint's layout (for naming missing keys)."""
    m = re.fullmatch(r"layers\.(\d+)\.(.*)", name)
    if m is None:  # the embedding: DeepSeek files hold it in the (first) MTP layer
        return f"{used[0]}{name}" if name == "embed_tokens.weight" and family == "deepseek" else name
    rest = m.group(2)
    if family == "mimo":
        part, _, tail = rest.partition(".")
        rest = f"{_MIMO_SPELLING.get(part, part)}.{tail}"
    return used[int(m.group(1))] + rest


# ---------------------------------------------------------------------------- saving


def save_mtp(head: MTPHead, out: Path | str) -> None:
    """Write `head` as config.json + model.safetensors in its family's published layout,
    leaving out the tensors borrowed from the target (`head.borrowed`). DeepSeek: keys
    `model.layers.{L+j}.*` and the block config with model_type `deepseek_mtp` (what vLLM's
    hf_config_override makes of a DeepSeek-V3 config; the method is then detected as mtp),
    `num_hidden_layers` L and `num_nextn_predict_layers`. MiMo: `model.mtp_layers.{j}.*` and
    the block config as a MiMoForCausalLM."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    n = len(head.layers)
    if head.family == "deepseek":
        prefixes = [f"model.layers.{head.first_layer + j}." for j in range(n)]
        config = {
            **head.block_config,
            "model_type": "deepseek_mtp",
            "architectures": ["DeepSeekMTPModel"],
            "n_predict": n,
        }
    else:
        prefixes = [f"model.mtp_layers.{j}." for j in range(n)]
        config = {**head.block_config, "model_type": "mimo", "architectures": ["MiMoForCausalLM"]}
    config.update(num_hidden_layers=head.first_layer, num_nextn_predict_layers=n)
    # MiMo's embedding and LM head are always the target's; the layout has no place for them.
    skip = head.borrowed | ({"embed_tokens.weight", "lm_head.weight"} if head.family == "mimo" else set())
    state = {
        _file_key(k, prefixes, head.family): v.detach().contiguous().cpu()
        for k, v in head.state_dict().items()
        if k not in skip
    }
    save_file(state, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------------------- the proposer


class MTPProposer(EagleProposer):
    method = "mtp"
    needs_model = False  # the MTP layers may be the target's own

    @classmethod
    def load_head(cls, config: Any, target: TargetInfo, dtype: str) -> MTPHead:
        return load_mtp(cls.checkpoint(config, str(target.path)), target, dtype)
