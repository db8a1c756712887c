"""A worked `custom_class` proposer: drafts by following, from the last token, the token
that came after each token the last time it appeared in this sequence (a bigram table per
sequence, built from prompt + output as they grow).

Serve it with
    tritonspec serve -sc '{"model": "client.examples.bigram_proposer.BigramProposer",
                           "num_speculative_tokens": 4}'
(the dotted path alone selects method "custom_class"; the module must be importable by the
venv's Python, which this package is).
"""

from __future__ import annotations

from backends.config import DrafterConfig
from backends.serving.proposer import Draft, DraftRequest, Proposer, ProposerContext


class BigramProposer(Proposer):
    def __init__(self) -> None:
        # seq_id -> (tokens already read into the table, {token: the token after it})
        self._tables: dict[int, tuple[int, dict[int, int]]] = {}

    @classmethod
    def from_config(cls, config: DrafterConfig, ctx: ProposerContext) -> BigramProposer:
        # config is the resolved speculative config; ctx has max_model_len, target_model (a
        # path), dtype, device and seed. This proposer needs none of them.
        return cls()

    def propose(self, batch: list[DraftRequest]) -> list[Draft]:
        return [Draft(self._draft(req)) for req in batch]

    def release(self, seq_id: int) -> None:
        self._tables.pop(seq_id, None)

    def _draft(self, req: DraftRequest) -> list[int]:
        # token_ids is the whole sequence and only grows, so read just the new pairs.
        read, table = self._tables.get(req.seq_id, (0, {}))
        ids = req.token_ids
        for i in range(max(read - 1, 0), len(ids) - 1):
            table[ids[i]] = ids[i + 1]
        self._tables[req.seq_id] = (len(ids), table)
        drafts, token = [], ids[-1]
        while len(drafts) < req.num_draft_tokens and token in table:
            token = table[token]
            drafts.append(token)
        return drafts
