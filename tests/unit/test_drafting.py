import pytest
import torch

from backends.config import SpeculativeConfig
from backends.serving.drafting import DraftCall, DraftService
from backends.serving.proposer import Draft, Proposer


class RecordingProposer(Proposer):
    def __init__(self):
        self.seen = []
        self.released = []

    def propose(self, batch):
        self.seen.append(
            [
                (r.seq_id, list(r.token_ids), r.num_draft_tokens, r.num_new, r.num_accepted, r.hidden_states)
                for r in batch
            ]
        )
        return [Draft([7] * r.num_draft_tokens) for r in batch]

    def release(self, seq_id):
        self.released.append(seq_id)


@pytest.fixture
def service():
    config = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3})
    return DraftService(RecordingProposer(), config)


def test_context_accumulates_and_the_proposer_learns_what_was_accepted(service):
    drafts = service.draft([DraftCall(1, [1, 2, 3], num_draft_tokens=3), DraftCall(2, [9], num_draft_tokens=2)])
    assert [d.token_ids for d in drafts] == [[7, 7, 7], [7, 7]]
    # Two of seq 1's three drafts accepted, then the target's correction 5.
    service.draft([DraftCall(1, [7, 7, 5], num_draft_tokens=1, num_accepted=2)])
    ((seq_id, tokens, k, num_new, num_accepted, _),) = service.proposer.seen[-1]
    assert (seq_id, tokens, k, num_new, num_accepted) == (1, [1, 2, 3, 7, 7, 5], 1, 3, 2)
    assert service.num_sequences == 2


def test_a_call_for_zero_drafts_keeps_its_tokens_and_hidden_rows_for_the_next(service):
    """k = 0 (a load spike under the batch-size schedule) must not lose what EAGLE-family
    proposers need: the rows wait, with the acceptance of the proposer's last drafts."""
    service.draft([DraftCall(1, [1, 2, 3], num_draft_tokens=2, hidden_states=torch.zeros(2, 1, 4))])
    service.draft([DraftCall(1, [7, 5], num_draft_tokens=0, hidden_states=torch.ones(2, 1, 4), num_accepted=1)])
    assert len(service.proposer.seen) == 1
    service.draft([DraftCall(1, [6], num_draft_tokens=2, hidden_states=torch.full((1, 1, 4), 2.0), num_accepted=0)])
    ((_, tokens, _, num_new, num_accepted, hidden),) = service.proposer.seen[-1]
    assert tokens == [1, 2, 3, 7, 5, 6] and num_new == 3 and num_accepted == 1
    assert hidden[:, 0, 0].tolist() == [1.0, 1.0, 2.0]


def test_zero_drafts_skip_the_proposer(service):
    drafts = service.draft([DraftCall(1, [1, 2], num_draft_tokens=0), DraftCall(2, [1], num_draft_tokens=0)])
    assert [d.token_ids for d in drafts] == [[], []]
    assert service.proposer.seen == []


def test_a_greedy_request_gets_no_draft_probabilities():
    """q is only read by a sampled request's verification: a greedy one's is not sent."""

    class SampledProposer(Proposer):
        def propose(self, batch):
            self.temperatures = [r.temperature for r in batch]
            return [Draft([7] * r.num_draft_tokens, torch.full((r.num_draft_tokens, 9), 1 / 9)) for r in batch]

    config = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2})
    service = DraftService(SampledProposer(), config)
    greedy, sampled = service.draft([DraftCall(1, [1], 2, temperature=0.0), DraftCall(2, [1], 2, temperature=0.8)])
    assert service.proposer.temperatures == [0.0, 0.8]
    assert greedy.probs is None and sampled.probs.shape == (2, 9)


def test_release_and_idle_release(service):
    service.draft([DraftCall(1, [1], num_draft_tokens=1), DraftCall(2, [1], num_draft_tokens=1)])
    assert service.release(1) and not service.release(1)
    assert service.proposer.released == [1, 1]
    assert service.release_idle(3600) == []
    assert service.release_idle(0) == [2]
    assert service.num_sequences == 0
