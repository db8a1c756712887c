"""Reading and writing string `parameters` of a config.pbtxt text (what the launcher patches
and what the orchestrator reads of its drafter's entry at load)."""

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
