"""The fixtures only the end-to-end tests use: the shared tiny servers."""

from __future__ import annotations

import json

import pytest

from tests.fixtures import head_server
from tests.fixtures.servers import NON_ASCII_NOTE, fixture_servers
from tests.fixtures.synthetic_checkpoints import write_eagle1


@pytest.fixture(scope="session")
def shared_servers(tiny_model_dir, tmp_path_factory):
    """tiny_server and bls_server, launched together (the first e2e module uses both)."""
    note = {"note": NON_ASCII_NOTE}
    head = tmp_path_factory.mktemp("eagle1") / "head"
    write_eagle1(head, tiny_model_dir)
    eagle = json.dumps({"method": "eagle", "model": str(head), "num_speculative_tokens": 3})
    specs = {
        "tiny-server": dict(
            model=str(tiny_model_dir),
            sequence_idle_timeout_s="5",
            per_model={"speculative": note, "verifier": note, "drafter": note},
        ),
        "bls-server": dict(
            model=str(tiny_model_dir),
            speculative_config=eagle,
            per_model={"speculative": {"verifier_in_process": "false"}},
        ),
    }
    yield from fixture_servers(tmp_path_factory, specs)


@pytest.fixture(scope="session")
def tiny_server(shared_servers):
    """The shipped repository on the tiny model (ngram): it verifies in the orchestrator's
    process (verifier_in_process "auto"), the verifier model standing by. Each config.pbtxt
    carries a parameter in non-ASCII text, which each model reads (test_server.py)."""
    return shared_servers["tiny-server"]


@pytest.fixture(scope="session")
def bls_server(shared_servers):
    """The verifier model verifying over BLS (verifier_in_process "false"), with an EAGLE-1
    head that drafts from the hidden states each verification returns across the wire."""
    return shared_servers["bls-server"]


@pytest.fixture(scope="module")
def served_heads(request, tiny_model_dir, fitted_dir, tmp_path_factory):
    """The module's fitted head (its `fitted_dir`) served once for each of its
    ServedHeadTests classes (chain, tree), the servers launched together."""
    yield from head_server.served_heads(request.module, tiny_model_dir, fitted_dir, tmp_path_factory)
