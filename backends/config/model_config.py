"""A model directory's config.json as the speculative config reads it (target and draft),
and the values read from it."""

from __future__ import annotations

import json
import os
from typing import Any

from backends.config.detect import hf_lookup
from backends.config.errors import SpeculativeConfigError
from backends.runtime.model_store import unnamable


def read_model_config(path: str | None, field_name: str) -> dict[str, Any]:
    """A local directory's config.json; {} for None or a bare name (nothing to read)."""
    if path is not None and (why := unnamable(path)):
        raise SpeculativeConfigError(f"{field_name}: {why}")
    if path is None or not os.path.isdir(path):
        return {}
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SpeculativeConfigError(f"{field_name}: cannot read {config_path}: {e}") from e
    if not isinstance(config, dict):
        raise SpeculativeConfigError(f"{field_name}: {config_path} is not a JSON object")
    return config


def text_model_type(cfg: dict[str, Any]) -> str | None:
    text = cfg.get("text_config")
    return text.get("model_type") if isinstance(text, dict) else cfg.get("model_type")


def max_position_embeddings(cfg: dict[str, Any]) -> int | None:
    return hf_lookup(cfg, "max_position_embeddings")
