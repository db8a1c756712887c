"""Reading drafter-head checkpoints, shared by every head family (EAGLE, EAGLE-3, MTP,
Medusa, MLP speculator, DFlash, DSpark): the target a head drafts for, a checkpoint's
config.json and tensors, and the key-by-key check that names whatever does not fit. Each
family raises its own subclass of `HeadCheckpointError`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from backends.config import speculators_draft_config
from backends.runtime.model_store import load_causal_lm, model_config, read_safetensors


class HeadCheckpointError(ValueError):
    """A head checkpoint that does not fit the layout it claims or the target it drafts for."""


@dataclass
class TargetInfo:
    """What a head needs to know about (and borrow from) its target."""

    path: Path
    hidden_size: int
    vocab_size: int
    num_layers: int

    @classmethod
    def load(cls, path: Path | str) -> TargetInfo:
        path = Path(path)
        cfg = model_config(path).get_text_config()
        return cls(path, cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers)

    def weight(self, which: str) -> torch.Tensor:
        """The target's "embed" or "lm_head" weight, read alone from its safetensors when
        possible (a full load only for other formats)."""
        names = {
            "embed": ("model.embed_tokens.weight", "embed_tokens.weight"),
            "lm_head": ("lm_head.weight", "model.embed_tokens.weight"),
        }[which]  # tied: embed
        if self.path.is_dir():
            from safetensors import safe_open

            for name in names:
                for file in sorted(self.path.glob("*.safetensors")):
                    with safe_open(file, "pt") as st:
                        if name in st.keys():
                            return st.get_tensor(name)
        model = load_causal_lm(self.path, "float32")
        module = model.get_input_embeddings() if which == "embed" else model.get_output_embeddings()
        return module.weight.detach()


def read_state_dict(
    path: Path,
    bins: tuple[str, ...] = ("pytorch_model*.bin",),
    keep: Callable[[str], bool] | None = None,
    error: type[HeadCheckpointError] = HeadCheckpointError,
) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint directory: *.safetensors, else the files matching `bins`;
    only the keys `keep` accepts when given (safetensors then reads nothing else, so heads
    stored inside a large target checkpoint load without it)."""
    files = sorted(path.glob("*.safetensors"))
    if files:
        return read_safetensors(files, keep)
    files = sorted({f for pattern in bins for f in path.glob(pattern)})
    if not files:
        raise error(f"{path}: no *.safetensors or {' / '.join(bins)}")
    return {
        k: v
        for f in files
        for k, v in torch.load(f, map_location="cpu", weights_only=True).items()
        if keep is None or keep(k)
    }


def read_config(path: Path, error: type[HeadCheckpointError] = HeadCheckpointError) -> dict[str, Any]:
    """config.json, with the speculators format flattened as vLLM does."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"{path}: cannot read config.json: {e}") from e
    return speculators_draft_config(cfg, str(path)) if "speculators_model_type" in cfg else cfg


class Checkpoint(NamedTuple):
    """A head checkpoint directory and its config.json (speculators format flattened). Loaders
    take one in place of a path when the speculative config resolution has read that file
    (DrafterConfig.checkpoint_config), so a served head's config.json is read once."""

    path: Path
    config: dict[str, Any]

    @classmethod
    def open(
        cls, source: Path | str | Checkpoint, error: type[HeadCheckpointError] = HeadCheckpointError
    ) -> Checkpoint:
        """`source` with its config.json: a Checkpoint's own (a copy, as loaders edit it), else
        read from the directory (training, export and tests load by path)."""
        if isinstance(source, Checkpoint):
            return cls(source.path, copy.deepcopy(source.config))
        path = Path(source)
        return cls(path, read_config(path, error))


def read_head_state(
    path: Path, error: type[HeadCheckpointError] = HeadCheckpointError
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The checkpoint's tensors (`read_state_dict`) keyed as the head names them (no `model.`
    prefix, `midlayer.` = `layers.0.`), and each one's spelling in the file for error messages."""
    out, spelled = {}, {}
    for key, value in read_state_dict(path, error=error).items():
        name = key.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        out[name], spelled[name] = value, key
    return out, spelled


def check_keys(
    head: nn.Module,
    state: dict[str, torch.Tensor],
    spelled: dict[str, str],
    optional: set[str],
    extra: dict[str, tuple[int, ...]],
    where: str,
    spell: Callable[[str], str] | None = None,
    error: type[HeadCheckpointError] = HeadCheckpointError,
) -> None:
    """Refuse missing, unexpected or misshapen tensors, naming each one (a missing key as
    `spell` writes it in the checkpoint's layout, when given) with an `error`."""
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    expected.update(extra)
    spell = spell or (lambda k: k)
    problems = [
        f"missing key {spell(k)!r} (expected shape {list(shape)})"
        for k, shape in expected.items()
        if k not in state and k not in optional and k not in extra
    ]
    for key, value in state.items():
        if key not in expected:
            problems.append(f"unexpected key {spelled[key]!r} (shape {list(value.shape)})")
        elif tuple(value.shape) != expected[key]:
            problems.append(f"{spelled[key]!r} has shape {list(value.shape)}, expected {list(expected[key])}")
    if problems:
        raise error(f"{where} does not fit the target: " + "; ".join(problems))


def load_checked(
    head: nn.Module,
    state: dict[str, torch.Tensor],
    spelled: dict[str, str],
    target: TargetInfo,
    where: str,
    error: type[HeadCheckpointError],
    borrowed: Collection[str] = (),
    defaults: dict[str, torch.Tensor] | None = None,
) -> None:
    """Load `state` into `head` once it fits (`check_keys`): the `borrowed` keys it lacks are
    the target's weights (its embedding for embed_tokens, else its LM head), the `defaults` it
    lacks those values. A head with a draft vocabulary (a `d2t` buffer) may come with the t2d
    of its training, dropped here, and gets its checked `draft_to_target`."""
    defaults = defaults or {}
    vocab = hasattr(head, "d2t")
    extra = {"t2d": (target.vocab_size,)} if vocab else {}
    check_keys(head, state, spelled, {*borrowed, *defaults}, extra, where, error=error)
    for key in borrowed:
        if key not in state:
            state[key] = target.weight("embed" if key.startswith("embed") else "lm_head")
    for key, value in defaults.items():
        state.setdefault(key, value)
    state.pop("t2d", None)  # a training artefact
    head.load_state_dict(state)
    if vocab:
        head.draft_to_target = draft_to_target(head.d2t, target.vocab_size, where, error)


def draft_to_target(
    d2t: torch.Tensor, vocab_size: int, where: str, error: type[HeadCheckpointError] = HeadCheckpointError
) -> torch.Tensor:
    """Target ids of the draft vocabulary (target id = draft id + d2t[draft id]), checked."""
    ids = torch.arange(len(d2t)) + d2t.long()
    if ids.min() < 0 or ids.max() >= vocab_size or len(ids.unique()) != len(ids):
        raise error(f"{where}: d2t maps draft ids outside [0, {vocab_size}) or two draft ids to one target id")
    return ids
