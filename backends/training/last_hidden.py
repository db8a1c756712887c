"""Training Medusa-1 heads and IBM MLP speculators (`tritonspec train medusa|mlp_speculator`).

Both draft from the target's final normed state f_t alone (layer id -1), and training runs
them through the proposer's own protocol (backends/methods/last_hidden.py: `begin(f_t)`, then
`step(d, state, token)` per draft), with the true tokens fed to each step (teacher forcing;
Medusa's heads ignore them). Draft d is checked against the target's greedy token
labels[t+1+d] where the answer follows the target's greedy chain (backends/training/steps.py).
`--ttt-steps` sets the number of heads / stages.

Medusa-1 (FasterDecoding): each head is one ResBlock z + SiLU(W z + b) with W and b zero, so
it starts as the identity, and its own LM head starts as a copy of the target's rows for the
draft vocabulary (`--draft-vocab-size` most frequent target tokens, vLLM's
`truncated_vocab_size` + `token_map`: a full-vocabulary head per draft step costs too much CPU
to train); everything in the heads is trained (Medusa-1 freezes the target, not the heads).
Loss: cross entropy per head, head d weighted 0.8^d. Written in the vLLM-converted layout
(`save_medusa`).

MLP speculator: `n_predict` stages with `tie_weights` and `scale_input` (as IBM's recent
accelerators have them): one embedding, LM head and norm for all stages, `proj.0` from the
target's state and `proj.1` shared by the later stages; state and embedding are weighted as
the format fixes (backends/methods/mlp_speculator.py). Start: the embedding is the target's, rescaled
to the spread fms-extras initialises it with (std 1/sqrt(inner_dim)), so the state carries
most of the first stage's input; the LM head is the target's, the norm's scale the target's
final norm, the projections the identity. The format has no draft vocabulary, so each batch
trains on fewer anchors. Written with `save_mlp_speculator`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from backends.methods.head_checkpoint import TargetInfo
from backends.methods.medusa import MedusaHead, save_medusa
from backends.methods.mlp_speculator import MLPSpeculatorHead, save_mlp_speculator
from backends.training.data import TrainingData
from backends.training.eagle import CE_POSITIONS, target_layer
from backends.training.steps import Anchors, Prediction, StepTrainer, draft_labels, served_copy
from backends.training.trainer import Batch, draft_vocabulary


class _LastHiddenTrainer(StepTrainer):
    def layer_ids(self, target: TargetInfo) -> tuple[int, ...]:
        return (-1,)

    def predictions(self, head: nn.Module, batch: Batch, at: Anchors, num_steps: int) -> Iterator[Prediction]:
        rows, anchors, depth = at
        last = batch.token_ids.shape[1] - 1
        state = head.begin(batch.hidden[rows, anchors, 0])
        for d in range(min(num_steps, head.num_steps)):
            ahead = (anchors + 1 + d).clamp(max=last)  # past the window only where depth <= d
            logits, state = head.step(d, state, batch.token_ids[rows, ahead])  # x_{t+1+d}
            ok = depth > d
            yield logits[ok], draft_labels(head, batch.labels[rows, ahead][ok])


class MedusaTrainer(_LastHiddenTrainer):
    method = "medusa"

    def build(self, target: TargetInfo, data: TrainingData, options: dict[str, Any]) -> MedusaHead:
        keep, target_to_draft = draft_vocabulary(data, target, options, self.method)
        config = {"num_heads": int(options.get("num_steps", 3)), "num_hidden_layers": 1, "medusa_fc_bias": True}
        if len(keep) < target.vocab_size:
            config["truncated_vocab_size"] = len(keep)
        head = MedusaHead(config, target)
        lm_head = target.weight("lm_head").float()[keep]
        with torch.no_grad():
            for blocks in head.blocks:
                for linear in blocks.layers:
                    linear.weight.zero_()
                    linear.bias.zero_()
            for linear in head.lm_heads:
                linear.weight.copy_(lm_head)
            if head.token_map is not None:
                head.token_map.copy_(keep)
                head.target_to_draft = target_to_draft
        return head

    def save(self, head: MedusaHead, out: Path) -> None:
        save_medusa(served_copy(head), out)


class MLPSpeculatorTrainer(_LastHiddenTrainer):
    method = "mlp_speculator"
    writes_token_map = True
    anchors_per_batch = CE_POSITIONS // 4  # its one LM head, trained, spans the target's whole vocabulary

    def build(self, target: TargetInfo, data: TrainingData, options: dict[str, Any]) -> MLPSpeculatorHead:
        n = int(options.get("num_steps", 3))
        config = {
            "emb_dim": target.hidden_size,
            "inner_dim": 0,
            "vocab_size": target.vocab_size,
            "n_predict": n,
            "tie_weights": n > 1,
            "scale_input": True,
            "top_k_tokens_per_head": [1] * n,
            "n_candidates": 1,
        }
        head = MLPSpeculatorHead(config, target)
        embed = target.weight("embed").float()
        with torch.no_grad():
            head.emb[0].weight.copy_(embed * (1 / math.sqrt(target.hidden_size)) / embed.pow(2).mean().sqrt())
            head.head[0].weight.copy_(target.weight("lm_head").float())
            head.ln[0].weight.copy_(target_layer(target)["final_norm"])
            head.ln[0].bias.zero_()
            for proj in head.proj:
                proj.weight.copy_(torch.eye(target.hidden_size))
        return head

    def save(self, head: MLPSpeculatorHead, out: Path) -> None:
        save_mlp_speculator(served_copy(head), out)
