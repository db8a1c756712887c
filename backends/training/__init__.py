"""Drafter-head training (`tritonspec train`): the corpus, the target's data, one loop, and
one HeadTrainer per method. Importing this package stays light (no torch)."""

from __future__ import annotations

from pathlib import Path

from backends.runtime.model_store import cache_dir

# method -> "module:Class" of its HeadTrainer (backends/training/trainer.py).
TRAINERS: dict[str, str] = {
    "eagle": "backends.training.eagle:Eagle1Trainer",
    "eagle3": "backends.training.eagle:Eagle3Trainer",
    "medusa": "backends.training.last_hidden:MedusaTrainer",
    "mlp_speculator": "backends.training.last_hidden:MLPSpeculatorTrainer",
    "mtp": "backends.training.mtp:MTPTrainer",
    "dflash": "backends.training.blocks:DFlashTrainer",
    "dspark": "backends.training.blocks:DSparkTrainer",
}


# `tritonspec train METHOD` without --self-prompts / --epochs: eagle3's recipe is sized to end
# within 30 minutes on 2 cores from an empty cache (docs/training.md has the measured stages).
RECIPES: dict[str, dict[str, int]] = {"eagle3": {"self_prompts": 500, "epochs": 4}}
DEFAULT_RECIPE: dict[str, int] = {"self_prompts": 0, "epochs": 3}


# Beside an eagle, mtp or mlp_speculator head: the most frequent tokens of its training answers,
# a speculative_token_map the trained-head lookups serve it with (backends/methods/draft_vocab.py).
TOKEN_MAP_FILE = "token_map.json"


def recipe(method: str) -> dict[str, int]:
    """The method's default training recipe: target-written prompts and epochs."""
    return RECIPES.get(method, DEFAULT_RECIPE)


def head_dir(target: str, method: str) -> Path:
    """Where `tritonspec train` puts a target's head by default (and profiles look for it)."""
    return cache_dir() / "heads" / f"{Path(target).name}-{method}"


def data_dir(target: str, dtype: str = "bfloat16") -> Path:
    """The cached target answers and hidden states, shared by every method's training: made on
    the lean runtime in `dtype` (the transformers-made data of earlier versions sits beside
    it, under the target's bare name, and is not read)."""
    return cache_dir() / "train-data" / f"{Path(target).name}-lean-{dtype}"
