"""The drafter of `tritonspec soak --chaos`: n-gram drafts, and each fault the soak writes
into the trigger file, once."""

from __future__ import annotations

import pytest

from backends.serving.proposer import DraftRequest
from client.cli import chaos_proposer
from client.cli.chaos_proposer import ChaosNgram


def test_faults_happen_once_each_when_asked(tmp_path, monkeypatch):
    trigger = tmp_path / "fault"
    monkeypatch.setenv("TRITONSPEC_CHAOS_TRIGGER", str(trigger))
    monkeypatch.setattr(chaos_proposer, "SLOW_S", 0.01)
    proposer = ChaosNgram(num_speculative_tokens=3, max_model_len=64)
    batch = [DraftRequest(1, [5, 6, 7, 5, 6], 3)]
    normal = proposer.propose(batch)
    assert normal[0].token_ids == [7, 5, 6]  # prompt lookup: after "5 6" came "7 5 6"
    trigger.write_text("raise")
    with pytest.raises(RuntimeError, match="injected drafter fault"):
        proposer.propose(batch)
    assert not trigger.exists() and proposer.propose(batch)[0].token_ids == normal[0].token_ids
    trigger.write_text("garbage")
    assert proposer.propose(batch)[0].token_ids == [2**40] * 3
    trigger.write_text("slow")
    assert proposer.propose(batch)[0].token_ids == normal[0].token_ids and not trigger.exists()


def test_without_the_variable_it_never_fails(monkeypatch):
    monkeypatch.delenv("TRITONSPEC_CHAOS_TRIGGER", raising=False)
    assert ChaosNgram(2, 64).propose([DraftRequest(1, [1, 2, 1], 2)])[0].token_ids == [2, 1]
