"""What the Medusa, MLP speculator, DFlash and DSpark trainers share: draft steps checked
against the target's greedy chain.

These heads draft k tokens from the target's state at t (and the token x_{t+1} it produced)
without seeing the tokens in between the way the target does, so a draft is only worth
learning where the sequence continues as the target itself would: draft d (0-based) predicts
labels[t+1+d], the target's greedy token after x_{t+1+d}, and counts only where
x_{t+1} .. x_{t+1+d} are all the target's greedy tokens (the answers, not the prompts;
when serving, every token a draft follows is the target's or an accepted draft). Steps that
read the tokens before them (the MLP speculator's stages, DSpark's Markov head) are
teacher-forced with those same tokens.

A `StepTrainer` yields each draft step's logits and labels over a set of anchors (b, t); the
loss is the cross entropy per step, later steps weighted down as in EAGLE (and Medusa-1).
In training a random sample of anchors is used (the LM heads dominate CPU time), in
evaluation all of them, in chunks.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from backends.training.eagle import CE_POSITIONS, STEP_DECAY, loss_positions, position_token_loss
from backends.training.trainer import Batch, HeadTrainer, StepMetrics


def greedy_chain(batch: Batch) -> torch.Tensor:
    """[B, T-1]: at t, how many tokens from x_{t+1} on are each the target's greedy token
    after the one before (so drafts from the state at t can be checked that deep)."""
    follows = (batch.token_ids[:, 1:] == batch.labels[:, :-1]) & batch.valid[:, 1:]
    chain = torch.zeros(follows.shape, dtype=torch.long)
    run = torch.zeros(follows.shape[0], dtype=torch.long)
    for t in reversed(range(follows.shape[1])):
        run = (run + 1) * follows[:, t]
        chain[:, t] = run
    return chain


def served_copy(head: nn.Module) -> nn.Module:
    """A copy of `head` with its float weights in bfloat16, as heads are written and served."""
    return copy.deepcopy(head).to(torch.bfloat16)


def draft_labels(head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """Target ids as the head's draft ids (-1 outside its draft vocabulary, if it has one)."""
    to_draft = getattr(head, "target_to_draft", None)
    return labels if to_draft is None else to_draft[labels]


class Anchors(NamedTuple):
    """Where a batch's drafts start: row and position of each anchor, and how many greedy tokens
    of the target follow it (the drafts that can be checked)."""

    rows: torch.Tensor
    positions: torch.Tensor
    depth: torch.Tensor


Prediction = tuple[torch.Tensor, torch.Tensor]  # one draft step's logits and labels


class StepTrainer(HeadTrainer):
    """A HeadTrainer whose loss is the decayed cross entropy of `predictions`."""

    anchors_per_batch = CE_POSITIONS  # training anchors per batch (each costs a vocabulary projection per step)

    def predictions(self, head: nn.Module, batch: Batch, at: Anchors, num_steps: int) -> Iterator[Prediction]:
        """For anchors (at.rows[i], at.positions[i]) with `at.depth[i]` greedy tokens after them,
        yield per draft step d < num_steps the logits and the labels (draft vocabulary) where
        depth > d."""
        raise NotImplementedError

    def loss(self, head: nn.Module, batch: Batch, num_steps: int) -> StepMetrics:
        chain = greedy_chain(batch)
        rows, anchors = loss_positions(chain > 0, head.training, self.anchors_per_batch)
        chunks = (
            [slice(None)]
            if head.training
            else [slice(i, i + self.anchors_per_batch) for i in range(0, len(rows), self.anchors_per_batch)]
        )
        total = torch.zeros(())
        correct, counted = [0] * num_steps, [0] * num_steps
        for chunk in chunks:
            r, a = rows[chunk], anchors[chunk]
            for d, (logits, labels) in enumerate(self.predictions(head, batch, Anchors(r, a, chain[r, a]), num_steps)):
                ce, hits = position_token_loss(logits, labels)
                total = total + STEP_DECAY**d * ce
                correct[d] += hits
                counted[d] += len(labels)
        return StepMetrics(total, correct, counted)
