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


def head_dir(target: str, method: str) -> Path:
    """Where `tritonspec train` puts a target's head by default (and profiles look for it)."""
    return cache_dir() / "heads" / f"{Path(target).name}-{method}"


def data_dir(target: str) -> Path:
    """The cached target answers and hidden states, shared by every method's training."""
    return cache_dir() / "train-data" / Path(target).name
