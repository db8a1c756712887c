"""Training DFlash and DSpark block drafters (`tritonspec train dflash|dspark`).

The heads are the modules the proposers run (backends/methods/dflash.py, backends/methods/dspark.py), and a
training example is exactly one proposer pass: for an anchor token x_p (the token the
target just emitted), the context is made from the target's states at positions 0..p-1 of
the window, the block [x_p, MASK, ..., MASK] sits at positions p..p+B-1, attends to all of
that context and (non-causally) to itself, and draft d is read from the convention's slot:
DFlash slot d+1 (the anchor slot's output dropped), DSpark's anchor convention slot d. Draft d
is checked against labels[p+d], the target's greedy token after x_{p+d}, where x_p..x_{p+d} all
follow the target's greedy chain (backends/training/steps.py). Many anchors of one window run
as rows sharing the window's context K/V (`key_valid` hides what lies at or after the anchor).
Training samples anchors at random; evaluation takes them all.

DSpark's Markov head adds its bias slot by slot, teacher-forced: the previous token of draft
d is x_{p+d} (the anchor for d = 0), the token the proposer's chain would have there when its
drafts are right. Its output projection starts at zero (no bias until it has learned one);
the confidence head is left out of the config (vLLM does not use it to cut drafts).

`--ttt-steps` is the number of drafts per pass: block size k+1 for DFlash, k for DSpark. The
target layers are EAGLE-3's (vLLM's default aux layers, low / middle / high), so one cached
states file serves every method. Start: the drafter layer is the target's last layer (Qwen3's
q/k norms start at one), the final norm the target's, `fc` reads mostly the highest layer. The
LM head covers a draft vocabulary (`--draft-vocab-size` most frequent target tokens, the
layout's `draft_vocab_size` + `d2t`), starts as the target's rows for it and is trained (the
whole vocabulary: the target's, frozen). The embedding is the target's, frozen, except the
row of the mask token (the rarest token in the training data), which is learned and written
as `mask_embedding.pt` where the layout leaves the embedding out (DFlash), or in the written
embedding (DSpark's layout carries it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backends.config import aux_layer_ids
from backends.methods.block_checkpoint import default_config as dflash_config
from backends.methods.block_checkpoint import save_head
from backends.methods.dflash import DFlashHead
from backends.methods.dspark import DSparkHead
from backends.methods.dspark import default_config as dspark_config
from backends.methods.head_checkpoint import TargetInfo
from backends.training.data import TrainingData
from backends.training.eagle import init_layer, target_layer
from backends.training.steps import Anchors, Prediction, StepTrainer, draft_labels
from backends.training.trainer import Batch, draft_vocabulary

BLOCK_ANCHORS = 256  # anchors per training batch (each runs a whole block: a draft per slot)
MARKOV_RANK = 64


class MaskEmbedding(nn.Module):
    """The target's embedding, frozen, with a learned row for the mask token."""

    def __init__(self, weight: torch.Tensor, mask_token_id: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float(), requires_grad=False)
        self.num_embeddings, self.embedding_dim = weight.shape
        self.mask_token_id = mask_token_id
        self.mask_row = nn.Parameter(self.weight.mean(0).clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.where((ids == self.mask_token_id)[..., None], self.mask_row, F.embedding(ids, self.weight))

    def as_embedding(self) -> nn.Embedding:
        weight = self.weight.detach().clone()
        weight[self.mask_token_id] = self.mask_row.detach()
        return nn.Embedding.from_pretrained(weight, freeze=True)


class DFlashTrainer(StepTrainer):
    method = "dflash"
    num_steps = 7  # one drafter pass fills the whole block, so a long block costs little
    anchors_per_batch = BLOCK_ANCHORS
    head_class: type[DFlashHead] = DFlashHead

    def layer_ids(self, target: TargetInfo) -> tuple[int, ...]:
        return tuple(sorted(aux_layer_ids({}, {"num_hidden_layers": target.num_layers})))

    def config(self, target: TargetInfo, mask_token_id: int, num_drafts: int) -> dict[str, Any]:
        return dflash_config(
            target,
            mask_token_id=mask_token_id,
            block_size=num_drafts + 1,
            target_layer_ids=[i - 1 for i in self.layer_ids(target)],
        )  # 0-based layer outputs

    def build(self, target: TargetInfo, data: TrainingData, options: dict[str, Any]) -> DFlashHead:
        mask = int(torch.bincount(data.token_ids, minlength=target.vocab_size).argmin())
        keep, target_to_draft = draft_vocabulary(data, target, options, self.method)
        config = self.config(target, mask, int(options.get("num_steps", 3)))
        if len(keep) < target.vocab_size:
            config["draft_vocab_size"] = len(keep)
        head = self.head_class(config, target)
        head.take_target_weights(target)
        source = target_layer(target)
        for layer in head.layers:
            init_layer(layer, source)
        h = target.hidden_size
        with torch.no_grad():
            head.norm.weight.copy_(source["final_norm"])
            head.fc.weight.mul_(0.1)
            head.fc.weight[:, -h:].add_(torch.eye(h))  # the highest target layer
            if hasattr(head, "d2t"):  # its own LM head over the draft vocabulary
                head.lm_head.weight.copy_(target.weight("lm_head").float()[keep])
                head.d2t.copy_(keep - torch.arange(len(keep)))
                head.draft_to_target, head.target_to_draft = keep, target_to_draft
            else:
                head.lm_head.requires_grad_(False)
        head.embed_tokens = MaskEmbedding(head.embed_tokens.weight, mask)
        return head

    def predictions(self, head: DFlashHead, batch: Batch, at: Anchors, num_steps: int) -> Iterator[Prediction]:
        rows, anchors, depth = at
        # `anchors` are the last context positions t; the block's anchor token is x_{t+1}.
        size, width = head.block_size, batch.token_ids.shape[1]
        kv = head.context_kv(head.context(batch.hidden), batch.positions)
        context = [(k[rows], v[rows]) for k, v in kv]
        block_ids = torch.full((len(rows), size), head.spec.mask_token_id)
        block_ids[:, 0] = batch.token_ids[rows, anchors + 1]
        positions = batch.positions[rows, anchors + 1][:, None] + torch.arange(size)
        key_positions = torch.cat([batch.positions[rows], positions], dim=1)
        key_valid = torch.cat(
            [torch.arange(width)[None] <= anchors[:, None], torch.ones(len(rows), size, dtype=torch.bool)], dim=1
        )
        out = head(block_ids, positions, context, key_positions, key_valid)
        alive, state = torch.arange(len(rows)), None
        for d, slot in enumerate(list(head.draft_slots)[:num_steps]):
            keep = depth[alive] > d  # drafts past the greedy chain are never checked again
            alive = alive[keep]
            state = state[keep] if state is not None else None
            ahead = rows[alive], anchors[alive] + 1 + d
            logits, state = self.chain_logits(
                head, head.logits(out[alive, slot]).float(), batch.token_ids[ahead], out[alive, slot], state
            )
            yield logits, draft_labels(head, batch.labels[ahead])

    def chain_logits(
        self,
        head: DFlashHead,
        logits: torch.Tensor,
        prev: torch.Tensor,
        hidden: torch.Tensor,
        state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A slot's logits given the token before its draft (DFlash: independent of it)."""
        return logits, None

    def save(self, head: DFlashHead, out: Path) -> None:
        learned = head.embed_tokens
        head.embed_tokens = learned.as_embedding()
        try:
            save_head(head, out)
        finally:
            head.embed_tokens = learned
        if "embed_tokens.weight" in head.omitted_on_save:
            torch.save(learned.mask_row.detach().clone(), out / "mask_embedding.pt")


class DSparkTrainer(DFlashTrainer):
    method = "dspark"
    head_class = DSparkHead

    def config(self, target: TargetInfo, mask_token_id: int, num_drafts: int) -> dict[str, Any]:
        return dspark_config(
            target,
            mask_token_id=mask_token_id,
            block_size=num_drafts,
            target_layer_ids=[i - 1 for i in self.layer_ids(target)],
            markov_rank=MARKOV_RANK,
            confidence_head=False,
        )

    def build(self, target: TargetInfo, data: TrainingData, options: dict[str, Any]) -> DSparkHead:
        head = super().build(target, data, options)
        with torch.no_grad():
            head.markov_head.markov_w2.weight.zero_()
        return head

    def chain_logits(self, head: DSparkHead, logits, prev, hidden, state):
        return head.step_logits(logits, prev, hidden, state)
