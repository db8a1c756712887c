"""vLLM's structural_tag as an llguidance grammar, in either of the forms vLLM hands to xgrammar
(vllm/v1/structured_output/backend_xgrammar.py `compile_grammar`, vLLM commit 030141c1):

- `{"type": "structural_tag", "format": {...}}`: a tree of xgrammar's format objects
  (python/xgrammar/structural_tag.py, cpp/structural_tag.cc and
  docs/structural_tag/structural_tag.md at xgrammar commit 53da3ff8);
- the legacy `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`, read as xgrammar
  reads it: a `triggered_tags` format of `tag`s with `json_schema` content
  (`StructuralTag.from_legacy_structural_tag`).

llguidance 1.9.1 compiles neither tree itself (its StructTag is the legacy form only), so the
tree becomes a Lark grammar here. llguidance lexes greedily: a lexeme of free text followed by a
separate end-string lexeme would swallow the end. So text of unbounded length (`any_text`, the
free text of `triggered_tags`) is one lexeme with the string that closes it (its tag's end),
the end xgrammar itself gives such a format (its "end detection": the enclosing tag's end
strings join the text's excludes). Such a format must then end its tag or the output; one that
something else follows is refused. Formats matched on tokens rather than text, and the ones
listed in UNSUPPORTED, are refused by name.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from backends.serving.request_errors import shown

# xgrammar's other format types, and why each is refused.
_TOKEN_LEVEL = "token-level formats are not served (the grammar here matches text)"
UNSUPPORTED = {
    "token": _TOKEN_LEVEL,
    "exclude_token": _TOKEN_LEVEL,
    "any_tokens": _TOKEN_LEVEL,
    "token_triggered_tags": _TOKEN_LEVEL,
    "token_dispatch": _TOKEN_LEVEL,
    "dispatch": "dispatch is not served (triggered_tags is)",
    "qwen_xml_parameter": "XML-style parameters are not served (json_schema with style json is)",
}
# The format types served, each with the fields it may carry besides `type` (xgrammar's models).
_FIELDS = {
    "const_string": ("value",),
    "json_schema": ("json_schema", "style", "any_order", "max_whitespace_cnt"),
    "any_text": ("excludes", "max_tokens", "max_chars"),
    "grammar": ("grammar",),
    "regex": ("pattern",),
    "sequence": ("elements",),
    "or": ("elements",),
    "optional": ("content",),
    "plus": ("content",),
    "star": ("content",),
    "repeat": ("min", "max", "content"),
    "tag": ("begin", "content", "end"),
    "triggered_tags": ("triggers", "tags", "at_least_one", "stop_after_first", "excludes"),
    "tags_with_separator": ("tags", "separator", "at_least_one", "stop_after_first"),
}
SUPPORTED = tuple(_FIELDS)
MAX_DEPTH = 32  # nesting of formats (xgrammar guards its recursion too)
MAX_COUNT = 2**31 - 1  # repeat bounds and any_text's max_chars, as xgrammar bounds them

# What follows a format, which `_Lark.emit` gets: None, the output's end; a tuple of strings,
# the end strings of the enclosing tag, one of which the format's own lexemes take at their end;
# THEN, another format (nothing taken here, and text of unbounded length refused).
THEN: tuple[str, ...] = ()


class StructuralTagError(ValueError):
    """A structural tag refused: where in the request's `structural_tag`, and why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")


def structural_tag_grammar(tag: Any, json_options: dict[str, Any]) -> str:
    """The llguidance grammar (its JSON text) of a request's structural_tag, either form.
    `json_options`: the x-guidance options its JSON schemas get (a schema's own win)."""
    if not isinstance(tag, dict):
        raise StructuralTagError("structural_tag", f"must be an object, got {shown(tag)}")
    if tag.get("type", "structural_tag") != "structural_tag":
        raise StructuralTagError("structural_tag.type", f'must be "structural_tag", got {shown(tag["type"])}')
    if "format" in tag:
        _known(tag, "structural_tag", ("type", "format"))
        return _Lark(json_options).grammar(tag["format"], "structural_tag.format")
    if "structures" in tag:
        _known(tag, "structural_tag", ("type", "structures", "triggers"))
        return _Lark(json_options).grammar(_legacy_format(tag), "structural_tag")
    raise StructuralTagError("structural_tag", 'needs a "format" (or the legacy "structures" and "triggers")')


def _legacy_format(tag: dict) -> dict:
    """The legacy form as the triggered_tags format it stands for, checked where the client
    wrote it (the tree's own checks would name paths the request does not have)."""
    triggers = _strings(tag, "triggers", "structural_tag", nonempty=True)
    structures = tag["structures"]
    if not isinstance(structures, list) or not structures:
        raise StructuralTagError("structural_tag.structures", f"must be a non-empty list, got {shown(structures)}")
    tags = []
    for i, s in enumerate(structures):
        path = f"structural_tag.structures[{i}]"
        _known(_object(s, path), path, ("begin", "schema", "end"))
        begin, end = _string(s, "begin", path), _string(s, "end", path)
        _trigger_of(begin, triggers, f"{path}.begin")
        _schema(_required(s, "schema", path), f"{path}.schema")
        tags.append(
            {"type": "tag", "begin": begin, "content": {"type": "json_schema", "json_schema": s["schema"]}, "end": end}
        )
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags}


class _Lark:
    """One structural tag's Lark grammar, built rule by rule while its format tree is walked."""

    def __init__(self, json_options: dict[str, Any]) -> None:
        self.json_options = json_options
        self.rules: list[str] = []  # the grammar's lines besides `start`
        self.subgrammars: list[dict[str, str]] = []  # `grammar` formats, referenced as @name
        self.count = 0

    def grammar(self, fmt: Any, path: str) -> str:
        start = self.emit(fmt, path, None, 0)
        lark = "\n".join(["%llguidance {}", f"start: {start}", "ANY: /(?s:.*)/", *self.rules])
        return json.dumps({"grammars": [{"name": "structural_tag", "lark_grammar": lark}, *self.subgrammars]})

    def _name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def _define(self, prefix: str, body: str) -> str:
        """A new rule (a lowercase `prefix`) or terminal (uppercase) of `body`; its name."""
        name = self._name(prefix)
        self.rules.append(f"{name}: {body}")
        return name

    def emit(self, fmt: Any, path: str, follow: tuple[str, ...] | None, depth: int) -> str:
        """A Lark expression matching `fmt` and then what `follow` says it takes."""
        if depth > MAX_DEPTH:
            raise StructuralTagError(path, f"formats nest deeper than {MAX_DEPTH}")
        kind = _type(fmt, path)
        _known(fmt, path, ("type", *_FIELDS[kind]))
        return getattr(self, f"_{kind}")(fmt, path, follow, depth + 1)

    def _const_string(self, fmt: dict, path: str, follow, depth: int) -> str:
        value = _string(fmt, "value", path)
        return _seq(_literal(value) if value else "", _ends(follow))

    def _json_schema(self, fmt: dict, path: str, follow, depth: int) -> str:
        if _string(fmt, "style", path, default="json") != "json":
            raise StructuralTagError(f"{path}.style", f"style {shown(fmt['style'])} is not served (only json)")
        if _flag(fmt, "any_order", path):
            raise StructuralTagError(f"{path}.any_order", "any_order is not served (properties in the schema's order)")
        # JSON here has no whitespace between tokens (docs/structured-outputs.md): any cap holds.
        _count(fmt, "max_whitespace_cnt", path)
        schema = _schema(_required(fmt, "json_schema", path), f"{path}.json_schema")
        schema = {**schema, "x-guidance": {**self.json_options, **schema.get("x-guidance", {})}}
        return _seq(f"%json {json.dumps(schema)}", _ends(follow))

    def _any_text(self, fmt: dict, path: str, follow, depth: int) -> str:
        if fmt.get("max_tokens") is not None:
            raise StructuralTagError(
                f"{path}.max_tokens",
                "a token budget is not served (llguidance's max_tokens stops the rollback speculation needs)",
            )
        excludes = _strings(fmt, "excludes", path, nonempty=False)
        max_chars = _count(fmt, "max_chars", path)
        text = self._text(excludes, (), follow, path)
        if max_chars is not None:
            text = f"({text} & /(?s:.){{0,{max_chars}}}/)"
        return self._define("TEXT", _seq(text, _ends(follow)))

    def _grammar(self, fmt: dict, path: str, follow, depth: int) -> str:
        text = _string(fmt, "grammar", path, nonempty=True)
        _compiles(lambda: llguidance.grammar_from("grammar", text), f"{path}.grammar")
        name = self._name("grammar")
        self.subgrammars.append({"name": name, "lark_grammar": any_to_lark(text)})
        return _seq(f"@{name}", _ends(follow))

    def _regex(self, fmt: dict, path: str, follow, depth: int) -> str:
        pattern = _string(fmt, "pattern", path, nonempty=True)
        _compiles(lambda: llguidance.LLMatcher.grammar_from_regex(pattern), f"{path}.pattern")
        # One lexeme with the end strings after it: llguidance would not give a pattern that can
        # run on into its end string back to the end (xgrammar tries both).
        return self._define("REGEX", _seq(f"/{llguidance.regex_to_lark(pattern)}/", _ends(follow)))

    def _sequence(self, fmt: dict, path: str, follow, depth: int) -> str:
        elements = _list(fmt, "elements", path)
        last = len(elements) - 1
        return _seq(
            *(
                self.emit(e, f"{path}.elements[{i}]", follow if i == last else THEN, depth)
                for i, e in enumerate(elements)
            )
        )

    def _or(self, fmt: dict, path: str, follow, depth: int) -> str:
        elements = _list(fmt, "elements", path)
        return self._define(
            "or", " | ".join(self.emit(e, f"{path}.elements[{i}]", follow, depth) for i, e in enumerate(elements))
        )

    def _optional(self, fmt: dict, path: str, follow, depth: int) -> str:
        content = self.emit(_required(fmt, "content", path), f"{path}.content", follow, depth)
        ends = _ends(follow)
        return self._define("optional", f"{content} | {ends}" if ends else f"({content})?")

    def _plus(self, fmt: dict, path: str, follow, depth: int) -> str:
        return self._repeated(fmt, path, follow, depth, "+")

    def _star(self, fmt: dict, path: str, follow, depth: int) -> str:
        return self._repeated(fmt, path, follow, depth, "*")

    def _repeat(self, fmt: dict, path: str, follow, depth: int) -> str:
        low, high = _integer(fmt, "min", path), _integer(fmt, "max", path)
        if not 0 <= low <= MAX_COUNT:
            raise StructuralTagError(f"{path}.min", f"must be from 0 to {MAX_COUNT}, got {low}")
        if high != -1 and not low <= high:
            raise StructuralTagError(f"{path}.max", f"must be -1 (unbounded) or at least min ({low}), got {high}")
        if high == 0:
            return _ends(follow)
        unbounded = high == -1 or high > MAX_COUNT  # xgrammar reads a larger max as unbounded too
        return self._repeated(fmt, path, follow, depth, f"{{{low},}}" if unbounded else f"{{{low},{high}}}")

    def _repeated(self, fmt: dict, path: str, follow, depth: int, times: str) -> str:
        content = self.emit(_required(fmt, "content", path), f"{path}.content", THEN, depth)
        return _seq(f"{self._define('repeat', content)}{times}", _ends(follow))

    def _tag(self, fmt: dict, path: str, follow, depth: int) -> str:
        begin = _string(fmt, "begin", path, token_refused=True)
        ends = self._tag_ends(fmt, path)
        return _seq(
            _literal(begin) if begin else "",
            self.emit(_required(fmt, "content", path), f"{path}.content", ends, depth),
            _ends(follow),
        )

    def _tag_ends(self, fmt: dict, path: str) -> tuple[str, ...]:
        end = _required(fmt, "end", path)
        if isinstance(end, dict):
            raise StructuralTagError(f"{path}.end", _TOKEN_LEVEL)
        if isinstance(end, str):
            return (end,)
        if not isinstance(end, list) or not end or not all(isinstance(e, str) for e in end):
            raise StructuralTagError(
                f"{path}.end", f"must be a string or a non-empty list of strings, got {shown(end)}"
            )
        return tuple(end)

    def _tags(self, fmt: dict, path: str) -> list[tuple[dict, str]]:
        """A format's `tags`: each a tag format, with its path."""
        tags = _list(fmt, "tags", path)
        for i, t in enumerate(tags):
            if _type(t, f"{path}.tags[{i}]", default="tag") != "tag":
                raise StructuralTagError(f"{path}.tags[{i}].type", f'must be "tag", got {shown(t["type"])}')
        return [({**t, "type": "tag"}, f"{path}.tags[{i}]") for i, t in enumerate(tags)]  # its type may be left out

    def _triggered_tags(self, fmt: dict, path: str, follow, depth: int) -> str:
        """Free text in which each trigger starts one of its tags; xgrammar's TagDispatch
        (`at_least_one`: a tag first, no text before it; `stop_after_first`: nothing after it)."""
        triggers = _strings(fmt, "triggers", path, nonempty=True)
        tags = self._tags(fmt, path)
        at_least_one, stop_after_first = _flag(fmt, "at_least_one", path), _flag(fmt, "stop_after_first", path)
        excludes = _strings(fmt, "excludes", path, nonempty=False)
        begins = []
        for tag, tag_path in tags:
            _known(tag, tag_path, ("type", *_FIELDS["tag"]))
            begin = _string(tag, "begin", tag_path, token_refused=True)
            begins.append((begin, _trigger_of(begin, triggers, f"{tag_path}.begin")))
        if at_least_one and stop_after_first:  # exactly one tag
            return self._define("tags", " | ".join(self.emit(t, p, follow, depth) for t, p in tags))
        groups: dict[str, list[str]] = {t: [] for t in triggers}  # each trigger's tags, the trigger taken
        for (tag, tag_path), (begin, trigger) in zip(tags, begins):
            ends = self._tag_ends(tag, tag_path)
            content = self.emit(_required(tag, "content", tag_path), f"{tag_path}.content", ends, depth)
            groups[trigger].append(_seq(_literal(begin[len(trigger) :]) if begin != trigger else "", content))
        free = self._text(excludes, triggers, follow, path)
        tail = self._define("TAIL", _seq(free, _ends(follow)))
        item = self._name("tagged")
        heads = []
        for trigger, group in groups.items():
            if group:  # the trigger ends one lexeme with the text before it, lazily: at its first occurrence
                head = self._name("trigger")
                self.rules.append(f"{head}[lazy]: {free} {_literal(trigger)}")
                heads.append(f"{head} {self._define('group', ' | '.join(group))}")
        self.rules.append(f"{item}: {' | '.join(heads)}")
        if stop_after_first:
            return self._define("tags", f"{tail} | {_seq(item, _ends(follow))}")
        first = (
            f"{self._define('first', ' | '.join(self.emit(t, p, THEN, depth) for t, p in tags))} "
            if at_least_one
            else ""
        )
        return f"{first}{item}* {tail}"

    def _tags_with_separator(self, fmt: dict, path: str, follow, depth: int) -> str:
        tags = self._tags(fmt, path)
        separator = _string(fmt, "separator", path)
        at_least_one, stop_after_first = _flag(fmt, "at_least_one", path), _flag(fmt, "stop_after_first", path)
        one = self._define("tag", " | ".join(self.emit(t, p, THEN, depth) for t, p in tags))
        if stop_after_first:
            body = one
        elif separator:
            body = f"{one} ({_literal(separator)} {one})*"
        else:
            body = f"{one}+"
        return _seq(self._define("tags", body) + ("" if at_least_one else "?"), _ends(follow))

    def _text(self, excludes: list[str], triggers: list[str], follow, path: str) -> str:
        """A terminal of text that holds none of `excludes`, `triggers` or the end strings that
        follow it (xgrammar's end detection); refused where another format follows it."""
        if follow == THEN:
            raise StructuralTagError(
                path, "text of unbounded length must end its tag or the output (another format follows it here)"
            )
        if follow and "" in follow:
            raise StructuralTagError(
                path, "text of unbounded length needs non-empty end strings in its tag (one is empty)"
            )
        banned = list(dict.fromkeys([*excludes, *triggers, *(follow or ())]))
        if not banned:
            return "ANY"
        return self._define("FREE", f"ANY & ~(ANY ({' | '.join(map(_literal, banned))}) ANY)")


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p) or '""'


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _ends(follow: tuple[str, ...] | None) -> str:
    """The Lark expression of the end strings `follow` takes ("" where nothing is taken)."""
    ends = list(dict.fromkeys(e for e in follow or () if e))
    if not ends:
        return ""
    alternatives = f"({' | '.join(map(_literal, ends))})"
    return alternatives + ("?" if "" in follow else "")


def _trigger_of(begin: str, triggers: list[str], path: str) -> str:
    """The one trigger a tag's begin starts with (xgrammar refuses none and several)."""
    found = [t for t in triggers if begin.startswith(t)]
    if len(found) != 1:
        which = "none" if not found else f"several ({', '.join(map(repr, found))})"
        raise StructuralTagError(
            path, f"{shown(begin)} starts with {which} of the triggers; it must start with exactly one"
        )
    return found[0]


def _schema(schema: Any, path: str) -> dict:
    """A JSON schema (true: any value) that llguidance compiles."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise StructuralTagError(path, f"must be a JSON schema object (or true), got {shown(schema)}")
    _compiles(lambda: llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)), path)
    return schema


def _compiles(grammar, path: str) -> None:
    """Refuse, at `path`, a part whose own grammar llguidance cannot build or validate."""
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar())
    except ValueError as e:
        error = str(e)
    if error:
        raise StructuralTagError(path, f"cannot be compiled: {error[:300]}")


def _type(fmt: Any, path: str, default: str | None = None) -> str:
    kind = _object(fmt, path).get("type", default)
    if kind in UNSUPPORTED:
        raise StructuralTagError(f"{path}.type", f"format type {kind!r} is not supported: {UNSUPPORTED[kind]}")
    if kind not in _FIELDS:
        what = "needs a type" if kind is None else f"unknown format type {shown(kind)}"
        raise StructuralTagError(f"{path}.type", f"{what}; supported: {', '.join(SUPPORTED)}")
    return kind


def _object(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise StructuralTagError(path, f"must be an object, got {shown(value)}")
    return value


def _known(fmt: dict, path: str, fields: tuple[str, ...]) -> None:
    unknown = sorted(set(fmt) - set(fields))
    if unknown:
        raise StructuralTagError(f"{path}.{unknown[0]}", f"unknown field; known here: {', '.join(fields)}")


def _required(fmt: dict, key: str, path: str) -> Any:
    if key not in fmt:
        raise StructuralTagError(f"{path}.{key}", "missing")
    return fmt[key]


def _string(fmt: dict, key: str, path: str, default: str | None = None, nonempty=False, token_refused=False) -> str:
    value = fmt.get(key, default) if default is not None else _required(fmt, key, path)
    if token_refused and isinstance(value, dict):
        raise StructuralTagError(f"{path}.{key}", _TOKEN_LEVEL)
    if not isinstance(value, str) or (nonempty and not value):
        raise StructuralTagError(
            f"{path}.{key}", f"must be a {'non-empty ' if nonempty else ''}string, got {shown(value)}"
        )
    return value


def _strings(fmt: dict, key: str, path: str, nonempty: bool) -> list[str]:
    """A list of non-empty strings; `nonempty`: the list too (else it may be absent)."""
    value = _required(fmt, key, path) if nonempty else fmt.get(key, [])
    if not isinstance(value, list) or (nonempty and not value) or not all(isinstance(s, str) and s for s in value):
        need = "a non-empty list" if nonempty else "a list"
        raise StructuralTagError(f"{path}.{key}", f"must be {need} of non-empty strings, got {shown(value)}")
    return value


def _list(fmt: dict, key: str, path: str) -> list:
    value = _required(fmt, key, path)
    if not isinstance(value, list) or not value:
        raise StructuralTagError(f"{path}.{key}", f"must be a non-empty list, got {shown(value)}")
    return value


def _flag(fmt: dict, key: str, path: str) -> bool:
    value = fmt.get(key, False)
    if not isinstance(value, bool):
        raise StructuralTagError(f"{path}.{key}", f"must be true or false, got {shown(value)}")
    return value


def _integer(fmt: dict, key: str, path: str) -> int:
    value = _required(fmt, key, path)
    if not isinstance(value, int) or isinstance(value, bool):
        raise StructuralTagError(f"{path}.{key}", f"must be an integer, got {shown(value)}")
    return value


def _count(fmt: dict, key: str, path: str) -> int | None:
    """An optional bound: null, or an integer from 0 to MAX_COUNT."""
    value = fmt.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT):
        raise StructuralTagError(
            f"{path}.{key}", f"must be null or an integer from 0 to {MAX_COUNT}, got {shown(value)}"
        )
    return value
