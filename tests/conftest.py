from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from tests.tiny_model import build_tiny_model

NGRAM_CONFIG = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def start_server(tmp_path: Path, model: str, speculative_config: str = NGRAM_CONFIG,
                 require_all_models: bool = True, instance_kinds: dict[str, str] | None = None,
                 per_model: dict[str, dict[str, str]] | None = None, **common):
    from client.cli.launcher import RepositoryOverrides, TritonServer

    http, grpc, metrics = free_ports(3)
    per_model = per_model or {}
    overrides = RepositoryOverrides(
        common={"model": model, "dtype": "float32", **common},
        per_model={**per_model, "drafter": {"speculative_config": speculative_config, **per_model.get("drafter", {})}},
        instance_kinds=instance_kinds or {},
    )
    return TritonServer(http_port=http, grpc_port=grpc, metrics_port=metrics, overrides=overrides,
                        log_path=tmp_path / "server.log").start(require_all_models=require_all_models)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    """A smaller sibling of the tiny model (same tokenizer, other weights): a draft model."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1, num_layers=1)


@pytest.fixture(scope="session")
def tiny_hetero_dir(tmp_path_factory) -> Path:
    """A drafter with another tokenizer (a smaller BPE vocabulary learns other merges)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-hetero"), seed=2, vocab_size=300, num_layers=1)


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("tiny-server"), str(tiny_model_dir),
                          sequence_idle_timeout_s="5")
    yield server
    server.stop()


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


# The target of a module's in-process drafter tests, and what they read from it: the tiny
# model unless the module overrides `target_dir` (test_eagle.py: tiny3_model_dir).
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
