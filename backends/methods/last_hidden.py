"""The proposer shared by heads that draft from the target's last hidden state alone, with no
cache of their own: `medusa` and `mlp_speculator`.

Delivery contract: `DraftRequest.hidden_states` as for EAGLE (backends/methods/eagle.py): rows
[r, 1, H_t] of the target's final normed state (layer id -1) ending at position n-2, the state
that produced the last token x_{n-1}. Only that last row is read; earlier rows (the prompt,
steps without a draft call) need no state here, so nothing is kept per sequence.

A head implements `begin(hidden [B, H_t]) -> state` and
`step(i, state, tokens [B]) -> (logits [B, V_d], state)`: draft i from the state and the
previous token (x_{n-1} for i = 0, then draft i-1). Medusa ignores the tokens (head i reads the
same state); the MLP speculator feeds them through its stages. `num_steps` bounds i and
`draft_to_target` (or None) maps a draft-vocabulary id to a target id.

Greedy drafts are argmax and come without probabilities (one-hot, backends/methods/drafts.py);
`probabilistic` drafts are sampled from the softmax of each step's logits at the request's
temperature and come with those probabilities over the target vocabulary (0 outside a
truncated draft vocabulary).
"""

from __future__ import annotations

import torch

from backends.methods.drafts import gather_drafts
from backends.methods.head_proposer import HeadProposer
from backends.serving.proposer import Draft, DraftRequest


class LastHiddenProposer(HeadProposer):
    hidden_layer_ids = (-1,)  # the target's final normed state; nothing is kept per sequence

    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest]) -> list[Draft]:
        drafts = [Draft() for _ in batch]
        rows, counts, states, tokens, temperatures, generators = [], [], [], [], [], []
        for i, req in enumerate(batch):
            k = min(req.num_draft_tokens, self.max_model_len - len(req.token_ids), self.head.num_steps)
            if req.hidden_states is None or k <= 0:
                continue  # the target has not run yet (first step), or no room
            states.append(self._last_state(req))
            rows.append(i)
            counts.append(k)
            tokens.append(req.token_ids[-1])
            temperatures.append(req.temperature)
            generators.append(self.generator_for(req))
        if not rows:
            return drafts
        hidden = torch.stack(states).to(self.device, self.dtype)
        ids = torch.tensor(tokens, device=self.device)
        steps = self.draft_steps(hidden, ids, max(counts), temperatures, generators)
        for i, drafted, probs in zip(rows, *gather_drafts(steps, counts)):
            drafts[i] = Draft(drafted, probs)
        return drafts

    def draft_steps(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        num_steps: int,
        temperatures: list[float],
        generators: list[torch.Generator | None],
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each draft step's (target ids [B], probabilities [B, V] or None) from the final states
        `hidden` [B, H_t] and the last tokens [B]: the head step by step, each step fed the
        drafts of the one before."""
        state, steps = self.head.begin(hidden), []
        for step in range(num_steps):
            logits, state = self.head.step(step, state, tokens)
            tokens, probs = self.sample(logits, temperatures, generators)
            steps.append((tokens, probs))
        return steps

    def _last_state(self, req: DraftRequest) -> torch.Tensor:
        hidden, width = req.hidden_states, self.head.target_hidden_size
        if hidden.dim() != 3 or hidden.shape[0] < 1 or hidden.shape[1:] != (1, width):
            raise ValueError(
                f"sequence {req.seq_id}: hidden_states has shape {list(hidden.shape)}; expected "
                f"[rows >= 1, 1, {width}] (the target's final hidden state, layer -1)"
            )
        return hidden[-1, 0]
