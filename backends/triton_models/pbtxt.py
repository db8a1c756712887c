"""Reading and writing string `parameters` of a config.pbtxt text (what the launcher patches
and what the orchestrator reads of its drafter's and verifier's entries at load)."""

from __future__ import annotations

import re


def set_parameter(pbtxt: str, key: str, value: str) -> str:
    """Set (or add) a string parameter in a config.pbtxt text."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    line = f'parameters: {{ key: "{key}" value: {{ string_value: "{escaped}" }} }}'
    pattern = re.compile(r'^parameters:\s*\{\s*key:\s*"' + re.escape(key) + r'".*$', re.M)
    if pattern.search(pbtxt):
        return pattern.sub(lambda _: line, pbtxt, count=1)
    return pbtxt.rstrip("\n") + "\n" + line + "\n"


def get_parameter(pbtxt: str, key: str) -> str | None:
    m = re.search(r'key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"', pbtxt)
    return None if m is None else m.group(1).replace('\\"', '"').replace("\\\\", "\\")


def single_instance(pbtxt: str, num_gpus: int) -> bool:
    """Whether the config's instance_group makes exactly one instance (on a host with
    `num_gpus` GPUs: a KIND_GPU group without `gpus` makes one per GPU)."""
    groups = re.findall(r"\{[^{}]*\bkind:\s*KIND_([A-Z]+)[^{}]*\}", pbtxt)
    if len(groups) != 1:
        return False
    group = re.search(r"\{[^{}]*\bkind:\s*KIND_[A-Z]+[^{}]*\}", pbtxt).group(0)
    count = re.search(r"\bcount:\s*(\d+)", group)
    gpus = re.search(r"\bgpus:\s*\[([^\]]*)\]", group)
    per_device = 1 if count is None else int(count.group(1))
    if groups[0] != "GPU":
        return per_device == 1
    devices = len([g for g in gpus.group(1).split(",") if g.strip()]) if gpus else num_gpus
    return per_device * devices == 1
