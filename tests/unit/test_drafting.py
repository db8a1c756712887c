import pytest

from backends.config import SpeculativeConfig, SpeculativeConfigError
from backends.serving.drafting import DraftCall, DraftService
from backends.serving.proposer import Draft, Proposer


class RecordingProposer(Proposer):
    def __init__(self):
        self.seen = []
        self.released = []

    def propose(self, batch):
        self.seen.append([(r.seq_id, list(r.token_ids), r.num_tokens) for r in batch])
        return [Draft([7] * r.num_tokens) for r in batch]

    def release(self, seq_id):
        self.released.append(seq_id)


@pytest.fixture
def service():
    config = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3})
    return DraftService(RecordingProposer(), config)


def test_context_accumulates_and_k_is_clamped(service):
    drafts = service.draft([DraftCall(1, [1, 2, 3], max_tokens=10), DraftCall(2, [9], max_tokens=2)])
    assert [d.token_ids for d in drafts] == [[7, 7, 7], [7, 7]]
    service.draft([DraftCall(1, [4], max_tokens=10, requested=1)])
    assert service.proposer.seen[-1] == [(1, [1, 2, 3, 4], 1)]
    assert service.num_sequences == 2


def test_zero_room_or_zero_requested_skips_the_proposer(service):
    drafts = service.draft([DraftCall(1, [1, 2], max_tokens=0), DraftCall(2, [1], max_tokens=5, requested=0)])
    assert [d.token_ids for d in drafts] == [[], []]
    assert service.proposer.seen == []


def test_too_many_requested_drafts_name_the_input(service):
    with pytest.raises(SpeculativeConfigError, match="num_draft_tokens=4 must be in \\[0, 3\\]"):
        service.draft([DraftCall(1, [1], max_tokens=10, requested=4)])


def test_a_greedy_request_gets_no_draft_probabilities():
    """q is only read by a sampled request's verification: a greedy one's is not sent."""
    import torch

    class SampledProposer(Proposer):
        def propose(self, batch):
            self.temperatures = [r.temperature for r in batch]
            return [Draft([7] * r.num_tokens, torch.full((r.num_tokens, 9), 1 / 9)) for r in batch]

    config = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2})
    service = DraftService(SampledProposer(), config)
    greedy, sampled = service.draft([DraftCall(1, [1], 5, temperature=0.0), DraftCall(2, [1], 5, temperature=0.8)])
    assert service.proposer.temperatures == [0.0, 0.8]
    assert greedy.probs is None and sampled.probs.shape == (2, 9)


def test_release_and_idle_release(service):
    service.draft([DraftCall(1, [1], max_tokens=1), DraftCall(2, [1], max_tokens=1)])
    assert service.release(1) and not service.release(1)
    assert service.proposer.released == [1, 1]
    assert service.release_idle(3600) == []
    assert service.release_idle(0) == [2]
    assert service.num_sequences == 0
