"""`medusa`: Medusa-1 heads draft k tokens at once from the target's last hidden state.

Head h (0-based) reads the target's final normed state f_t (layer id -1, what the target's LM
head reads; Medusa ignores the token x_{t+1} that f_t produced) and predicts x_{t+2+h}:
z = f_t, then for each of the head's L blocks z = z + SiLU(W z + b), and logits = W_h z. The
drafts are the top-1 of heads 0..k-1 (vLLM's chain mode: https://github.com/vllm-project/vllm/blob/c314af1abfddff7b6cce9af578be72c496c6a5e4/vllm/v1/spec_decode/medusa.py;
the heads of FasterDecoding/Medusa's medusa/model/medusa_model.py, arXiv 2401.10774). With `draft_sample_method:
probabilistic` each head's token is sampled from its softmax and sent with it (a head's
distribution does not depend on the earlier drafts, which rejection sampling allows).

Checkpoint layouts, decided from the keys (never the name):
- FasterDecoding (`medusa_lm_head.safetensors` / `medusa_lm_head.pt`, keys optionally prefixed
  `medusa_head.`): `{h}.{l}.linear.weight` [H, H] and `.bias` [H] for l < L, `{h}.{L}.weight`
  [V, H]. Old config.json files hold only `medusa_num_heads` / `medusa_num_layers` (one
  official upload under-reports the heads), so heads, L, H and V are read from the tensors.
- vLLM-converted (`model_type: medusa`, `hidden_size`, `vocab_size`, `num_heads`,
  `num_hidden_layers`, optional `medusa_fc_bias`, `original_lm_head`, `truncated_vocab_size`):
  `blocks.{h}.layers.{l}.weight` (+ `.bias`), `lm_heads.{h}.weight` (only `lm_heads.0` with
  `original_lm_head`), optional `token_map` [V_d] (target id of each draft id).

The head count is `num_speculative_tokens` as in vLLM: heads beyond it are not loaded. Unlike
vLLM, which leaves missing heads uninitialised, a checkpoint with fewer heads is refused.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backends.config import DrafterConfig
from backends.methods.head_checkpoint import Checkpoint, HeadCheckpointError, TargetInfo, check_keys, read_state_dict
from backends.methods.last_hidden import LastHiddenProposer
from backends.runtime import linear_kernels
from backends.runtime.lean_lm import KernelLinear
from backends.serving.proposer import Draft, DraftRequest, ProposerContext
from backends.serving.request import is_greedy
from backends.serving.tree import DraftTree, best_nodes, path_scores

LAYOUTS = ("vllm", "medusa")  # vLLM-converted, FasterDecoding
_BLOCK = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")  # FasterDecoding keys
_HEAD = re.compile(r"(\d+)\.(\d+)\.weight")
# At most this many rows (sequences x heads) run every head's weights at once (one pass over
# them, each head's block of the result kept): 0.83 against 0.97 ms for three 8192 x 576 LM heads
# at 1 row, cold caches, on the 2-core EPYC here; a pass at 12 rows costs more than three at 4.
STACKED_ROWS = 6  # cpu_kernels.c's TILE_ROWS: the rows one pass keeps in registers


class MedusaCheckpointError(HeadCheckpointError):
    """A Medusa checkpoint that is malformed or does not fit the target."""


class _Blocks(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))


class MedusaHead(nn.Module):
    """Medusa-1 heads under vLLM's parameter names. `config` (vLLM's Medusa fields):
    `num_heads`, `num_hidden_layers`, `medusa_fc_bias` (default true: the FasterDecoding
    blocks have biases), `original_lm_head` (one shared LM head), `truncated_vocab_size` (a
    draft vocabulary mapped to the target's by `token_map`)."""

    def __init__(self, config: dict[str, Any], target: TargetInfo) -> None:
        super().__init__()
        h = target.hidden_size
        self.num_heads = config["num_heads"]
        self.num_layers = config["num_hidden_layers"]
        self.bias = bool(config.get("medusa_fc_bias", True))
        self.shared_lm_head = bool(config.get("original_lm_head", False))
        vocab = config.get("truncated_vocab_size") or target.vocab_size
        self.target_hidden_size, self.target_vocab_size = h, target.vocab_size
        self.blocks = nn.ModuleList(_Blocks(h, self.num_layers, self.bias) for _ in range(self.num_heads))
        self.lm_heads = nn.ModuleList(
            nn.Linear(h, vocab, bias=False) for _ in range(1 if self.shared_lm_head else self.num_heads)
        )
        # [V_d] target id of each draft id; None: the draft vocabulary is the target's.
        self.register_buffer("token_map", torch.arange(vocab) if vocab != target.vocab_size else None)

    @property
    def num_steps(self) -> int:
        return self.num_heads

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        return self.token_map

    @draft_to_target.setter
    def draft_to_target(self, token_ids: torch.Tensor) -> None:  # a speculative_token_map (draft_vocab.py)
        self.token_map = token_ids

    def head_logits(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        z = hidden
        for linear in self.blocks[index].layers:
            z = z + F.silu(linear(z))
        return self.lm_heads[0 if self.shared_lm_head else index](z)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every head's logits [..., num_heads, V_d] for final hidden states [..., H_t]."""
        return torch.stack([self.head_logits(i, hidden) for i in range(self.num_heads)], dim=-2)

    # The LastHiddenProposer protocol: head i reads the same state, whatever the drafts.
    def begin(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def step(self, index: int, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head_logits(index, state), state


class _StackedLinear:
    """The same-shaped bf16 linear layers [N, K] of every head in one packed weight for
    `linear_kernels.packed_linear`, each head's N outputs padded to whole packed groups, so that a
    head's part is a packed weight of its own. The kernel sums every output alone, in K order,
    whatever the rows and the outputs beside it: any part gives the bits the head's own
    `KernelLinear` gives."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        n, k = linears[0].weight.shape
        self.heads, self.n = len(linears), n
        self.padded = -(-n // linear_kernels.GROUP) * linear_kernels.GROUP
        weight = torch.zeros(self.heads, self.padded, k, dtype=torch.bfloat16)
        bias = torch.zeros(self.heads, self.padded, dtype=torch.bfloat16)
        for h, linear in enumerate(linears):
            weight[h, :n] = linear.weight.detach()
            if linear.bias is not None:
                bias[h, :n] = linear.bias.detach()
        self.packed = linear_kernels.pack_linear(weight.view(-1, k))
        self.bias = bias.view(-1) if linears[0].bias is not None else None

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """Every head's layer on the same rows x [M, K]: [M, heads, N], one call."""
        y = linear_kernels.packed_linear(x, self.packed, self.heads * self.padded, self.bias)
        return y.view(len(x), self.heads, self.padded)[..., : self.n]

    def each(self, x: torch.Tensor) -> torch.Tensor:
        """Head h's layer on x[:, h] for x [M, heads, K]: [M, heads, N]."""
        m, heads, k = x.shape
        if m * heads <= STACKED_ROWS:  # one pass over all the weights, each head's block kept
            y = linear_kernels.packed_linear(x.reshape(m * heads, k), self.packed, heads * self.padded, self.bias)
            return y.view(m, heads, heads, self.padded).diagonal(dim1=1, dim2=2).transpose(1, 2)[..., : self.n]
        part = self.padded * k
        return torch.stack(
            [
                linear_kernels.packed_linear(
                    x[:, h],
                    self.packed[h * part : (h + 1) * part],
                    self.n,
                    None if self.bias is None else self.bias[h * self.padded : (h + 1) * self.padded],
                )
                for h in range(heads)
            ],
            dim=1,
        )


class StackedHeads:
    """Every head of a bf16 `MedusaHead` at once (the proposer's drafting path on the CPU): the
    first blocks of all heads read the same state, so they are one call over their stacked
    weights; later blocks and the LM heads read each head's own state, in one call where few
    rows are asked (`STACKED_ROWS`). The same bits as the head's `forward`."""

    def __init__(self, head: MedusaHead) -> None:
        self.num_heads = head.num_heads
        self.blocks = [_StackedLinear([b.layers[i] for b in head.blocks]) for i in range(head.num_layers)]
        self.lm_heads = None if head.shared_lm_head else _StackedLinear(list(head.lm_heads))
        self.shared_lm_head = head.lm_heads[0]

    @staticmethod
    def runs(head: MedusaHead) -> bool:
        """Are all the head's linear layers on the packed bf16 kernel (not int8)?"""
        linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
        return all(type(m) is KernelLinear and not m.int8 and m.weight.dtype == torch.bfloat16 for m in linears)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every head's logits [B, num_heads, V_d] for final states `hidden` [B, H_t]."""
        z = hidden[:, None].expand(-1, self.num_heads, -1)
        for i, blocks in enumerate(self.blocks):
            z = z + F.silu(blocks.shared(hidden) if i == 0 else blocks.each(z))
        if self.lm_heads is None:
            return self.shared_lm_head(z)
        return self.lm_heads.each(z.contiguous())


# ---------------------------------------------------------------------------- loading


def load_medusa(
    path: Path | str | Checkpoint, target: TargetInfo, dtype: str = "bfloat16", num_heads: int | None = None
) -> MedusaHead:
    """Load a Medusa checkpoint directory (either layout; a Checkpoint comes with its
    config.json already read) for `target`, keeping its first `num_heads` heads (default: all)."""
    path, cfg = Checkpoint.open(path, MedusaCheckpointError)
    where = f"Medusa checkpoint {path}"
    raw = read_state_dict(path, bins=("medusa_lm_head.pt", "pytorch_model*.bin"), error=MedusaCheckpointError)
    state, spelled = {}, {}
    for key, value in raw.items():
        name = key.removeprefix("medusa_head.").removeprefix("model.")
        state[name], spelled[name] = value, key
    faster = any(_BLOCK.fullmatch(k) or _HEAD.fullmatch(k) for k in state)
    if faster:
        state, spelled, layers = _from_faster_decoding(state, spelled, where)
        bias = any(k.endswith(".bias") for k in state)
    else:
        layers = _count(state, r"blocks\.0\.layers\.(\d+)\.weight")
        bias = cfg.get("medusa_fc_bias", any(k.endswith(".bias") for k in state))
    found = max(_count(state, r"lm_heads\.(\d+)\.weight"), _count(state, r"blocks\.(\d+)\.layers\.0\.weight"))
    if found == 0:
        raise MedusaCheckpointError(
            f"{where}: no Medusa heads: expected 'lm_heads.{{h}}.weight' (vLLM layout) or '{{h}}.{{L}}.weight' "
            f"(FasterDecoding layout) keys; found {sorted(spelled.values())[:5]}"
        )
    keep = found if num_heads is None else num_heads
    if keep > found:
        raise MedusaCheckpointError(
            f"{where}: num_speculative_tokens={keep} needs {keep} Medusa heads, but the checkpoint has {found}"
        )
    if cfg.get("hidden_size", target.hidden_size) != target.hidden_size:
        raise MedusaCheckpointError(
            f"{where}: hidden_size {cfg['hidden_size']} in config.json, but the target's "
            f"hidden size is {target.hidden_size}"
        )
    config = {
        "num_heads": keep,
        "num_hidden_layers": layers,
        "medusa_fc_bias": bool(bias),
        "original_lm_head": bool(cfg.get("original_lm_head", False)),
    }
    token_map = state.get("token_map")
    if token_map is not None and len(token_map) < target.vocab_size:
        config["truncated_vocab_size"] = len(token_map)
    else:
        state.pop("token_map", None)  # absent, or the whole vocabulary: nothing to map
    head = MedusaHead(config, target)
    # Heads beyond the kept ones are not loaded (vLLM: num_heads = num_speculative_tokens).
    head_of = re.compile(r"(?:blocks|lm_heads)\.(\d+)\..*")
    state = {k: v for k, v in state.items() if not ((m := head_of.fullmatch(k)) and int(m.group(1)) >= keep)}
    spell = (lambda k: _faster_decoding_key(k, layers)) if faster else None
    check_keys(head, state, spelled, set(), {}, where, spell, error=MedusaCheckpointError)
    head.load_state_dict(state)
    if head.token_map is not None:
        _check_token_map(head.token_map, target.vocab_size, where)
    return head.to(getattr(torch, dtype)).eval()


def _count(state: dict[str, torch.Tensor], pattern: str) -> int:
    """1 + the largest index matching `pattern` (0 when none does)."""
    found = [int(m.group(1)) for k in state if (m := re.fullmatch(pattern, k))]
    return max(found) + 1 if found else 0


def _from_faster_decoding(
    state: dict[str, torch.Tensor], spelled: dict[str, str], where: str
) -> tuple[dict[str, torch.Tensor], dict[str, str], int]:
    """FasterDecoding keys under vLLM's names, and the number of blocks per head."""
    layers = {int(m.group(1)): int(m.group(2)) for k in state if (m := _HEAD.fullmatch(k))}
    out, names = {}, {}
    for key, value in state.items():
        if m := _BLOCK.fullmatch(key):
            name = f"blocks.{m.group(1)}.layers.{m.group(2)}.{m.group(3)}"
        elif m := _HEAD.fullmatch(key):
            name = f"lm_heads.{m.group(1)}.weight"
        else:
            name = key  # refused by the key check, under its own spelling
        out[name], names[name] = value, spelled[key]
    depths = set(layers.values())
    if len(depths) > 1:
        per_head = ", ".join(f"head {h}: '{h}.{n}.weight'" for h, n in sorted(layers.items()))
        raise MedusaCheckpointError(f"{where}: the heads have different numbers of blocks ({per_head})")
    return out, names, depths.pop() if depths else 0


def _check_token_map(token_map: torch.Tensor, vocab_size: int, where: str) -> None:
    if token_map.min() < 0 or token_map.max() >= vocab_size or len(token_map.unique()) != len(token_map):
        raise MedusaCheckpointError(
            f"{where}: token_map maps draft ids outside [0, {vocab_size}) or two draft ids to one target id"
        )


# ---------------------------------------------------------------------------- saving


def save_medusa(head: MedusaHead, out: Path | str, layout: str = "vllm", base_model: str | None = None) -> None:
    """Write `head` as config.json + model.safetensors in the vLLM-converted layout (detected
    as medusa by its model_type), or `layout="medusa"`: FasterDecoding's
    medusa_lm_head.safetensors with a `medusa_num_heads` / `medusa_num_layers` config."""
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    if layout == "vllm":
        config = {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "hidden_size": head.target_hidden_size,
            "vocab_size": head.target_vocab_size,
            "num_heads": head.num_heads,
            "num_hidden_layers": head.num_layers,
            "medusa_fc_bias": head.bias,
            "original_lm_head": head.shared_lm_head,
        }
        if head.token_map is not None:
            config["truncated_vocab_size"] = len(head.token_map)
        name = "model.safetensors"
    else:
        if head.shared_lm_head or head.token_map is not None or not head.bias:
            raise ValueError(
                "the FasterDecoding layout has a biased block and an own full-vocabulary LM head "
                "per head; save this head with layout='vllm'"
            )
        state = {_faster_decoding_key(k, head.num_layers): v for k, v in state.items()}
        config = {
            "medusa_num_heads": head.num_heads,
            "medusa_num_layers": head.num_layers,
            "base_model_name_or_path": base_model,
        }
        name = "medusa_lm_head.safetensors"
    save_file(state, out / name)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _faster_decoding_key(name: str, num_layers: int) -> str:
    if m := re.fullmatch(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)", name):
        return f"{m.group(1)}.{m.group(2)}.linear.{m.group(3)}"
    if m := re.fullmatch(r"lm_heads\.(\d+)\.weight", name):
        return f"{m.group(1)}.{num_layers}.weight"
    return name


# ---------------------------------------------------------------------------- the proposer


class MedusaProposer(LastHiddenProposer):
    """Medusa heads; with `speculative_token_tree`, a static tree (Medusa's tree choices): node
    path (r_0, ..., r_d) drafts head d's rank-r_d token (every head reads the same state, so
    the heads run once for the whole tree)."""

    method = "medusa"
    token_tree: tuple[tuple[int, ...], ...] | None = None

    @classmethod
    def from_config(cls, config: DrafterConfig, ctx: ProposerContext) -> MedusaProposer:
        proposer = super().from_config(config, ctx)
        proposer.token_tree = config.speculative_token_tree
        return proposer

    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest]) -> list[Draft]:
        trees = [i for i, req in enumerate(batch) if self._tree_paths(req)]
        chains = [i for i in range(len(batch)) if i not in trees]
        drafts = [Draft() for _ in batch]
        for i, draft in zip(chains, super().propose([batch[i] for i in chains]) if chains else []):
            drafts[i] = draft
        if trees:
            states = torch.stack([self._last_state(batch[i]) for i in trees]).to(self.device, self.dtype)
            logits = self.heads_logits(states)  # [trees, heads, V_d]: every level's ranking at once
            for i, probs in zip(trees, logits.float().softmax(dim=-1)):
                drafts[i] = self._tree(self._tree_paths(batch[i]), batch[i].num_nodes, probs)
        return drafts

    def draft_steps(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        num_steps: int,
        temperatures: list[float],
        generators: list[torch.Generator | None],
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Every head at once; greedy drafts in one argmax, sampled ones head by head (each
        head's draws from the generators in the order of the step-by-step drafting)."""
        logits = self.heads_logits(hidden)[:, :num_steps]  # [B, steps, V_d]
        if self.sample_method == "greedy" or all(is_greedy(t) for t in temperatures):
            ids, _ = self.sample(logits, temperatures, generators)
            return [(ids[:, step], None) for step in range(num_steps)]
        return [self.sample(logits[:, step], temperatures, generators) for step in range(num_steps)]

    def heads_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every head's logits [B, heads, V_d] for final states `hidden` [B, H_t]."""
        return self.head(hidden) if self.stacked is None else self.stacked(hidden)

    @cached_property
    def stacked(self) -> StackedHeads | None:
        """The heads stacked for the packed kernel, where all their layers run on it (looked at
        on first use: `from_config` may turn them int8 after construction)."""
        return StackedHeads(self.head) if StackedHeads.runs(self.head) else None

    def _tree_paths(self, req: DraftRequest) -> list[tuple[int, ...]]:
        """The static tree's paths within this step's depth; empty: draft a chain."""
        if not req.num_nodes or self.token_tree is None or req.hidden_states is None:
            return []
        depth = min(req.num_draft_tokens, self.max_model_len - len(req.token_ids), self.head.num_steps)
        return [path for path in self.token_tree if len(path) <= depth]

    def _tree(self, paths: list[tuple[int, ...]], num_nodes: int, probs: torch.Tensor) -> Draft:
        """The `num_nodes` paths of the highest cumulative probability under the heads'
        distributions `probs` [heads, V_d] (Medusa's tree choices rank paths by the heads'
        accuracy; this ranks them by the heads' confidence this step), node tokens mapped to
        target ids."""
        ranks = max(p[-1] for p in paths) + 1
        ranked = probs.argsort(dim=-1, descending=True, stable=True)[:, :ranks]  # [heads, ranks]
        ranked_probs = probs.gather(1, ranked).tolist()
        scores = path_scores(paths, lambda depth, rank: ranked_probs[depth][rank])
        kept = best_nodes(scores, [len(p) for p in paths], num_nodes)
        paths = [paths[i] for i in kept]
        ids = ranked[[len(p) - 1 for p in paths], [p[-1] for p in paths]]
        if self.head.draft_to_target is not None:
            ids = self.head.draft_to_target[ids]
        tree = DraftTree.from_paths(paths, ids.tolist())
        return Draft(list(tree.token_ids), None, list(tree.parents), [scores[i] for i in kept])

    @classmethod
    def load_head(cls, config: Any, target: TargetInfo, dtype: str) -> MedusaHead:
        return load_medusa(cls.checkpoint(config), target, dtype, config.num_speculative_tokens)
