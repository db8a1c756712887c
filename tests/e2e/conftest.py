"""The fixtures only the end-to-end tests use: the shared tiny servers."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.servers import NON_ASCII_NOTE, fixture_server
from tests.fixtures.synthetic_checkpoints import write_eagle1


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir, tmp_path_factory):
    """The shipped repository on the tiny model (ngram): it verifies in the orchestrator's
    process (verifier_in_process "auto"), the verifier model standing by. Each config.pbtxt
    carries a parameter in non-ASCII text, which each model reads (test_server.py)."""
    note = {"note": NON_ASCII_NOTE}
    per_model = {"speculative": note, "verifier": note, "drafter": note}
    yield from fixture_server(
        tmp_path_factory, "tiny-server", tiny_model_dir, sequence_idle_timeout_s="5", per_model=per_model
    )


@pytest.fixture(scope="session")
def bls_server(tiny_model_dir, tmp_path_factory):
    """The verifier model verifying over BLS (verifier_in_process "false"), with an EAGLE-1
    head that drafts from the hidden states each verification returns across the wire."""
    head = tmp_path_factory.mktemp("eagle1") / "head"
    write_eagle1(head, tiny_model_dir)
    config = json.dumps({"method": "eagle", "model": str(head), "num_speculative_tokens": 3})
    yield from fixture_server(
        tmp_path_factory,
        "bls-server",
        tiny_model_dir,
        config,
        per_model={"speculative": {"verifier_in_process": "false"}},
    )
