"""Structured outputs in process (backends/structured): every kind of constraint holds, greedy
constrained speculative output is constrained plain output token for token (every method;
float32 and bf16), sampling under a mask keeps the masked target distribution, forced tokens
are free drafts, and a constraint that cannot be compiled fails only its own request."""

from __future__ import annotations

import json
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


def masked_marginals(model_dir, tokenizer, grammars, num_tokens: int) -> list[dict[int, float]]:
    """The exact distribution of each of the first tokens sampled under the mask (the target's
    logits masked, then temperature and top-k), summed over every path before it."""
    model, _ = load_hf_model(str(model_dir))
    marginals, paths = [], {(): 1.0}
    prompt = tokenizer(PROMPT)["input_ids"]
    for _ in range(num_tokens):
        marginal: dict[int, float] = {}
        longer: dict[tuple, float] = {}
        for path, p in paths.items():
            matcher = grammars.matcher(SAMPLED)
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
