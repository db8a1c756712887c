"""What a request asks its output to follow: vLLM's `StructuredOutputsParams`, one kind per
request (vllm/sampling_params.py, `StructuredOutputsParams`, vLLM v0.11)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StructuredKind = Literal["json", "regex", "choice", "grammar", "json_object", "structural_tag"]


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint, as text the grammar backend compiles (and the cache keys on).

    kind "json": `spec` is the JSON schema's text without spaces, keys in the schema's order
    (the output's properties follow it);
    "regex": the pattern; "choice": a JSON list of the allowed strings; "grammar": EBNF / GBNF
    text; "json_object": any JSON object (`spec` is ""); "structural_tag": the tag's JSON text.
    """

    kind: StructuredKind
    spec: str
    whitespace_pattern: str | None = None  # JSON kinds only: the whitespace allowed between tokens
