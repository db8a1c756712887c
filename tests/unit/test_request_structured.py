"""Structured-output constraints as requests carry them: vLLM's `structured_outputs` (an object
or, as the Triton vLLM backend takes it, its JSON text), its older `guided_decoding` and the
top-level `guided_*` names, read into one StructuredOutputs; two kinds in one request, and
options that contradict each other, are refused by name."""

from __future__ import annotations

import json

import pytest

from backends.serving.request import RequestError, parse_request
from backends.structured.spec import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
CANONICAL = '{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}}}'


def structured(sampling: dict | None = None, params: dict | None = None) -> StructuredOutputs | None:
    return parse_request({"text_input": "hi"}, json.dumps(params or {}), json.dumps(sampling or {})).structured


def refused(sampling: dict) -> str:
    with pytest.raises(RequestError) as err:
        structured(sampling)
    return str(err.value)


def test_no_constraint_and_null_ones_leave_the_output_free():
    assert structured() is None
    assert structured({"structured_outputs": None, "guided_decoding": None, "guided_json": None}) is None
    # vLLM reads json_object as a truth value: false asks for nothing
    assert structured({"guided_decoding": {"json_object": False}}) is None


@pytest.mark.parametrize(
    "fields,expected",
    [
        ({"json": SCHEMA}, StructuredOutputs("json", CANONICAL)),
        ({"json": json.dumps(SCHEMA, indent=2)}, StructuredOutputs("json", CANONICAL)),
        ({"regex": r"\d{3}-\d{4}"}, StructuredOutputs("regex", r"\d{3}-\d{4}")),
        ({"choice": ["yes", "no", "maybe so"]}, StructuredOutputs("choice", '["yes","no","maybe so"]')),
        ({"grammar": 'root ::= "a" | "b"'}, StructuredOutputs("grammar", 'root ::= "a" | "b"')),
        ({"json_object": True}, StructuredOutputs("json_object", "")),
        (
            {"structural_tag": json.dumps({"type": "structural_tag", "format": {"type": "any_text"}})},
            StructuredOutputs("structural_tag", '{"type":"structural_tag","format":{"type":"any_text"}}'),
        ),
        ({"json": SCHEMA, "whitespace_pattern": r"[ ]?"}, StructuredOutputs("json", CANONICAL, r"[ ]?")),
        ({"json_object": True, "whitespace_pattern": ""}, StructuredOutputs("json_object", "", "")),
    ],
)
def test_each_kind_of_structured_outputs(fields, expected):
    assert structured({"structured_outputs": fields}) == expected
    # the same as JSON text (the Triton vLLM backend json.loads it), and as guided_decoding
    assert structured({"structured_outputs": json.dumps(fields)}) == expected
    assert structured({"guided_decoding": fields}) == expected


def test_the_schema_text_keeps_the_schema_s_order_whatever_spacing_it_came_in():
    """The properties come out in the order the schema lists them (llguidance, xgrammar and
    vLLM alike), so that order is part of the constraint; spacing is not."""
    spaced = json.dumps(SCHEMA, indent=2)
    assert structured({"guided_json": spaced}).spec == structured({"guided_json": SCHEMA}).spec == CANONICAL
    reordered = {"properties": {"age": {"type": "integer"}, "name": {"type": "string"}}, "type": "object"}
    assert structured({"guided_json": reordered}).spec != CANONICAL


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("guided_json", SCHEMA, StructuredOutputs("json", CANONICAL)),
        ("guided_json", json.dumps(SCHEMA), StructuredOutputs("json", CANONICAL)),
        ("guided_regex", "[a-z]+", StructuredOutputs("regex", "[a-z]+")),
        ("guided_choice", ["a", "b"], StructuredOutputs("choice", '["a","b"]')),
        ("guided_grammar", "root ::= [0-9]+", StructuredOutputs("grammar", "root ::= [0-9]+")),
    ],
)
def test_the_older_top_level_names(key, value, expected):
    assert structured({key: value}) == expected
    assert structured(params={key: value}) == expected  # HTTP /generate puts unknown keys in parameters


def test_guided_whitespace_pattern_and_a_neutral_backend_go_with_guided_json():
    got = structured({"guided_json": SCHEMA, "guided_whitespace_pattern": r"\s?", "guided_decoding_backend": "auto"})
    assert got == StructuredOutputs("json", CANONICAL, r"\s?")
    got = structured({"guided_decoding": {"json": SCHEMA, "backend": "guidance", "disable_fallback": True}})
    assert got == StructuredOutputs("json", CANONICAL)


def test_a_dict_dumped_from_vllms_dataclasses_is_read():
    """dataclasses.asdict of StructuredOutputsParams carries its options and private fields."""
    dumped = {
        "json": None,
        "regex": "[0-9]+",
        "choice": None,
        "grammar": None,
        "json_object": None,
        "disable_any_whitespace": False,
        "disable_additional_properties": False,
        "whitespace_pattern": None,
        "structural_tag": None,
        "_backend": None,
        "_backend_was_auto": False,
    }
    assert structured({"structured_outputs": dumped}) == StructuredOutputs("regex", "[0-9]+")


def test_disable_any_whitespace_is_the_default():
    """JSON here has no whitespace between tokens unless a whitespace_pattern allows some."""
    fields = {"json": SCHEMA, "disable_any_whitespace": True}
    assert structured({"structured_outputs": fields}) == StructuredOutputs("json", CANONICAL)


def test_disable_additional_properties_closes_every_object_that_lists_properties():
    nested = {
        "type": "object",
        "properties": {"user": SCHEMA, "tags": {"type": "array", "items": SCHEMA}},
        "$defs": {"open": {"type": "object", "properties": {"x": {}}, "additionalProperties": True}},
        "anyOf": [SCHEMA, {"type": "string"}],
    }
    got = structured({"structured_outputs": {"json": nested, "disable_additional_properties": True}})
    closed = {**SCHEMA, "additionalProperties": False}
    assert json.loads(got.spec) == {
        **nested,
        "properties": {"user": closed, "tags": {"type": "array", "items": closed}},
        "anyOf": [closed, {"type": "string"}],
        "additionalProperties": False,
    }  # $defs' object says additionalProperties itself: kept
    tag = {"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]}
    got = structured({"structured_outputs": {"structural_tag": tag, "disable_additional_properties": True}})
    assert json.loads(got.spec)["structures"][0]["schema"] == closed
    assert (
        structured({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": False}}).spec == CANONICAL
    )


def test_disable_additional_properties_closes_the_schemas_anywhere_in_a_structural_tag_s_format():
    def tag(begin: str, schema: dict) -> dict:
        return {"type": "tag", "begin": begin, "content": {"type": "json_schema", "json_schema": schema}, "end": "</>"}

    def tree(schema: dict) -> dict:
        triggered = {"type": "triggered_tags", "triggers": ["<f"], "tags": [tag("<f>", schema)]}
        return {"type": "structural_tag", "format": {"type": "sequence", "elements": [tag("<a>", schema), triggered]}}

    got = structured({"structured_outputs": {"structural_tag": tree(SCHEMA), "disable_additional_properties": True}})
    assert json.loads(got.spec) == tree({**SCHEMA, "additionalProperties": False})
    got = structured({"structured_outputs": {"structural_tag": tree(SCHEMA), "disable_additional_properties": False}})
    assert json.loads(got.spec) == tree(SCHEMA)


@pytest.mark.parametrize(
    "sampling,message",
    [
        (
            {"structured_outputs": {"json": SCHEMA}, "guided_regex": "a+"},
            "one kind of structured output per request, got structured_outputs.json and guided_regex",
        ),
        (
            {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
            "got structured_outputs.regex and structured_outputs.choice",
        ),
        (
            {"guided_decoding": {"grammar": "root ::= x"}, "structured_outputs": {"json_object": True}},
            "got structured_outputs.json_object and guided_decoding.grammar",
        ),
        ({"guided_json": "{not json"}, "guided_json is not valid JSON"),
        ({"structured_outputs": "{not json"}, "structured_outputs is not valid JSON"),
        ({"structured_outputs": ["json"]}, "structured_outputs must be an object (or its JSON text)"),
        ({"guided_json": [1, 2]}, "guided_json must be a JSON object"),
        ({"guided_choice": []}, "guided_choice must be a non-empty list of strings"),
        ({"guided_choice": ["a", 1]}, "guided_choice must be a non-empty list of strings"),
        ({"guided_regex": ""}, "guided_regex must be a non-empty string"),
        ({"structured_outputs": {"grammar": 5}}, "structured_outputs.grammar must be a non-empty string"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object must be true or false"),
        ({"structured_outputs": {"jsonschema": SCHEMA}}, "unknown key 'jsonschema' in structured_outputs"),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True, "whitespace_pattern": " "}},
            "structured_outputs.disable_any_whitespace=true and structured_outputs.whitespace_pattern contradict",
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}, "guided_whitespace_pattern": " "},
            "structured_outputs.disable_any_whitespace=true and guided_whitespace_pattern contradict",
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_additional_properties": "yes"}},
            "structured_outputs.disable_additional_properties must be true or false",
        ),
        (
            {"guided_json": SCHEMA, "guided_decoding_backend": "outlines"},
            "guided_decoding_backend='outlines': the grammar backend is the server's choice",
        ),
        (
            {"guided_decoding": {"regex": "a", "backend": "xgrammar"}},
            "guided_decoding.backend='xgrammar': the grammar backend is the server's choice",
        ),
        (
            {"guided_regex": "a+", "guided_whitespace_pattern": " "},
            "guided_whitespace_pattern applies to json and json_object constraints, not to guided_regex",
        ),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern needs a json or json_object constraint"),
        (
            {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}, "guided_whitespace_pattern": "\n"},
            "structured_outputs.whitespace_pattern and guided_whitespace_pattern differ",
        ),
        ({"guided_regex": "a" * (2**20 + 1)}, "guided_regex is 1048577 characters; at most 1048576"),
    ],
)
def test_refused_by_name(sampling, message):
    assert message in refused(sampling)


def test_forced_drafts_is_on_unless_the_request_turns_it_off():
    def forced(sampling: dict) -> bool:
        return parse_request({"text_input": "hi"}, "", json.dumps(sampling)).forced_drafts

    assert forced({}) and forced({"forced_drafts": None}) and forced({"forced_drafts": True})
    assert not forced({"forced_drafts": False})
    with pytest.raises(RequestError, match="forced_drafts"):
        forced({"forced_drafts": "sometimes"})
