"""Reading a config.pbtxt text: its string `parameters` (and writing them: what the launcher
patches), the settings the models read alike from them, and its instance group. Who loads what
is topology.py's."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from backends.runtime.model_store import DEFAULT_MODEL, resolve_model


def set_parameter(pbtxt: str, key: str, value: str) -> str:
    """Set (or add) a string parameter in a config.pbtxt text."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    line = f'parameters: {{ key: "{key}" value: {{ string_value: "{escaped}" }} }}'
    pattern = re.compile(r'^parameters:\s*\{\s*key:\s*"' + re.escape(key) + r'".*$', re.M)
    if pattern.search(pbtxt):
        return pattern.sub(lambda _: line, pbtxt, count=1)
    return pbtxt.rstrip("\n") + "\n" + line + "\n"


def get_parameter(pbtxt: str, key: str) -> str | None:
    return parameters(pbtxt).get(key)


def single_instance(pbtxt: str, num_gpus: int | Callable[[], int]) -> bool:
    """Whether the config's instance_group makes exactly one instance (on a host with
    `num_gpus` GPUs: a KIND_GPU group without `gpus` makes one per GPU). `num_gpus` may be a
    function giving the count, called only for such a group (counting GPUs imports torch)."""
    groups = re.findall(r"\{[^{}]*\bkind:\s*KIND_([A-Z]+)[^{}]*\}", pbtxt)
    if len(groups) != 1:
        return False
    group = re.search(r"\{[^{}]*\bkind:\s*KIND_[A-Z]+[^{}]*\}", pbtxt).group(0)
    count = re.search(r"\bcount:\s*(\d+)", group)
    gpus = re.search(r"\bgpus:\s*\[([^\]]*)\]", group)
    per_device = 1 if count is None else int(count.group(1))
    if groups[0] != "GPU":
        return per_device == 1
    if gpus:
        devices = len([g for g in gpus.group(1).split(",") if g.strip()])
    else:
        devices = num_gpus() if callable(num_gpus) else num_gpus
    return per_device * devices == 1


def parameters(pbtxt: str) -> dict[str, str]:
    """All string `parameters` of a config.pbtxt text."""
    found = re.findall(r'key:\s*"((?:[^"\\]|\\.)*)"\s*value:\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"', pbtxt)
    values: dict[str, str] = {}
    for key, value in found:  # the first of a repeated key, as Triton reads it
        values.setdefault(key, value.replace('\\"', '"').replace("\\\\", "\\"))
    return values


def instance_group(pbtxt: str) -> tuple[str, int]:
    """The first instance group's kind ("KIND_CPU", "KIND_GPU", ...; "" when none) and its
    first GPU (0 when it names none)."""
    group = re.search(r"\{[^{}]*\bkind:\s*(KIND_[A-Z]+)[^{}]*\}", pbtxt)
    if group is None:
        return "", 0
    gpus = re.search(r"\bgpus:\s*\[\s*(\d+)", group.group(0))
    return group.group(1), int(gpus.group(1)) if gpus else 0


@dataclass(frozen=True)
class ModelSettings:
    """The config.pbtxt parameters that the speculative, verifier and drafter models read alike."""

    params: dict[str, str]  # all of them, as strings
    target: Path  # the target model (the `model` parameter, else the default model)
    dtype: str
    max_model_len: int | None  # a cap on the target's context window; None: no cap


def model_settings(params: dict[str, str]) -> ModelSettings:
    """A model's settings from its config.pbtxt parameters."""
    return ModelSettings(
        params=params,
        target=resolve_model(params.get("model") or DEFAULT_MODEL),
        dtype=params.get("dtype", "bfloat16"),
        max_model_len=int(params.get("max_model_len") or 0) or None,
    )
