"""What the proposers that run a trained head on the target's hidden states share (EAGLE,
EAGLE-3, MTP, DFlash, DSpark, Medusa, MLP speculator): the checks of the speculative config,
the sampling setup and per-sequence state. A method adds its head's loader (`load_head`)
and its `propose`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from backends.config import DrafterConfig
from backends.methods.draft_vocab import read_token_map, restrict_draft_vocab
from backends.methods.drafts import check_quantization_device, check_sample_method, sample_drafts
from backends.methods.head_checkpoint import Checkpoint, TargetInfo
from backends.runtime.lean_lm import kernel_linears
from backends.runtime.model_store import resolve_model
from backends.serving.proposer import ProposerContext, SequenceProposer, check_one_device
from backends.serving.rejection import new_generator

log = logging.getLogger("tritonspec.head_proposer")


class HeadProposer(SequenceProposer):
    method = ""
    needs_model = True  # False: the head may live in the target's own checkpoint (MTP)
    beside_verifier = True  # small, our own: drafts on the in-process verifier's thread

    def __init__(
        self, head: nn.Module, max_model_len: int, sample_method: str = "greedy", seed: int | None = None
    ) -> None:
        check_sample_method(sample_method)
        super().__init__()
        self.head = head
        self.hidden_layer_ids = getattr(head, "hidden_layer_ids", self.hidden_layer_ids)
        self.max_model_len = max_model_len
        self.sample_method = sample_method
        self.device = next(head.parameters()).device
        self.dtype = next(head.parameters()).dtype
        self.generator = new_generator(self.device, seed)
        if self.dtype == torch.bfloat16 and (turned := kernel_linears(head)):
            log.info("%s head: %d linear layers on the packed bf16 kernel", self.method, turned)

    @classmethod
    def from_config(cls, config: DrafterConfig, ctx: ProposerContext) -> HeadProposer:
        if cls.needs_model and not config.model:
            raise ValueError(f"{cls.method} needs `model`: the {cls.method} checkpoint directory")
        if ctx.target_model is None:
            raise ValueError(f"{cls.method} needs the target model (its hidden size, vocabulary, embedding)")
        check_one_device(config, f"the {cls.method} head")
        # Only 'int8' is acted on: mtp and dspark inherit the target's own quant_method (fp8,
        # awq, ...), which says how the target was stored, not what to do with the head.
        int8 = config.quantization == "int8"
        if int8:
            check_quantization_device("int8", ctx.device)
        target = TargetInfo.load(ctx.target_model)
        head = cls.load_head(config, target, "bfloat16" if int8 else ctx.dtype)
        if config.speculative_token_map:  # before the linear layers go onto the kernels
            token_ids = read_token_map(config.speculative_token_map, target.vocab_size)
            cut = restrict_draft_vocab(head, token_ids)
            log.info(
                "%s head: %d LM head(s) cut to the %d of %d tokens of %s",
                cls.method,
                cut,
                len(token_ids),
                target.vocab_size,
                config.speculative_token_map,
            )
        proposer = cls(head.to(ctx.device), ctx.max_model_len, config.draft_sample_method, ctx.seed)
        if int8:
            turned = kernel_linears(head, int8=True)
            log.info("%s head: %d linear layers quantized to int8", cls.method, turned)
        return proposer

    def sample(
        self, logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator | None]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts from the head's draft-vocabulary `logits` [B, ..., V_d], row i at temperatures[i]
        with generators[i]: target ids [B, ...] that stay on the device and, when sampled, the
        probabilities they were drawn from over the target vocabulary [B, ..., V]."""
        return sample_drafts(
            logits, self.sample_method, temperatures, generators, self.head.draft_to_target, self.head.target_vocab_size
        )

    @classmethod
    def load_head(cls, config: Any, target: TargetInfo, dtype: str) -> nn.Module:
        """The head `config` names, checked against the target, in `dtype`."""
        raise NotImplementedError

    @staticmethod
    def checkpoint(config: Any, default: str | None = None) -> Path | Checkpoint:
        """What a loader loads `config`'s head from (its model, else `default`): with the
        config.json the speculative config resolution read, when it read one, so loading
        reads that file no second time."""
        path = resolve_model(config.model or default)
        return path if config.checkpoint_config is None else Checkpoint(path, config.checkpoint_config)
