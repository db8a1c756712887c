"""`mlp_speculator`: IBM's MLP speculator (fms-extras "accelerator" checkpoints), run for real.

vLLM accepts this method in its config but neither of its runners can execute it; this is the
algorithm of fms-extras / vLLM V0 (fms_extras/models/speculator.py in
https://github.com/foundation-model-stack/fms-extras; arXiv 2404.19124). From the target's
final normed state f_t (layer id -1) and the
token x_{t+1} it produced, stage i (0-based) drafts x_{t+2+i}:

    s = f_t;  if scale_input: s = s * rsqrt(mean(s^2) + 1e-6) / sqrt(2)
    tok = x_{t+1}
    for i < k:  s = GELU(LN_i(proj_i(s) + (emb_weight / state_weight) * emb_i(tok)));  tok = draft of head_i(s)

with LN_i(x) = x * rsqrt(mean(x^2) + 1e-6) * w_i + b_i, state_weight = 0.5 ** (0.5 / n_predict),
emb_weight = sqrt((1 - state_weight^2) * D / 2), D = inner_dim (0 means emb_dim). The draft
token (argmax, or a sample when `draft_sample_method` is probabilistic) feeds the next stage.

config.json: `model_type: mlp_speculator`, `emb_dim` (= the target's hidden size), `inner_dim`,
`vocab_size`, `n_predict`, `tie_weights`, `scale_input`, `top_k_tokens_per_head`,
`n_candidates` (the last two serve tree drafting, unused in chain mode). Keys, optionally
prefixed `speculator.`: `emb.{i}.weight` [V, D], `proj.0.weight` [D, emb_dim],
`proj.{i>0}.weight` [D, D], `head.{i}.weight` [V, D], `ln.{i}.weight` / `.bias` [D]. With
`tie_weights` every stage shares emb/head/ln 0 and stages >= 1 share proj 1; a file may hold
the shared tensors once or repeated for every stage (repeats must be equal).

Stages: `num_speculative_tokens` (K) of them, as vLLM builds (its `num_lookahead_tokens`);
`n_predict` stays the checkpoint's and sets state_weight. K > n_predict (vLLM requires a
multiple) runs the shared stages again with tied weights; untied checkpoints have no weights
for those stages (vLLM would leave them uninitialised), so that is refused.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from backends.methods.head_checkpoint import Checkpoint, HeadCheckpointError, TargetInfo, check_keys, read_state_dict
from backends.methods.last_hidden import LastHiddenProposer

EPS = 1e-6
# MLPSpeculatorConfig's defaults (vLLM); emb_dim's alias is hidden_size.
DEFAULTS = {
    "vocab_size": 32000,
    "emb_dim": 4096,
    "inner_dim": 0,
    "n_predict": 3,
    "top_k_tokens_per_head": None,
    "n_candidates": 5,
    "tie_weights": False,
    "scale_input": False,
}
_KEY = re.compile(r"(emb|proj|head|ln)\.(\d+)\.(weight|bias)")


class MLPSpeculatorCheckpointError(HeadCheckpointError):
    """An MLP speculator checkpoint that is malformed or does not fit the target."""


class _LayerNorm(nn.Module):
    """fms-extras' norm: RMS-style (no mean subtraction) with a learned scale and shift."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x) * self.weight + self.bias


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


class MLPSpeculatorHead(nn.Module):
    """The speculator with `num_stages` stages (default n_predict) from an MLPSpeculatorConfig
    dict; with tie_weights the stages share modules as the format says."""

    def __init__(self, config: dict[str, Any], target: TargetInfo, num_stages: int | None = None) -> None:
        super().__init__()
        self.config = {**DEFAULTS, **{k: config[k] for k in DEFAULTS if k in config}}
        cfg = self.config
        emb_dim, vocab, n_predict = cfg["emb_dim"], cfg["vocab_size"], cfg["n_predict"]
        inner = cfg["inner_dim"] or emb_dim
        stages = num_stages or n_predict
        self.num_steps, self.scale_input = stages, bool(cfg["scale_input"])
        self.target_hidden_size, self.target_vocab_size = target.hidden_size, target.vocab_size
        # [V_d] the target id of each draft id (a speculative_token_map); None: the target's vocabulary.
        self.register_buffer("draft_to_target", None, persistent=False)
        self.state_weight = 0.5 ** (0.5 / n_predict)
        self.emb_weight = math.sqrt((1 - self.state_weight**2) * inner / 2)
        if cfg["tie_weights"]:
            if n_predict < 2:
                raise MLPSpeculatorCheckpointError(
                    f"tie_weights needs n_predict > 1 (stages to share), got {n_predict}"
                )
            emb, head, ln = nn.Embedding(vocab, inner), nn.Linear(inner, vocab, bias=False), _LayerNorm(inner)
            tied = nn.Linear(inner, inner, bias=False)
            self.emb = nn.ModuleList([emb] * stages)
            self.proj = nn.ModuleList([nn.Linear(emb_dim, inner, bias=False)] + [tied] * (stages - 1))
            self.head = nn.ModuleList([head] * stages)
            self.ln = nn.ModuleList([ln] * stages)
        else:
            self.emb = nn.ModuleList(nn.Embedding(vocab, inner) for _ in range(stages))
            self.proj = nn.ModuleList(nn.Linear(emb_dim if i == 0 else inner, inner, bias=False) for i in range(stages))
            self.head = nn.ModuleList(nn.Linear(inner, vocab, bias=False) for _ in range(stages))
            self.ln = nn.ModuleList(_LayerNorm(inner) for _ in range(stages))

    def begin(self, hidden: torch.Tensor) -> torch.Tensor:
        return _rms(hidden) / math.sqrt(2) if self.scale_input else hidden

    def step(self, index: int, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage `index`: the logits of its draft and the state the next stage reads."""
        state = self.proj[index](state) + self.emb[index](tokens) * (self.emb_weight / self.state_weight)
        state = nn.functional.gelu(self.ln[index](state))
        return self.head[index](state), state

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits [..., stages, V]: `hidden` [..., H_t] the target's final state
        at t, `tokens` [..., stages] = x_{t+1}..x_{t+stages} (stage i reads tokens[..., i])."""
        state, out = self.begin(hidden), []
        for i in range(tokens.shape[-1]):
            logits, state = self.step(i, state, tokens[..., i])
            out.append(logits)
        return torch.stack(out, dim=-2)


# ---------------------------------------------------------------------------- loading


def load_mlp_speculator(
    path: Path | str | Checkpoint, target: TargetInfo, dtype: str = "bfloat16", num_stages: int | None = None
) -> MLPSpeculatorHead:
    """Load an MLP speculator checkpoint directory (a Checkpoint comes with its config.json
    already read) for `target` with `num_stages` stages (default: its n_predict)."""
    path, cfg = Checkpoint.open(path, MLPSpeculatorCheckpointError)
    where = f"MLP speculator checkpoint {path}"
    if cfg.get("model_type") != "mlp_speculator":
        raise MLPSpeculatorCheckpointError(
            f"{where}: config.json has model_type {cfg.get('model_type')!r}, not 'mlp_speculator'"
        )
    if "emb_dim" not in cfg and "hidden_size" in cfg:
        cfg["emb_dim"] = cfg["hidden_size"]  # MLPSpeculatorConfig's alias
    cfg = {**DEFAULTS, **cfg}
    for name, wanted, what in (
        ("emb_dim", target.hidden_size, "hidden size"),
        ("vocab_size", target.vocab_size, "vocabulary size"),
    ):
        if cfg[name] != wanted:
            raise MLPSpeculatorCheckpointError(
                f"{where}: {name} {cfg[name]} in config.json, but the target's {what} is {wanted}"
            )
    n_predict, tied = cfg["n_predict"], bool(cfg["tie_weights"])
    stages = num_stages or n_predict
    if stages > n_predict and not tied:
        raise MLPSpeculatorCheckpointError(
            f"{where}: num_speculative_tokens={stages} needs {stages} stages, but the checkpoint has weights for "
            f"n_predict={n_predict} (tie_weights false: no shared stages to repeat)"
        )
    head = MLPSpeculatorHead(cfg, target, stages)
    raw = read_state_dict(path, error=MLPSpeculatorCheckpointError)
    state, spelled = _stage_tensors(raw, n_predict, stages, tied, where)
    check_keys(head, state, spelled, set(), {}, where, error=MLPSpeculatorCheckpointError)
    head.load_state_dict(state)
    return head.to(getattr(torch, dtype)).eval()


def _source(kind: str, index: int, tied: bool) -> int:
    """The stage whose tensor stage `index` uses."""
    if not tied:
        return index
    return min(index, 1) if kind == "proj" else 0


def _stage_tensors(
    raw: dict[str, torch.Tensor], n_predict: int, stages: int, tied: bool, where: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The file's tensors under the head's names for its `stages` stages (a shared tensor
    under every stage that uses it; stages past `stages` dropped), and each name's spelling
    in the file. Keys that are no stage tensor of this checkpoint pass through as they are,
    for the key check to refuse."""
    state, spelled, sources = {}, {}, {}
    for key, value in raw.items():
        name = key.removeprefix("speculator.")
        match = _KEY.fullmatch(name)
        if match is None or int(match.group(2)) >= n_predict:
            state[name], spelled[name] = value, key
            continue
        kind, index, param = match.group(1), int(match.group(2)), match.group(3)
        shared = f"{kind}.{_source(kind, index, tied)}.{param}"
        if shared in sources and not torch.equal(sources[shared][1], value):
            raise MLPSpeculatorCheckpointError(
                f"{where}: tie_weights is true, but {key!r} differs from {sources[shared][0]!r} (one shared tensor)"
            )
        sources.setdefault(shared, (key, value))
    for shared, (key, value) in sources.items():
        kind, index, param = _KEY.fullmatch(shared).groups()
        for stage in range(stages):
            if _source(kind, stage, tied) == int(index):
                state[f"{kind}.{stage}.{param}"], spelled[f"{kind}.{stage}.{param}"] = value, key
    return state, spelled


# ---------------------------------------------------------------------------- saving


def save_mlp_speculator(head: MLPSpeculatorHead, out: Path | str) -> None:
    """Write `head` as config.json + model.safetensors in the fms-extras / vLLM layout: its
    n_predict stages; with tie_weights each shared tensor once (emb/head/ln 0, proj 0 and 1)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(head.config)
    n_predict, tied = cfg["n_predict"], bool(cfg["tie_weights"])
    if cfg["top_k_tokens_per_head"] is None:
        cfg["top_k_tokens_per_head"] = [1] * n_predict  # chain drafting: one token per stage
    state = {}
    for name, value in head.state_dict().items():
        kind, index, _ = _KEY.fullmatch(name).groups()
        if int(index) < n_predict and (not tied or _source(kind, int(index), tied) == int(index)):
            state[name] = value.detach().contiguous().cpu()
    save_file(state, out / "model.safetensors")
    config = {"model_type": "mlp_speculator", "architectures": ["MLPSpeculatorPreTrainedModel"], **cfg}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------------------- the proposer


class MLPSpeculatorProposer(LastHiddenProposer):
    method = "mlp_speculator"

    @classmethod
    def load_head(cls, config: Any, target: TargetInfo, dtype: str) -> MLPSpeculatorHead:
        return load_mlp_speculator(cls.checkpoint(config), target, dtype, config.num_speculative_tokens)
