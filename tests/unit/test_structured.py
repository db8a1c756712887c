"""Structured outputs in process (backends/structured): every kind of constraint holds, greedy
constrained speculative output is constrained plain output token for token (every method;
float32 and bf16), sampling under a mask keeps the masked target distribution, forced tokens
are free drafts, and a constraint that cannot be compiled fails only its own request."""

from __future__ import annotations

import json
import random
import re
import threading

import pytest
import torch

from backends.config import SpeculativeConfig
from backends.serving.drafting import DraftService
from backends.serving.local import generate_local
from backends.serving.proposer import Draft, build_proposer
from backends.serving.request import RequestError, SamplingParams
from backends.serving.target import TargetRunner, VerifyRequest
from backends.serving.tree import DraftTree
from backends.structured.grammar import GrammarCompiler, GrammarError
from backends.structured.mask import allowed_tokens, apply_token_mask
from backends.structured.spec import StructuredOutputs
from tests.fixtures.helpers import coarse_total_variation, load_hf_model
from tests.fixtures.prompts import ANIMAL_SCHEMA
from tests.fixtures.structured import PROMPT, TAG, constrained_greedy_reference
from tests.fixtures.synthetic_heads import write_medusa

EOS = 0  # the tiny model's <|endoftext|>
SCHEMA = ANIMAL_SCHEMA
CONSTRAINTS = {
    "json": StructuredOutputs("json", json.dumps(SCHEMA)),
    "regex": StructuredOutputs("regex", r"(the|a) (fox|dog) (jumps|sleeps)\."),
    "choice": StructuredOutputs("choice", json.dumps(["def add", "for i in range", "The quick brown fox"])),
    "grammar": StructuredOutputs("grammar", 'start: "print(" NUM ")"\nNUM: /[0-9]/'),
    "gbnf": StructuredOutputs("grammar", 'root ::= "dog" | "fox" " jumps"'),
}


def holds(kind: str, text: str) -> bool:
    """Whether the output is what its constraint describes."""
    if kind == "json":
        value = json.loads(text)
        return value["animal"] in SCHEMA["properties"]["animal"]["enum"] and isinstance(value["jumps"], bool)
    if kind == "choice":
        return text in json.loads(CONSTRAINTS["choice"].spec)
    patterns = {"regex": CONSTRAINTS["regex"].spec, "grammar": r"print\([0-9]\)", "gbnf": r"dog|fox jumps"}
    return re.fullmatch(patterns[kind], text) is not None


@pytest.fixture(scope="module")
def grammars(tokenizer, runner):
    compiler = GrammarCompiler(tokenizer, runner.logits_size, {EOS})
    yield compiler
    compiler.close()


@pytest.fixture(scope="module")
def bf16_runner(tiny_model_dir):
    return TargetRunner(tiny_model_dir, dtype="bfloat16")


@pytest.fixture(scope="module")
def medusa_dir(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("medusa")
    write_medusa(out, tiny_model_dir)
    return out


def method_service(method: str, tiny_model_dir, tiny_draft_dir, medusa_dir) -> DraftService:
    specs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "suffix": {"method": "suffix", "num_speculative_tokens": 4},
        "suffix-tree": {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_use_tree_spec": True},
        "draft_model": {"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 4},
        "medusa": {"method": "medusa", "model": str(medusa_dir), "num_speculative_tokens": 3},
    }
    config = SpeculativeConfig.from_json(specs[method], target_model=str(tiny_model_dir))
    return DraftService(build_proposer(config, max_model_len=512, dtype="float32", target_model=tiny_model_dir), config)


# ----------------------------------------------------------------------------- the grammar


def test_each_kind_holds_and_ends_by_eos(runner, tokenizer, grammars, tiny_model_dir):
    for kind, spec in CONSTRAINTS.items():
        ids, stats = generate_local(PROMPT, tokenizer, runner, max_tokens=40, grammars=grammars, structured=spec)
        assert ids[-1] == EOS, (kind, ids)
        assert holds(kind, tokenizer.decode(ids[:-1])), (kind, tokenizer.decode(ids))
        assert ids == constrained_greedy_reference(tiny_model_dir, grammars, spec, PROMPT, 40), kind


def test_forced_tokens_are_free_drafts(runner, tokenizer, grammars):
    """The schema's keys and punctuation come as drafts with no drafter, all accepted."""
    matcher = grammars.matcher(CONSTRAINTS["json"])
    assert tokenizer.decode(matcher.forced(32)) == '{"animal":"'
    ids, stats = generate_local(
        PROMPT, tokenizer, runner, max_tokens=40, grammars=grammars, structured=CONSTRAINTS["json"]
    )
    assert stats.acceptance.num_draft_tokens >= len(matcher.forced(32))
    assert stats.num_steps < len(ids) / 1.5  # several tokens a step without any drafter


def test_a_request_without_forced_drafts_decodes_one_token_a_step_to_the_same_output(runner, tokenizer, grammars):
    """forced_drafts off (the peers' constrained decoding, the bench's baseline): no drafts at
    all without a drafter, and the same tokens."""
    request = {"max_tokens": 40, "grammars": grammars, "structured": CONSTRAINTS["json"]}
    forced, _ = generate_local(PROMPT, tokenizer, runner, **request)
    ids, stats = generate_local(PROMPT, tokenizer, runner, forced_drafts=False, **request)
    assert ids == forced
    assert stats.acceptance.num_draft_tokens == 0 and stats.num_steps == len(ids)


# `return a + b` is forced; llguidance is sure of `r` `eturn` ` a` ` +` only (the tiny
# tokenizer's ` b` merges with what may follow): the target may write ` b` or ` ` `b`.
SPLIT = StructuredOutputs("regex", r"return a \+ b[a-z ]*")


def test_forced_bytes_the_target_may_split_two_ways_are_drafted_both_ways(grammars, tokenizer):
    matcher = grammars.matcher(SPLIT)
    draft, from_drafter = matcher.constrain(Draft(), 16)
    assert [tokenizer.decode([t]) for t in draft.token_ids] == ["r", "eturn", " a", " +", " b", " ", "b"]
    assert draft.parents == [-1, 0, 1, 2, 3, 3, 5] and from_drafter == 0
    assert matcher.masks(draft).shape[0] == 8  # the root, then each node's path
    sure_only = matcher.constrain(Draft(), 4)[0]
    assert sure_only.token_ids == draft.token_ids[:4] and sure_only.parents is None


@pytest.mark.parametrize("method", [None, "ngram", "draft_model"])
def test_greedy_output_follows_whichever_split_the_target_takes(
    method, runner, tokenizer, grammars, tiny_model_dir, tiny_draft_dir, medusa_dir
):
    service = method_service(method, tiny_model_dir, tiny_draft_dir, medusa_dir) if method else None
    reference = constrained_greedy_reference(tiny_model_dir, grammars, SPLIT, PROMPT, 24)
    ids, _ = generate_local(PROMPT, tokenizer, runner, service, max_tokens=24, grammars=grammars, structured=SPLIT)
    assert ids == reference


def test_constrain_and_masks_leave_the_matcher_where_it_was(grammars, tokenizer):
    matcher = grammars.matcher(CONSTRAINTS["regex"])
    before = matcher.masks(Draft())
    draft = Draft(tokenizer("the dog jumps.", add_special_tokens=False)["input_ids"] + [EOS, 5])
    cut, from_drafter = matcher.constrain(draft, room=32)
    assert cut.token_ids == draft.token_ids[:-1] and from_drafter == len(draft.token_ids) - 1  # cut after EOS
    masks = matcher.masks(cut)
    assert masks.shape == (len(cut.token_ids) + 1, (grammars.vocab_size + 31) // 32)
    allowed = allowed_tokens(masks, grammars.vocab_size)
    assert all(allowed[i, t] for i, t in enumerate(cut.token_ids))
    assert allowed[-2, EOS] and allowed[-1].all()  # EOS where it may end; after it free text (ignore_eos)
    assert torch.equal(matcher.masks(Draft()), before)
    bad = Draft(tokenizer("the cat", add_special_tokens=False)["input_ids"])
    cut, from_drafter = matcher.constrain(bad, room=32)  # "the" is allowed, " cat" is not
    assert cut.token_ids[:from_drafter] == bad.token_ids[:from_drafter] < bad.token_ids
    assert tokenizer.decode(cut.token_ids).startswith("the") and "c" not in tokenizer.decode(cut.token_ids)


def test_tree_branches_the_grammar_rejects_are_pruned(grammars, tokenizer):
    matcher = grammars.matcher(StructuredOutputs("choice", json.dumps(["dog", "fox"])))
    d, o, f, x = (tokenizer.convert_tokens_to_ids(c) for c in "dofx")
    # root -> d -> o, root -> o (rejected) -> d, root -> f -> x (rejected: "fx")
    draft = Draft([d, o, o, d, f, x], torch.rand(6, grammars.vocab_size), [-1, 0, -1, 2, -1, 4])
    pruned, from_drafter = matcher.constrain(draft, room=8)  # forced tokens follow (the next test)
    assert pruned.token_ids[:3] == [d, o, f] and pruned.parents[:3] == [-1, 0, -1] and from_drafter == 3
    assert torch.equal(pruned.probs[:3], draft.probs[[0, 1, 4]])
    masks = allowed_tokens(matcher.masks(pruned), grammars.vocab_size)
    g, o2 = tokenizer.convert_tokens_to_ids("g"), tokenizer.convert_tokens_to_ids("o")
    assert masks[2, g] and not masks[2, o2] and masks[3, o2]  # after "do": g; after "f": o


def test_forced_tokens_follow_a_tree_s_leaves_in_the_nodes_pruned_away(grammars, tokenizer):
    matcher = grammars.matcher(StructuredOutputs("choice", json.dumps(["dog jumps", "fox sleeps"])))
    d, o, f, x, z = (tokenizer.convert_tokens_to_ids(c) for c in "dofxz")
    # root -> d -> o, root -> z (rejected) -> d, root -> f -> x (rejected: "fx")
    draft = Draft(
        [d, o, z, d, f, x], torch.rand(6, grammars.vocab_size), [-1, 0, -1, 2, -1, 4], [0.9, 0.5, 0.3, 0.2, 0.4, 0.1]
    )
    tree, from_drafter = matcher.constrain(draft, room=6)
    assert tree.token_ids[:3] == [d, o, f] and tree.parents[:3] == [-1, 0, -1] and from_drafter == 3
    forced = tree.token_ids[3:]  # 3 nodes were pruned: 3 forced ones, after "do" first
    assert len(forced) == 3 and tokenizer.decode([d, o, *forced]).startswith("dog j")
    assert tree.parents[3:] == [1, 3, 4] and tree.scores[3:] == [0.4] * 3
    assert torch.equal(tree.probs[3:], torch.nn.functional.one_hot(torch.tensor(forced), grammars.vocab_size).float())
    masks = allowed_tokens(matcher.masks(tree), grammars.vocab_size)
    assert all(masks[tree.parents[i] + 1, tree.token_ids[i]] for i in range(3, 6))  # each forced node's row allows it
    shallow, _ = matcher.constrain(draft, room=3)  # 3 levels: "do" + "g", then "f" + "ox"
    assert shallow.token_ids[3:] == [forced[0], o, x] and shallow.parents[3:] == [1, 2, 4]
    # the accepted path's drafter nodes, from the emitted tokens (forced nodes come last)
    tree_shape = DraftTree(tuple(tree.token_ids), tuple(tree.parents))
    assert tree_shape.walk([d, o, *forced[:2], 7]) == [0, 1, 3, 4] and tree_shape.walk([f, o]) == [2]


def test_with_ignore_eos_the_output_goes_on_unconstrained_past_its_eos(runner, tokenizer, grammars, tiny_model_dir):
    """vLLM's way: once the grammar has taken an EOS, the mask is full (free text)."""
    spec = CONSTRAINTS["regex"]
    expected = constrained_greedy_reference(tiny_model_dir, grammars, spec, PROMPT, 30, ignore_eos=True)
    end = expected.index(EOS)
    assert holds("regex", tokenizer.decode(expected[:end])) and expected[end + 1 :].count(EOS) < len(expected) - end - 1
    for service in (None, method_service("ngram", tiny_model_dir, None, None)):
        ids, _ = generate_local(
            PROMPT, tokenizer, runner, service, max_tokens=30, grammars=grammars, structured=spec, ignore_eos=True
        )
        assert ids == expected


def test_disable_additional_properties_refuses_a_property_the_schema_does_not_list(grammars, tokenizer):
    from backends.serving.structured_params import parse_structured

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    text = tokenizer('{"a":1,"b":2}', add_special_tokens=False)["input_ids"]
    for closed in (False, True):
        spec = parse_structured({"structured_outputs": {"json": schema, "disable_additional_properties": closed}})
        matcher = grammars.matcher(spec)
        allowed = matcher.valid_prefix(text)
        assert (tokenizer.decode(text[:allowed]) == '{"a":1,"b":2}') != closed, tokenizer.decode(text[:allowed])


def test_a_structural_tag_holds_its_schema_inside_the_tags(grammars, tokenizer):
    """The tag's schema, not any JSON value, between begin and end (llguidance's StructTag
    reads its grammar as a JSON schema)."""
    matcher = grammars.matcher(StructuredOutputs("structural_tag", json.dumps(TAG)))
    for inside, holds_schema in (('{"animal":"dog","jumps":true}', True), ("1", False), ('{"a":1}', False)):
        text = tokenizer(f"free text\n<animal>{inside}</animal> more", add_special_tokens=False)["input_ids"]
        assert (matcher.valid_prefix(text) == len(text)) == holds_schema, inside


# xgrammar's structural-tag formats ({"type": "structural_tag", "format": ...}): what each takes
# whole and what it refuses, as python/xgrammar/structural_tag.py, cpp/structural_tag.cc and
# docs/structural_tag/structural_tag.md (xgrammar commit 53da3ff8) define them.
ANIMAL = '{"animal":"dog","jumps":true}'
ANIMAL_JSON = {"type": "json_schema", "json_schema": SCHEMA}


def tag(begin: str, content: dict, end) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def const(value: str) -> dict:
    return {"type": "const_string", "value": value}


CALL = tag("<f=animal>", ANIMAL_JSON, "</f>")
SAY = tag("<f=say>", {"type": "any_text"}, "</f>")  # its text ends at the tag's end (end detection)
A_CALL, A_SAY = f"<f=animal>{ANIMAL}</f>", "<f=say>hi there</f>"
TRIGGERED = {"type": "triggered_tags", "triggers": ["<f="], "tags": [CALL, SAY]}
SEPARATED = {"type": "tags_with_separator", "tags": [CALL, SAY], "separator": ","}
FORMATS = {  # case: (format, taken whole, refused)
    "const_string": (const("hi"), ["hi"], ["h", "hi!", ""]),
    "json_schema": (ANIMAL_JSON, [ANIMAL], ['{"animal":"cat","jumps":true}', "1"]),
    "json_schema true": ({"type": "json_schema", "json_schema": True}, ["1", '{"x":[null]}'], ["{"]),
    "regex": ({"type": "regex", "pattern": "[a-c]+/[0-9]"}, ["ab/1"], ["ab1", "ab/12"]),
    "grammar": ({"type": "grammar", "grammar": 'root ::= "yes" | "no"'}, ["yes", "no"], ["maybe"]),
    "any_text": ({"type": "any_text", "excludes": ["STOP"]}, ["", "any text\nat all"], ["a STOP b"]),
    "any_text max_chars": ({"type": "any_text", "max_chars": 3}, ["abc", "é€x"], ["abcd"]),
    "sequence": (
        {"type": "sequence", "elements": [const("A:"), {"type": "regex", "pattern": "[0-9]+"}]},
        ["A:12"],
        ["A:", "12"],
    ),
    "or": ({"type": "or", "elements": [const("yes"), ANIMAL_JSON]}, ["yes", ANIMAL], ["no", f"yes{ANIMAL}"]),
    "optional": ({"type": "optional", "content": const("P:")}, ["", "P:"], ["P"]),
    "plus": ({"type": "plus", "content": const("ab")}, ["ab", "abab"], ["", "aba"]),
    "star": ({"type": "star", "content": const("x")}, ["", "xxx"], ["y"]),
    "repeat": ({"type": "repeat", "min": 1, "max": 2, "content": const("x")}, ["x", "xx"], ["", "xxx"]),
    "repeat unbounded": ({"type": "repeat", "min": 2, "max": -1, "content": const("x")}, ["xx", "xxxxx"], ["x"]),
    "tag": (
        tag("<r>", ANIMAL_JSON, ["</r>", "</answer>"]),
        [f"<r>{ANIMAL}</r>", f"<r>{ANIMAL}</answer>"],
        [f"<r>{ANIMAL}", ANIMAL],
    ),
    "tag of any_text": (
        tag("<think>", {"type": "any_text"}, "</think>"),
        ["<think>hm\n</think>", "<think></think>"],
        ["<think>a</think>b</think>", "<think>a</think>b", "<think>a"],
    ),
    "tag of a regex": (
        tag("<r>", {"type": "regex", "pattern": "[a-z</>]*"}, "</r>"),
        ["<r>ab</r>", "<r>a</r</r>"],
        ["<r>AB</r>"],
    ),
    "triggered_tags": (
        TRIGGERED,
        ["", "text", f"a {A_CALL} b {A_SAY}\n", A_CALL],
        ["a <f=plant>", "a <f=", "a <f=animal>1</f>"],
    ),
    "triggered_tags at_least_one": (
        {**TRIGGERED, "at_least_one": True},
        [f"{A_CALL} then text {A_SAY}"],
        ["", "text", f"text {A_CALL}"],
    ),
    "triggered_tags stop_after_first": (
        {**TRIGGERED, "stop_after_first": True},
        ["", "text", f"text {A_SAY}"],
        [f"{A_SAY} more", f"{A_CALL}{A_SAY}"],
    ),
    "triggered_tags exactly one": (
        {**TRIGGERED, "at_least_one": True, "stop_after_first": True},
        [A_CALL, A_SAY],
        ["", f"a {A_CALL}", f"{A_CALL} b"],
    ),
    "triggered_tags excludes": ({**TRIGGERED, "excludes": ["STOP"]}, [f"a {A_SAY} b"], ["a STOP", f"{A_CALL}STOP"]),
    "tags_with_separator": (
        SEPARATED,
        ["", A_CALL, f"{A_CALL},{A_SAY},{A_CALL}"],
        [f"{A_CALL}{A_SAY}", "text", f"{A_CALL},"],
    ),
    "tags_with_separator exactly one": (
        {**SEPARATED, "at_least_one": True, "stop_after_first": True},
        [A_SAY],
        ["", f"{A_SAY},{A_SAY}"],
    ),
    "reasoning, then tool calls in text": (
        {"type": "sequence", "elements": [tag("<think>", {"type": "any_text"}, "</think>"), TRIGGERED]},
        [f"<think>hmm</think>ok {A_CALL}", "<think></think>"],
        ["ok", f"<think>hmm</think>{A_CALL[:-1]}"],
    ),
}


def whole(matcher, tokenizer, text: str) -> bool:
    """Whether the grammar takes `text` whole and may end there (an EOS after it)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return matcher.valid_prefix([*ids, EOS]) == len(ids) + 1


def structural_tag(fmt) -> StructuredOutputs:
    from backends.serving.structured_params import parse_structured

    return parse_structured({"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": fmt}}})


@pytest.mark.parametrize("case", FORMATS)
def test_each_structural_tag_format_takes_what_xgrammar_s_spec_says(grammars, tokenizer, case):
    fmt, taken, refused = FORMATS[case]
    matcher = grammars.matcher(structural_tag(fmt))
    assert [t for t in taken if not whole(matcher, tokenizer, t)] == []
    assert [t for t in refused if whole(matcher, tokenizer, t)] == []


def test_the_legacy_structural_tag_is_the_triggered_tags_it_stands_for(grammars, tokenizer):
    """xgrammar's StructuralTag.from_legacy_structural_tag: the same strings either way."""
    legacy = grammars.matcher(StructuredOutputs("structural_tag", json.dumps(TAG)))
    (structure,) = TAG["structures"]
    as_format = grammars.matcher(
        structural_tag(
            {
                "type": "triggered_tags",
                "triggers": TAG["triggers"],
                "tags": [tag(structure["begin"], {"type": "json_schema", "json_schema": SCHEMA}, structure["end"])],
            }
        )
    )
    for text in ("", "text", f"a\n<animal>{ANIMAL}</animal> b", "a\nb", "a\n<animal>1</animal>"):
        assert whole(legacy, tokenizer, text) == whole(as_format, tokenizer, text), text


@pytest.mark.parametrize(
    "fmt,message",
    [
        ({"type": "token", "token": 1}, r"format\.type: format type 'token' is not supported: token-level"),
        (
            tag("<a>", {"type": "any_tokens"}, "</a>"),
            r"format\.content\.type: format type 'any_tokens' is not supported",
        ),
        ({"type": "dispatch", "rules": []}, r"format\.type: format type 'dispatch' is not supported"),
        (
            {"type": "qwen_xml_parameter", "json_schema": SCHEMA},
            r"format\.type: format type 'qwen_xml_parameter' is not supported",
        ),
        (
            {"type": "json_schema", "json_schema": SCHEMA, "style": "qwen_xml"},
            r"format\.style: style 'qwen_xml' is not served",
        ),
        (
            {"type": "json_schema", "json_schema": SCHEMA, "any_order": True},
            r"format\.any_order: any_order is not served",
        ),
        ({"type": "any_text", "max_tokens": 8}, r"format\.max_tokens: a token budget is not served"),
        (
            {"type": "tag", "begin": {"type": "token", "token": 1}, "content": const("x"), "end": "y"},
            r"format\.begin: token-level",
        ),
        ({"type": "pattern"}, r"format\.type: unknown format type 'pattern'; supported: const_string, json_schema"),
        ({"value": "x"}, r"format\.type: needs a type"),
        ({"type": "const_string"}, r"format\.value: missing"),
        ({"type": "const_string", "value": "x", "values": []}, r"format\.values: unknown field"),
        (
            {
                **SEPARATED,
                "tags": [CALL, tag("<b>", {"type": "json_schema", "json_schema": {"properties": 5}}, "</b>")],
            },
            r"format\.tags\[1\]\.content\.json_schema: cannot be compiled",
        ),
        (
            {**TRIGGERED, "tags": [CALL, {"begin": "<g=x>", "content": const("x"), "end": ""}]},
            r"format\.tags\[1\]\.begin: '<g=x>' starts with none of the triggers",
        ),
        ({**TRIGGERED, "triggers": ["<f", "<f="]}, r"format\.tags\[0\]\.begin: '<f=animal>' starts with several"),
        ({**TRIGGERED, "at_least_one": "yes"}, r"format\.at_least_one: must be true or false"),
        ({"type": "regex", "pattern": "(a"}, r"format\.pattern: cannot be compiled"),
        ({"type": "grammar", "grammar": "root ::= undefined"}, r"format\.grammar: cannot be compiled"),
        ({"type": "sequence", "elements": []}, r"format\.elements: must be a non-empty list"),
        (
            {"type": "repeat", "min": 3, "max": 2, "content": const("x")},
            r"format\.max: must be -1 \(unbounded\) or at least min",
        ),
        (
            {"type": "sequence", "elements": [{"type": "any_text"}, const("!")]},
            r"format\.elements\[0\]: text of unbounded length must end its tag or the output",
        ),
        (
            tag("<a>", {"type": "any_text"}, ["", "</a>"]),
            r"format\.content: text of unbounded length needs non-empty end strings",
        ),
    ],
)
def test_a_structural_tag_is_refused_naming_the_part_at_fault(grammars, fmt, message):
    with pytest.raises(GrammarError, match="structured_outputs.structural_tag." + message) as refused:
        grammars.matcher(structural_tag(fmt))
    assert isinstance(refused.value, RequestError)


@pytest.mark.parametrize(
    "tag_spec,message",
    [
        ({"type": "structural_tag"}, r'structural_tag: needs a "format"'),
        ({"type": "json_schema", "format": const("x")}, r'structural_tag\.type: must be "structural_tag"'),
        ({"format": const("x"), "triggers": []}, r"structural_tag\.triggers: unknown field"),
        (
            {**TAG, "triggers": ["<"]},
            r"structural_tag\.structures\[0\]\.begin: '\\n<animal>' starts with none of the triggers",
        ),
        (
            {**TAG, "structures": [{"begin": "\n", "schema": 5, "end": ""}]},
            r"structural_tag\.structures\[0\]\.schema: must be a JSON schema",
        ),
    ],
)
def test_a_structural_tag_s_own_fields_are_checked(grammars, tag_spec, message):
    with pytest.raises(GrammarError, match="structured_outputs." + message):
        grammars.matcher(StructuredOutputs("structural_tag", json.dumps(tag_spec)))


def test_a_bad_constraint_fails_only_its_own_request(runner, tokenizer, grammars):
    for spec, words in (
        (StructuredOutputs("json", '{"type": "object", "properties": 5}'), "structured_outputs.json"),
        (StructuredOutputs("json", "{not json"), "JSON schema"),
        (StructuredOutputs("regex", "(unclosed"), "structured_outputs.regex"),
        (StructuredOutputs("grammar", "start: undefined_rule"), "structured_outputs.grammar"),
    ):
        with pytest.raises(GrammarError, match=words) as failed:
            generate_local(PROMPT, tokenizer, runner, max_tokens=8, grammars=grammars, structured=spec)
        assert isinstance(failed.value, RequestError) and "cannot be compiled" in str(failed.value)
    ids, _ = generate_local(PROMPT, tokenizer, runner, max_tokens=40, grammars=grammars, structured=CONSTRAINTS["json"])
    assert holds("json", tokenizer.decode(ids[:-1]))
    assert not runner.sequences


def test_compiled_once_off_the_calling_thread(tokenizer, runner):
    compiler = GrammarCompiler(tokenizer, runner.logits_size, {EOS})
    spec = StructuredOutputs("regex", "[0-9]{4}")
    first, second = compiler.compile(spec), compiler.compile(spec)
    assert first is second
    compiler.close()
    compiler, threads = GrammarCompiler(tokenizer, runner.logits_size, {EOS}), []
    build = compiler._build
    compiler._build = lambda s: threads.append(threading.current_thread().name) or build(s)
    compiler.matcher(spec)
    compiler.matcher(spec)
    assert len(threads) == 1 and threads[0].startswith("grammar")
    compiler.close()


def test_refused_by_name_without_a_compiler(runner, tokenizer):
    with pytest.raises(RequestError, match=r"structured outputs \(regex\) are not served here"):
        generate_local(PROMPT, tokenizer, runner, max_tokens=8, structured=CONSTRAINTS["regex"])


# ----------------------------------------------------------------------- lossless under a mask


@pytest.mark.parametrize("method", ["ngram", "suffix", "suffix-tree", "draft_model", "medusa"])
@pytest.mark.parametrize("kind", ["json", "regex", "gbnf"])
def test_greedy_constrained_speculative_is_constrained_plain(
    method, kind, runner, tokenizer, grammars, tiny_model_dir, tiny_draft_dir, medusa_dir
):
    service = method_service(method, tiny_model_dir, tiny_draft_dir, medusa_dir)
    spec = CONSTRAINTS[kind]
    reference = constrained_greedy_reference(tiny_model_dir, grammars, spec, PROMPT, 40)
    ids, stats = generate_local(PROMPT, tokenizer, runner, service, max_tokens=40, grammars=grammars, structured=spec)
    assert ids == reference, (method, kind)
    assert stats.acceptance.num_accepted_tokens > 0
    assert service.num_sequences == 0 and not runner.sequences


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_bf16_constrained_speculative_is_bf16_constrained_plain(
    method, bf16_runner, tokenizer, tiny_model_dir, tiny_draft_dir, medusa_dir
):
    assert bf16_runner.batch_invariant
    grammars = GrammarCompiler(tokenizer, bf16_runner.logits_size, {EOS})
    for kind in ("json", "regex"):
        spec = CONSTRAINTS[kind]
        plain, _ = generate_local(PROMPT, tokenizer, bf16_runner, max_tokens=40, grammars=grammars, structured=spec)
        service = method_service(method, tiny_model_dir, tiny_draft_dir, medusa_dir)
        ids, _ = generate_local(
            PROMPT, tokenizer, bf16_runner, service, max_tokens=40, grammars=grammars, structured=spec
        )
        assert ids == plain and holds(kind, tokenizer.decode(ids[:-1])), (method, kind)
    grammars.close()


def test_an_unconstrained_row_beside_a_constrained_one_is_unchanged(runner, tokenizer, grammars):
    """Plain steps of two sequences in one forward: the unconstrained one emits what it emits
    alone, and the constrained one only what its grammar allows."""
    prompt = tokenizer(PROMPT)["input_ids"]

    def decode(matchers: list) -> list[list[int]]:
        """12 plain steps of len(matchers) sequences batched (None: unconstrained)."""
        outs = [[] for _ in matchers]
        for step in range(12):
            batch = [
                VerifyRequest(
                    100 + i,
                    out[-1:] or prompt,
                    [],
                    SamplingParams() if step == 0 else None,
                    max_new_tokens=12 if step == 0 else None,
                    token_mask=None if matcher is None else matcher.masks(Draft()),
                )
                for i, (out, matcher) in enumerate(zip(outs, matchers))
            ]
            for out, matcher, result in zip(outs, matchers, runner.verify_batch(batch)):
                out += result.token_ids
                if matcher is not None:
                    matcher.advance(result.token_ids)
        for i in range(len(matchers)):
            runner.release(100 + i)
        return outs

    [alone] = decode([None])
    unconstrained, constrained = decode([None, grammars.matcher(CONSTRAINTS["regex"])])
    assert unconstrained == alone
    assert tokenizer.decode(constrained).startswith(("the ", "a "))


# ----------------------------------------------------------------------- sampling under a mask

TEMPERATURE, TOP_K, SAMPLES = 1.5, 4, 600
SAMPLED = StructuredOutputs("regex", "[a-z ]+")


def masked_marginals(
    model_dir, tokenizer, grammars, num_tokens: int, spec: StructuredOutputs = SAMPLED
) -> list[dict[int, float]]:
    """The exact distribution of each of the first tokens sampled under the mask (the target's
    logits masked, then temperature and top-k), summed over every path before it."""
    model, _ = load_hf_model(str(model_dir))
    marginals, paths = [], {(): 1.0}
    prompt = tokenizer(PROMPT)["input_ids"]
    for _ in range(num_tokens):
        marginal: dict[int, float] = {}
        longer: dict[tuple, float] = {}
        for path, p in paths.items():
            matcher = grammars.matcher(spec)
            matcher.advance(list(path))
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([prompt + list(path)])).logits[0, -1:]
            masked = apply_token_mask(logits, matcher.masks(Draft()))[0] / TEMPERATURE
            top = masked.topk(TOP_K)
            for token, q in zip(top.indices.tolist(), top.values.softmax(-1).tolist()):
                if q > 0:
                    marginal[token] = marginal.get(token, 0.0) + p * q
                    longer[path + (token,)] = p * q
        marginals.append(marginal)
        paths = longer
    return marginals


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampling_under_a_mask_keeps_the_masked_distribution(
    method, runner, tokenizer, grammars, tiny_model_dir, tiny_draft_dir, medusa_dir
):
    exact = masked_marginals(tiny_model_dir, tokenizer, grammars, 2)
    assert max(exact[0].values()) < 0.8  # no single token dominates
    service = method_service(method, tiny_model_dir, tiny_draft_dir, medusa_dir)
    outputs, drafted = [], 0
    for seed in range(SAMPLES):
        sampling = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, seed=seed)
        ids, stats = generate_local(
            PROMPT,
            tokenizer,
            runner,
            service,
            set(),
            max_tokens=2,
            sampling=sampling,
            grammars=grammars,
            structured=SAMPLED,
        )
        outputs.append(ids)
        drafted += stats.acceptance.num_draft_tokens
    assert drafted > SAMPLES // 2  # the drafts were verified under the mask, not skipped
    for position in range(2):
        tv = coarse_total_variation([ids[position] for ids in outputs], exact[position])
        assert tv < 0.09, (method, position, tv)


def test_sampling_at_a_split_keeps_the_masked_distribution(runner, tokenizer, grammars, tiny_model_dir):
    """The two splits of ` b` as sibling drafts (one-hot, tried in turn): the fifth and sixth
    tokens are sampled as plain decoding under the mask samples them."""
    exact = masked_marginals(tiny_model_dir, tokenizer, grammars, 6, SPLIT)
    assert max(exact[4].values()) < 0.8  # the split is the target's choice, not a sure thing
    outputs = []
    for seed in range(SAMPLES):
        sampling = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, seed=seed)
        request = {"max_tokens": 6, "sampling": sampling, "grammars": grammars, "structured": SPLIT}
        outputs.append(generate_local(PROMPT, tokenizer, runner, None, set(), **request)[0])
    for position in (4, 5):
        tv = coarse_total_variation([ids[position] for ids in outputs], exact[position])
        assert tv < 0.09, (position, tv)


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_the_valid_prefix_is_what_the_masks_allow_one_token_at_a_time(kind, grammars, tokenizer):
    """llguidance's validate_tokens (valid_prefix) against the masks walked token by token, on
    random drafts that stray from the grammar at random places: the same count every time."""
    rng = random.Random(kind)
    vocab = len(tokenizer)

    def allowed(matcher) -> list[int]:
        mask = allowed_tokens(matcher.masks(Draft()), grammars.vocab_size)[0]
        return [t for t in mask.nonzero().flatten().tolist() if t != EOS]

    for _ in range(40):
        matcher, walker = grammars.matcher(CONSTRAINTS[kind]), grammars.matcher(CONSTRAINTS[kind])
        draft, expected = [], None
        for i in range(6):
            ok = allowed(walker)
            token = rng.choice(ok) if ok and rng.random() < 0.8 else rng.randrange(EOS + 1, vocab)
            draft.append(token)
            if expected is None and token not in ok:
                expected = i
            if expected is None:
                walker.advance([token])
        assert matcher.valid_prefix(draft) == (len(draft) if expected is None else expected), draft
