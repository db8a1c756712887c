"""Fixtures shared by tests/unit and tests/e2e (tests/e2e/conftest.py adds the shared
server), and the markers: `unit` and `e2e` by directory, `slow` on tests that load the real
SmolLM2-135M weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# First, before anything imports transformers' models (which import triton): without CUDA,
# kernels/ puts triton in interpreter mode, and only a triton imported after that runs the
# OpenAI Triton kernels' tests; otherwise they fail depending on which test file ran first.
import kernels  # noqa: F401, I001
from backends.runtime import THREADS_ENV
from tests.fixtures import training
from tests.fixtures.helpers import built_once_per_run
from tests.fixtures.tiny_model import build_tiny_model

TESTS = Path(__file__).resolve().parent

# Under pytest-xdist (`make test` runs two workers): each worker and the servers it starts
# compute on one thread. Two teams of two threads on two cores spin-wait on each other (3-10x
# slower steps); one thread each lets a worker compute while the other waits on a server.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault(THREADS_ENV, "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """`-m unit` (in process), `-m e2e` (a real tritonserver, or the CLI that starts one) and
    `-m slow` select by where a test lives and what it loads, so no test carries them by hand."""
    for item in items:
        path = Path(item.path).resolve()
        if TESTS in path.parents:
            kind = path.relative_to(TESTS).parts[0]
            if kind in ("unit", "e2e"):
                item.add_marker(kind)
        if "smollm2_dir" in getattr(item, "fixturenames", ()):
            item.add_marker("slow")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    """A smaller sibling of the tiny model (same tokenizer, other weights): a draft model."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1, num_layers=1)


@pytest.fixture(scope="session")
def tiny_hetero_dir(tmp_path_factory) -> Path:
    """A drafter with another tokenizer (a smaller BPE vocabulary learns other merges)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-hetero"), seed=2, vocab_size=300, num_layers=1)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from backends.runtime.model_store import fetch

    return fetch("smollm2-135m")


@pytest.fixture(scope="session")
def tiny3_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with a third (random) decoder layer appended: eagle3's default aux
    layers (2, L//2, L-3) are distinct only for L = 3 or L >= 7."""
    from transformers import LlamaForCausalLM

    from backends.runtime.model_store import load_tokenizer

    trained = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(trained.config.__class__(**{**trained.config.to_dict(), "num_hidden_layers": 3}))
    model.load_state_dict(trained.state_dict(), strict=False)
    out = tmp_path_factory.mktemp("tiny3")
    model.save_pretrained(out)
    load_tokenizer(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture
def mkmodel(tmp_path_factory):
    """make(name, **config): a model directory holding only that config.json, for the config
    tests. The base dir name is neutral on purpose: detection looks for 'eagle-', 'eagle3',
    'dflash', 'dspark' in the *whole* path."""
    base = tmp_path_factory.mktemp("models")

    def make(name: str, **config) -> str:
        d = base / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        return str(d)

    return make


# The target of a module's in-process drafter tests, and what they read from it: the tiny
# model unless the module overrides `target_dir` (the three-layer one: helpers.three_layer_target_dir).
@pytest.fixture(scope="module")
def target_dir(tiny_model_dir) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="module")
def target(target_dir):
    from backends.methods.head_checkpoint import TargetInfo

    return TargetInfo.load(target_dir)


@pytest.fixture(scope="module")
def runner(target_dir):
    from backends.serving.target import TargetRunner

    return TargetRunner(target_dir, dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    from backends.runtime.model_store import load_tokenizer

    return load_tokenizer(target_dir)


@pytest.fixture(scope="module")
def target_weights(target_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(target_dir / "model.safetensors")


# The trainer tests' heads, trained once per run (tests/fixtures/training.py; under pytest-xdist
# by the first worker that needs them): in-process checks in tests/unit, the same heads served in
# tests/e2e. On one torch thread: tensors this small trained 10-20x slower on two threads whenever
# the 2-core host had other work (the five heads 11 s against 184 s, the EAGLE heads 13 s
# against 223 s).
@pytest.fixture(scope="session")
def training_target_dir(tmp_path_factory) -> Path:
    return built_once_per_run(tmp_path_factory, "train-target", training.build_training_target)


@pytest.fixture(scope="session")
def trained_eagle_heads(training_target_dir, tmp_path_factory) -> dict:
    return built_once_per_run(tmp_path_factory, "eagle-heads", training.train_eagle_heads, training_target_dir)


@pytest.fixture(scope="session")
def heads_corpus(training_target_dir, tmp_path_factory):
    return built_once_per_run(tmp_path_factory, "heads-corpus", training.heads_corpus, training_target_dir)


@pytest.fixture(scope="session")
def trained_heads(heads_corpus, training_target_dir, tmp_path_factory) -> dict:
    return built_once_per_run(
        tmp_path_factory, "trained-heads", training.train_heads, heads_corpus, training_target_dir
    )
