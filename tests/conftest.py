from __future__ import annotations

import socket
from pathlib import Path

import pytest

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
                 require_all_models: bool = True, **common):
    from client.server import RepositoryOverrides, TritonServer

    http, grpc, metrics = free_ports(3)
    overrides = RepositoryOverrides(
        common={"model": model, "dtype": "float32", **common},
        per_model={"drafter": {"speculative_config": speculative_config}},
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
    from backends.model_store import fetch

    return fetch("smollm2-135m")
