"""custom_class: a user's proposer by dotted path. The worked example
(client/examples/bigram_proposer.py) drafts by its bigram table (served:
tests/e2e/test_custom_class_server.py); import errors and interface mismatches are load
errors that name the cause, and a proposer answering the wrong shape fails its requests
clearly."""

from __future__ import annotations

import pytest

from backends.config import SpeculativeConfig
from backends.methods.custom_class import CustomClassProposer
from backends.serving.proposer import DraftRequest, build_proposer

EXAMPLE = "client.examples.bigram_proposer.BigramProposer"
PROMPTS = [
    "def add(a, b):\n    return a + b\ndef add(a, b):",
    "for i in range(10):\n    print(i",
    "The quick brown fox jumps over the lazy dog. The",
]

USER_MODULE = """
from backends.serving.proposer import Draft, Proposer

class NoPropose:
    def release(self, seq_id): ...

class WrongSignature(Proposer):
    def propose(self, batch, k): ...

class Boom(Proposer):
    def __init__(self, config):
        raise RuntimeError("no GPU here")

class BadLayers(Proposer):
    hidden_layer_ids = "all"
    def __init__(self, config): ...

class ListsLikeVllm(Proposer):
    def __init__(self, config): ...
    def propose(self, batch):
        return [[1, 2] for _ in batch]

class TooMany(Proposer):
    def __init__(self, config): ...
    def propose(self, batch):
        return [Draft([1] * (r.num_draft_tokens + 1)) for r in batch]

class Remembers(Proposer):
    # keeps what from_config gave it, under the contract before ProposerContext and under it
    def __init__(self, context):
        self.context = context

class KeywordContext(Remembers):
    @classmethod
    def from_config(cls, config, **context):
        return cls(context)

class NamedKeywords(Remembers):
    @classmethod
    def from_config(cls, config, max_model_len=4096, **_):
        return cls({"max_model_len": max_model_len})

class TakesContext(Remembers):
    @classmethod
    def from_config(cls, config, ctx):
        return cls({"max_model_len": ctx.max_model_len, "target_model": ctx.target_model})

def not_a_class(): ...
"""


def build(model: str, target_dir):
    config = SpeculativeConfig.from_json({"model": model, "num_speculative_tokens": 3}, target_model=str(target_dir))
    assert config.method == "custom_class"
    return build_proposer(config, max_model_len=512, target_model=target_dir)


def test_the_example_drafts_by_its_bigram_table(tiny_model_dir):
    proposer = build(EXAMPLE, tiny_model_dir)
    assert isinstance(proposer, CustomClassProposer) and proposer.hidden_layer_ids == ()
    assert proposer.propose([DraftRequest(1, [1, 2, 3, 1, 2], 3)])[0].token_ids == [3, 1, 2]
    # Later calls read only the new tokens: 2 is now followed by 4.
    assert proposer.propose([DraftRequest(1, [1, 2, 3, 1, 2, 4, 1], 3)])[0].token_ids == [2, 4, 1]
    assert proposer.propose([DraftRequest(2, [5, 6], 3)])[0].token_ids == []  # nothing seen after 6
    proposer.release(1)
    assert proposer.propose([DraftRequest(1, [7, 1], 2)])[0].token_ids == []


@pytest.mark.parametrize("name", ["KeywordContext", "NamedKeywords", "TakesContext"])
def test_from_config_gets_the_context_under_either_contract(name, user_module, tiny_model_dir):
    context = build(f"user_proposers_mod.{name}", tiny_model_dir).inner.context
    assert context["max_model_len"] == 512
    if name != "NamedKeywords":
        assert context["target_model"] == tiny_model_dir


ERRORS = {
    "no.such.module.Proposer": (ImportError, r"Cannot import module 'no\.such\.module' for the custom proposer"),
    "user_proposers_mod.Missing": (AttributeError, r"Module 'user_proposers_mod' has no attribute 'Missing'"),
    "user_proposers_mod.not_a_class": (TypeError, r"'user_proposers_mod\.not_a_class' is a function, not a class"),
    "user_proposers_mod.NoPropose": (
        TypeError,
        r"has no callable propose\(\); implement the interface of "
        r"backends\.serving\.proposer\.Proposer",
    ),
    "user_proposers_mod.WrongSignature": (TypeError, r"propose\(self, batch, k\) does not take \(self, batch\)"),
    "user_proposers_mod.Boom": (
        RuntimeError,
        r"Failed to instantiate custom proposer class "
        r"'user_proposers_mod\.Boom': RuntimeError: no GPU here",
    ),
    "user_proposers_mod.BadLayers": (TypeError, r"hidden_layer_ids must be a tuple of ints, got 'all'"),
}


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_proposers_mod.py").write_text(USER_MODULE)
    (tmp_path / "broken_mod.py").write_text("import not_installed_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("model", ERRORS)
def test_load_errors_name_the_cause(model, user_module, tiny_model_dir):
    error, message = ERRORS[model]
    with pytest.raises(error, match=message):
        build(model, tiny_model_dir)


def test_an_import_error_inside_the_module_is_shown(user_module, tiny_model_dir):
    with pytest.raises(
        ImportError,
        match=r"Cannot import module 'broken_mod' .*ModuleNotFoundError: No module "
        r"named 'not_installed_anywhere'",
    ):
        build("broken_mod.Anything", tiny_model_dir)


def test_wrong_answers_fail_the_request_clearly(user_module, tiny_model_dir):
    batch = [DraftRequest(1, [1, 2, 3], 2)]
    with pytest.raises(
        TypeError, match=r"returned \[1, 2\] for sequence 1; expected a backends\.serving\.proposer\.Draft"
    ):
        build("user_proposers_mod.ListsLikeVllm", tiny_model_dir).propose(batch)
    with pytest.raises(ValueError, match=r"returned 3 drafts for sequence 1, which asked for at most 2"):
        build("user_proposers_mod.TooMany", tiny_model_dir).propose(batch)
