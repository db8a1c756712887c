"""Structured outputs through the real server (the tiny model, ngram drafting, the target
verified in the orchestrator's process): each kind of constraint holds, streamed and not,
alone and batched beside an unconstrained request that stays unchanged; greedy constrained
speculative output is constrained plain output; a structural tag holds inside its tags (the
legacy form and xgrammar's format form); with ignore_eos the output goes on as free text past
the grammar's EOS; a bad schema fails only its own request. Verified in the `verifier` model
over BLS (`bls_server`: an EAGLE head drafting), where the masks travel with the steps, batched
or one request a step, the outputs are the same."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from client.api.triton import GenerationError, grpc_generate, http_generate
from tests.fixtures.helpers import hf_greedy
from tests.fixtures.prompts import ANIMAL_SCHEMA
from tests.fixtures.structured import PROMPT, TAG, check_served_constrained, served_reference, tagged_animals

SCHEMA = ANIMAL_SCHEMA
REGEX = r"(the|a) (fox|dog) (jumps|sleeps)\."
CHOICES = ["def add", "for i in range", "The quick brown fox"]
GRAMMAR = 'start: "print(" NUM ")"\nNUM: /[0-9]/'
# xgrammar's format form of a structural tag: free text until a new line starts one tag (an
# animal object or "none", or a word), and nothing after it.
ANIMAL_OR_NONE = {
    "type": "or",
    "elements": [{"type": "json_schema", "json_schema": SCHEMA}, {"type": "const_string", "value": "none"}],
}
FORMAT_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["\n"],
        "tags": [
            {"type": "tag", "begin": "\n<animal>", "content": ANIMAL_OR_NONE, "end": "</animal>"},
            {"type": "tag", "begin": "\n<word>", "content": {"type": "regex", "pattern": "[a-z]+"}, "end": "</word>"},
        ],
        "stop_after_first": True,
    },
}
CONSTRAINTS = {
    "json": {"json": SCHEMA},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICES},
    "grammar": {"grammar": GRAMMAR},
    "json_object": {"json_object": True},
    "structural_tag": {"structural_tag": FORMAT_TAG},
}


def holds(kind: str, text: str) -> bool:
    if kind == "json":
        value = json.loads(text)
        return value["animal"] in SCHEMA["properties"]["animal"]["enum"] and isinstance(value["jumps"], bool)
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "choice":
        return text in CHOICES
    if kind == "structural_tag":
        found = re.fullmatch(r"[^\n]*\n<(?:animal>(.*)</animal>|word>[a-z]+</word>)", text, re.DOTALL)
        if found is None:
            return False
        return found[1] in (None, "none") or holds("json", found[1])
    return re.fullmatch(REGEX if kind == "regex" else r"print\([0-9]\)", text) is not None


def constrained(server, kind: str, stream: bool = True, sampling: dict | None = None, **inputs):
    """`kind`'s constraint, beside the other `sampling` parameters."""
    sampling = {"structured_outputs": CONSTRAINTS[kind], **(sampling or {})}
    return grpc_generate(server.grpc_url, PROMPT, stream=stream, sampling_parameters=sampling, **inputs)


# The in-process server, and the one whose verifier model gets the masks over BLS.
SERVERS = pytest.mark.parametrize("server", ["tiny_server", "bls_server"])


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_each_kind_holds_streamed_and_not(tiny_server, kind):
    streamed = constrained(tiny_server, kind, max_tokens=64)
    whole = constrained(tiny_server, kind, stream=False, max_tokens=64, exclude_input_in_output=True)
    assert streamed.output_ids == whole.output_ids and streamed.text == whole.text
    if kind != "json_object":  # a tiny random model may write an object longer than max_tokens
        assert streamed.finish_reason == "stop", streamed.text
    if streamed.finish_reason == "stop":
        assert holds(kind, streamed.text), streamed.text
    sampling = json.dumps({"structured_outputs": CONSTRAINTS[kind]})  # HTTP parameters hold scalars only
    sse = http_generate(tiny_server.http_url, PROMPT, stream=True, max_tokens=64, sampling_parameters=sampling)
    assert sse.output_ids == streamed.output_ids


@SERVERS
@pytest.mark.parametrize("kind", ["json", "regex", "grammar"])
def test_greedy_constrained_speculative_is_constrained_plain(request, server, kind):
    server = request.getfixturevalue(server)
    speculative = constrained(server, kind, max_tokens=64)
    plain = constrained(server, kind, max_tokens=64, num_draft_tokens=0)
    assert speculative.output_ids == plain.output_ids
    assert speculative.total_accepted_draft_tokens > 0  # forced tokens and the drafter's drafts


@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
def test_verified_over_bls_a_constrained_output_is_the_in_process_one(tiny_server, bls_server, kind):
    """The masks reach the verifier model with the step batcher's steps, and with the steps a
    sequence that asks for logprobs sends one request each."""
    expected = constrained(tiny_server, kind, max_tokens=64)
    assert expected.finish_reason == "stop" and holds(kind, expected.text), expected.text
    batched = constrained(bls_server, kind, max_tokens=64)
    per_step = constrained(bls_server, kind, stream=False, sampling={"logprobs": 1}, max_tokens=64)
    assert batched.output_ids == per_step.output_ids == expected.output_ids


@pytest.mark.parametrize("stream", [True, False])
def test_verified_over_bls_a_tree_of_forced_splits_gives_the_target_s_constrained_output(
    tiny_server, bls_server, tiny_model_dir, stream
):
    """Forced bytes the target may split two ways are drafted as a tree (both splits; the tiny
    tokenizer's ` b` or ` ` `b`): its rows' masks reach the verifier model over BLS with the
    step batcher's steps, and with one request a step (logprobs); no drafter is called."""
    fields = {"regex": r"return a \+ b[a-z ]*"}
    sampling = {"structured_outputs": fields, **({} if stream else {"logprobs": 1})}
    reference = served_reference(tiny_model_dir, fields, 24)
    for server in (tiny_server, bls_server):
        result = grpc_generate(
            server.grpc_url, PROMPT, stream=stream, sampling_parameters=sampling, max_tokens=24, num_draft_tokens=0
        )
        assert tuple(result.output_ids) == reference
        assert result.total_draft_tokens >= 7  # the first step: 5 forced tokens and the other split


def test_verified_over_bls_the_drafter_s_drafts_are_the_target_s_constrained_output(bls_server, tiny_model_dir):
    """The EAGLE head's drafts, cut by the grammar and verified under the masks over BLS."""
    check_served_constrained(bls_server, tiny_model_dir)


def test_a_structural_tag_holds_inside_its_tags(tiny_server, tiny_model_dir):
    """Free text in which each trigger (a new line) starts a tagged object of the schema."""
    sampling = {"structured_outputs": {"structural_tag": TAG}}
    result = grpc_generate(tiny_server.grpc_url, PROMPT, max_tokens=64, sampling_parameters=sampling)
    assert tuple(result.output_ids) == served_reference(tiny_model_dir, {"structural_tag": TAG}, 64)
    animals = tagged_animals(result.text)
    assert animals and all(a["animal"] in SCHEMA["properties"]["animal"]["enum"] for a in animals), result.text
    assert result.text.count("\n") == result.text.count("\n<animal>"), result.text


def test_a_structural_tag_in_xgrammar_s_format_form(tiny_server, tiny_model_dir):
    """{"type": "structural_tag", "format": ...}, translated for llguidance: the target's own
    constrained output, ended by EOS after its one tag; speculative == plain token for token."""
    speculative = constrained(tiny_server, "structural_tag", max_tokens=64)
    plain = constrained(tiny_server, "structural_tag", max_tokens=64, num_draft_tokens=0)
    assert tuple(speculative.output_ids) == served_reference(tiny_model_dir, CONSTRAINTS["structural_tag"], 64)
    assert speculative.output_ids == plain.output_ids
    assert speculative.finish_reason == "stop" and holds("structural_tag", speculative.text), speculative.text
    assert speculative.total_accepted_draft_tokens > 0  # the forced "<" after the trigger, the EOS


def test_ignore_eos_goes_on_unconstrained_past_the_grammar_s_end(tiny_server, tiny_model_dir):
    """vLLM's behaviour: the grammar ends with an EOS in the output; after it, free text."""
    eos = 0  # the tiny model's <|endoftext|>
    expected = served_reference(tiny_model_dir, {"regex": REGEX}, 32, ignore_eos=True)
    assert eos in expected and len(expected) == 32 and set(expected[expected.index(eos) + 1 :]) != {eos}
    for draft in (None, 0):  # ngram (and forced tokens), then plain
        fixed = {} if draft is None else {"num_draft_tokens": draft}
        result = constrained(tiny_server, "regex", max_tokens=32, ignore_eos=True, **fixed)
        assert tuple(result.output_ids) == expected and result.finish_reason == "length"


@SERVERS
def test_batched_beside_an_unconstrained_request(request, server, tiny_model_dir):
    """Over BLS the constrained steps' mask rows go in one verifier request beside rows with none."""
    server = request.getfixturevalue(server)
    expected = hf_greedy(str(tiny_model_dir), PROMPT, 48)
    alone = {kind: constrained(server, kind, max_tokens=64).output_ids for kind in ("json", "regex", "choice")}
    with ThreadPoolExecutor(8) as pool:
        free = [pool.submit(grpc_generate, server.grpc_url, PROMPT, max_tokens=48) for _ in range(2)]
        bound = {kind: pool.submit(constrained, server, kind, max_tokens=64) for kind in alone}
        for f in free:
            assert tuple(f.result().output_ids) == expected
        for kind, f in bound.items():
            assert f.result().output_ids == alone[kind], kind


def test_a_bad_schema_fails_only_its_own_request(tiny_server, tiny_model_dir):
    bad = {"structured_outputs": {"json": {"type": "object", "properties": 5}}}
    with ThreadPoolExecutor(3) as pool:
        failing = pool.submit(grpc_generate, tiny_server.grpc_url, PROMPT, sampling_parameters=bad, max_tokens=16)
        good = pool.submit(constrained, tiny_server, "json", max_tokens=64)
        free = pool.submit(grpc_generate, tiny_server.grpc_url, PROMPT, max_tokens=24)
        with pytest.raises(GenerationError, match="structured_outputs.json.*cannot be compiled"):
            failing.result()
        assert holds("json", good.result().text)
        assert tuple(free.result().output_ids) == hf_greedy(str(tiny_model_dir), PROMPT, 24)
