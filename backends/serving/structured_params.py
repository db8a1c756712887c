"""A request's structured-output constraint, read from whichever of vLLM's names carried it.

vLLM's `structured_outputs` (StructuredOutputsParams: `json`, `regex`, `choice`, `grammar`,
`json_object`, `structural_tag`, `whitespace_pattern` and its options), its older
`guided_decoding` (GuidedDecodingParams, the same fields plus `backend`) and the top-level
`guided_*` names its OpenAI server still takes; the Triton vLLM backend sends the first two
as JSON text inside `sampling_parameters`. Exactly one kind per request, as vLLM requires
(vllm/sampling_params.py, `StructuredOutputsParams.__post_init__`, at vLLM commit 00388f65).
Its options are honoured (disable_any_whitespace: this server's default;
disable_additional_properties) or change nothing here (disable_fallback).
"""

from __future__ import annotations

import json
from typing import Any

from backends.serving.request_errors import RequestError, shown
from backends.structured.spec import StructuredKind, StructuredOutputs

# Longest schema / pattern / grammar text accepted: a bound on what is compiled and cached.
MAX_SPEC_CHARS = 2**20
# The grammar backend is the server's choice; a request may name "auto" or the one it runs,
# llguidance, by vLLM's name for it (vLLM V1 also refuses a per-request backend other than the
# engine's).
NEUTRAL_BACKENDS = frozenset({"auto", "guidance"})
# Where a constraint can come from: the objects (their fields are read below) and the top-level
# names, each with the kind it sets.
OBJECT_KEYS = ("structured_outputs", "guided_decoding")
GUIDED_KEYS: dict[str, StructuredKind] = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_KEYS = (*OBJECT_KEYS, *GUIDED_KEYS, "guided_whitespace_pattern", "guided_decoding_backend")
KINDS: tuple[StructuredKind, ...] = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
JSON_KINDS = ("json", "json_object")
# The objects' other fields, all true or false. disable_any_whitespace: JSON without whitespace
# between tokens, this server's default (unless a whitespace_pattern says otherwise);
# disable_additional_properties: a schema's objects hold only the properties they list
# (`_closed`); disable_fallback: there is no other backend to fall back to; backend_was_auto
# and the underscored one are vLLM's own bookkeeping, in a dict dumped from its dataclass.
_FLAGS = (
    "disable_any_whitespace",
    "disable_additional_properties",
    "disable_fallback",
    "backend_was_auto",
    "_backend_was_auto",
)
# JSON Schema keywords (2020-12 and draft-07's `definitions`) holding subschemas, walked by
# `_closed`: a map of names to subschemas, or a subschema or a list of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = (
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "items",
    "prefixItems",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
)


def parse_structured(values: dict[str, Any]) -> StructuredOutputs | None:
    """The one constraint among `values` (the request's keys as sent, None where absent)."""
    found: list[tuple[str, StructuredKind, str]] = []  # (where it came from, kind, spec)
    whitespace: list[tuple[str, str]] = []  # (where, pattern)
    compact: list[str] = []  # where disable_any_whitespace is true
    for key in OBJECT_KEYS:
        if values.get(key) is not None:
            fields = _as_object(key, values[key])
            found += _object_constraints(key, fields)
            if fields.get("whitespace_pattern") is not None:
                whitespace.append((f"{key}.whitespace_pattern", _text(f"{key}.whitespace_pattern", fields)))
            if fields.get("disable_any_whitespace"):
                compact.append(f"{key}.disable_any_whitespace")
    for key, kind in GUIDED_KEYS.items():
        if values.get(key) is not None:
            found.append((key, kind, _spec(key, kind, values[key])))
    if values.get("guided_whitespace_pattern") is not None:
        whitespace.append(("guided_whitespace_pattern", _text("guided_whitespace_pattern", values)))
    _check_backend("guided_decoding_backend", values.get("guided_decoding_backend"))
    if compact and whitespace:
        raise RequestError(f"{compact[0]}=true and {whitespace[0][0]} contradict: send one of them")
    return _one(found, whitespace)


def _one(found: list[tuple[str, StructuredKind, str]], whitespace: list[tuple[str, str]]) -> StructuredOutputs | None:
    if len(found) > 1:
        raise RequestError(
            f"one kind of structured output per request, got {found[0][0]} and {found[1][0]} (send only one)"
        )
    if len({pattern for _, pattern in whitespace}) > 1:
        raise RequestError(f"{whitespace[0][0]} and {whitespace[1][0]} differ: send one whitespace pattern")
    pattern = whitespace[0] if whitespace else None
    if not found:
        if pattern:
            raise RequestError(f"{pattern[0]} needs a json or json_object constraint beside it")
        return None
    where, kind, spec = found[0]
    if pattern and kind not in JSON_KINDS:
        raise RequestError(f"{pattern[0]} applies to json and json_object constraints, not to {where}")
    return StructuredOutputs(kind, spec, pattern[1] if pattern else None)


def _as_object(key: str, value: Any) -> dict[str, Any]:
    """The object's fields: a JSON object, or its JSON text (as the Triton vLLM backend takes it)."""
    if isinstance(value, str):
        value = _loads(key, value)
    if not isinstance(value, dict):
        raise RequestError(f"{key} must be an object (or its JSON text), got {shown(value)}")
    known = (*KINDS, "whitespace_pattern", "backend", "_backend", *_FLAGS)
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise RequestError(f"unknown key {shown(unknown[0])} in {key}; supported: {', '.join(sorted(known))}")
    return value


def _object_constraints(key: str, fields: dict[str, Any]) -> list[tuple[str, StructuredKind, str]]:
    """The constraints an object sets (vLLM counts every kind that is not None), its options checked."""
    for option in _FLAGS:
        if fields.get(option) is not None:
            _flag(f"{key}.{option}", fields[option])
    for option in ("backend", "_backend"):
        _check_backend(f"{key}.{option}", fields.get(option))
    closed = bool(fields.get("disable_additional_properties"))
    found = []
    for kind in KINDS:
        value = fields.get(kind)
        if kind == "json_object" and value is not None and _flag(f"{key}.json_object", value) is False:
            continue  # false asks for nothing (vLLM's backends read it as a truth value)
        if value is not None:
            found.append((f"{key}.{kind}", kind, _spec(f"{key}.{kind}", kind, value, closed)))
    return found


def _spec(where: str, kind: StructuredKind, value: Any, closed: bool = False) -> str:
    """The constraint's text as StructuredOutputs holds it (the grammar cache's key). `closed`:
    a schema's objects (a structural tag's schemas') take no properties beyond those listed."""
    if kind in ("json", "structural_tag"):
        if isinstance(value, str):
            value = _loads(where, value)
        if not isinstance(value, dict):
            raise RequestError(f"{where} must be a JSON object (or its JSON text), got {shown(value)}")
        if closed and kind == "json":
            value = _closed(value)
        elif closed and "format" in value:
            value = {**value, "format": _closed_format(value["format"])}
        elif closed:
            value = {**value, "structures": [_closed_structure(s) for s in value.get("structures") or []]}
        spec = json.dumps(value, separators=(",", ":"))  # keys in order: the output follows it
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise RequestError(f"{where} must be a non-empty list of strings, got {shown(value)}")
        spec = json.dumps(value, separators=(",", ":"))
    elif kind == "json_object":
        spec = ""
    else:  # regex, grammar
        if not isinstance(value, str) or not value:
            raise RequestError(f"{where} must be a non-empty string, got {shown(value)}")
        spec = value
    if len(spec) > MAX_SPEC_CHARS:
        raise RequestError(f"{where} is {len(spec)} characters; at most {MAX_SPEC_CHARS} are accepted")
    return spec


def _closed(schema: Any) -> Any:
    """`schema` with "additionalProperties": false on each object schema that lists properties
    and says nothing of others, at every depth (vLLM's disable_additional_properties for its
    llguidance backend, vllm/v1/structured_output/backend_guidance.py
    `process_for_additional_properties`: llguidance otherwise allows extra properties, as
    JSON Schema does)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for keyword, value in schema.items():
        if keyword in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: _closed(sub) for name, sub in value.items()}
        elif keyword in _SUBSCHEMAS:
            value = _closed(value)
        out[keyword] = value
    lists = isinstance(out.get("properties"), dict) or isinstance(out.get("patternProperties"), dict)
    if lists and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _closed_structure(structure: Any) -> Any:
    """A structural tag's structure with its schema `_closed` (a malformed one is left to the compiler)."""
    if isinstance(structure, dict) and "schema" in structure:
        return {**structure, "schema": _closed(structure["schema"])}
    return structure


def _closed_format(node: Any) -> Any:
    """A structural tag's format tree with the schema of each json_schema format `_closed`, at
    any depth (a tag's content, a sequence's elements, triggered_tags' tags, ...)."""
    if isinstance(node, list):
        return [_closed_format(n) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        return {**node, "json_schema": _closed(node["json_schema"])}
    return {key: _closed_format(value) for key, value in node.items()}


def _text(where: str, fields: dict[str, Any]) -> str:
    value = fields[where.rpartition(".")[2]]
    if not isinstance(value, str):
        raise RequestError(f"{where} must be a string (a regular expression), got {shown(value)}")
    return value


def _flag(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"{where} must be true or false, got {shown(value)}")
    return value


def _check_backend(where: str, value: Any) -> None:
    if value is not None and value != "" and value not in NEUTRAL_BACKENDS:
        raise RequestError(
            f"{where}={shown(value)}: the grammar backend is the server's choice, not the request's "
            '(leave it out or send "auto")'
        )


def _loads(where: str, text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise RequestError(f"{where} is not valid JSON: {str(e)[:200]}") from None
