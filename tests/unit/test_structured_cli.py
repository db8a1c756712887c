"""Structured outputs from the command line: `tritonspec generate --json-schema / --regex /
--choice` send vLLM's `structured_outputs`, and `tritonspec bench --structured` runs the json
prompt set (extraction and tool calls) with each prompt's schema, which the model reads as
one constraint."""

from __future__ import annotations

import json

import pytest

from backends.serving.request import parse_request
from client.cli import bench
from client.cli.main import _structured_outputs, build_parser, main


def generate_args(*argv: str):
    return build_parser().parse_args(["generate", "hello", *argv])


def test_generate_flags_become_structured_outputs(tmp_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    assert _structured_outputs(generate_args("--json-schema", str(tmp_path / "schema.json"))) == {"json": schema}
    assert _structured_outputs(generate_args("--regex", "[0-9]+")) == {"regex": "[0-9]+"}
    assert _structured_outputs(generate_args("--choice", "yes", "--choice", "no")) == {"choice": ["yes", "no"]}
    assert _structured_outputs(generate_args()) is None
    with pytest.raises(SystemExit):  # one kind per request
        generate_args("--regex", "a", "--choice", "b")


def test_an_unreadable_schema_is_named_before_anything_is_sent(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["generate", "hi", "--url", "127.0.0.1:1", "--json-schema", str(tmp_path / "bad.json")]) == 2
    assert "--json-schema: cannot read a JSON schema from" in capsys.readouterr().err


def test_the_json_prompt_set_pairs_each_prompt_with_its_schema():
    version, prompts = bench.load_prompts(prompt_set="json")
    constraints = bench.load_constraints(prompts, "json")
    assert version and len(prompts["json"]) == len(constraints["json"]) == 6
    for prompt, constraint in zip(prompts["json"], constraints["json"]):
        assert json.dumps(constraint["json"]) in prompt  # the prompt shows the schema it must follow
        sampling = json.dumps({"structured_outputs": constraint})
        assert parse_request({"text_input": prompt}, "", sampling).structured.kind == "json"
    with pytest.raises(ValueError, match=r"categories \['code'\] have none"):
        bench.load_constraints(bench.load_prompts(["code"])[1], "short")


def test_bench_sends_each_prompts_constraint_with_its_plain_speculative_and_forced_runs(monkeypatch):
    """Plain: constrained without forced drafts (the issue's baseline, the peers' way);
    speculative: the method and forced tokens; forced: no drafter, forced tokens alone."""
    sent = []
    monkeypatch.setattr(bench, "grpc_generate", lambda url, prompt, **kw: sent.append((prompt, kw)))
    prompts = {"json": ["p0", "p1"]}
    constraints = {"json": [{"json": {"type": "object"}}, {"regex": "a+"}]}
    runs = bench.measure("url", prompts, 8, 1, "t", ignore_eos=False, constraints=constraints)
    assert list(runs["json"]) == ["plain", "speculative", "forced"]
    sent = sent[1:]  # after the warm-up
    assert [(p, kw.get("num_draft_tokens")) for p, kw in sent] == [(p, k) for p in ("p0", "p1") for k in (0, None, 0)]
    assert [kw["sampling_parameters"] for _, kw in sent] == [
        {"structured_outputs": c, "forced_drafts": forced}
        for c in constraints["json"]
        for forced in (False, True, True)
    ]
