"""Training a DeepSeek-V3-style MTP layer for a target that has none (`tritonspec train mtp`).

An MTP layer is structurally an EAGLE head (backends/methods/mtp.py), so it is trained exactly like
one (backends/training/eagle.py): the training-time test unrolls `--ttt-steps` draft steps,
each fed the layer's own output of the step before, with the attention pattern the proposer
uses; serving reuses layer 0 for every draft step, and so does the unroll. Only the token
loss (DeepSeek-V3 trains its MTP modules with cross entropy alone).

Start: the decoder block is the target's last layer, `shared_head.norm` its final norm,
`eh_proj` reads the normed state (the identity on it) with the embedding faintly mixed in,
so the layer starts near the target's own next-token prediction; the embedding and the LM
head (`shared_head.head`) are the target's, frozen, and not written out (the loader borrows
them). Written with `save_mtp` in the DeepSeek layout (`model.layers.{L}.*`, model_type
`deepseek_mtp`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from backends.methods.head_checkpoint import TargetInfo
from backends.methods.mtp import MTPHead, save_mtp
from backends.training.data import TrainingData
from backends.training.eagle import CE_POSITIONS, EagleTrainerBase, head_config, init_layer, target_layer
from backends.training.steps import served_copy


class MTPTrainer(EagleTrainerBase):
    method = "mtp"
    writes_token_map = True
    ce_positions = CE_POSITIONS // 4  # its LM head is the target's, over the whole vocabulary

    def layer_ids(self, target: TargetInfo) -> tuple[int, ...]:
        return MTPHead.hidden_layer_ids

    def build(self, target: TargetInfo, data: TrainingData, options: dict[str, Any]) -> MTPHead:
        head = MTPHead(head_config(target), target, "deepseek", num_layers=1)
        layer = head.layers[0]
        head.embed_tokens.requires_grad_(False)
        layer.shared_head.head.requires_grad_(False)
        source = target_layer(target)
        init_layer(layer, source)
        h = target.hidden_size
        with torch.no_grad():
            layer.shared_head.norm.weight.copy_(source["final_norm"])
            layer.eh_proj.weight.mul_(0.1)
            layer.eh_proj.weight[:, h:].add_(torch.eye(h))  # [embedding | state]: pass the state on
        return head

    def save(self, head: MTPHead, out: Path) -> None:
        save_mtp(served_copy(head), out)
