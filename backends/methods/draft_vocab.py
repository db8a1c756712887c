"""A reduced draft vocabulary for the heads that draft over the target's whole vocabulary
(`speculative_token_map`; FR-Spec, Zhao et al. 2025, https://arxiv.org/abs/2502.14856, and
SGLang's `--speculative-token-map`).

An EAGLE-1, MTP or MLP-speculator head, and a Medusa head in FasterDecoding's layout, end in
LM heads over the target's vocabulary: for SmolLM2 a 49152 x 576 matrix, 56 MB in bf16,
streamed once per draft position, which is most of what such a head's drafting costs. With a
token map an LM head keeps only the rows of the map's tokens (the ones the target writes most
often), so a draft position reads a sixth of that for an 8192-token map. Drafts come back to
target ids through the head's `draft_to_target`, as EAGLE-3's draft vocabulary does.
Verification is unchanged, so decoding stays lossless: a greedy draft is the head's best token
within the map (the same token whenever the full head's best is in it), and a sampled draft
comes with its probabilities over the target's vocabulary, 0 outside the map, which the
rejection sampler takes as q.

The map is a file of target token ids: a 1-D integer tensor saved with `torch.save` (`.pt`, the
format of FR-Spec's published maps and of SGLang's flag) or a JSON list (`.json`).
`tritonspec train eagle|mtp|mlp_speculator` writes one beside the head (`token_map.json`, the
most frequent tokens of its training answers).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


class TokenMapError(ValueError):
    """A speculative_token_map file that cannot be read as a set of the target's token ids."""


def read_token_map(path: Path | str, vocab_size: int) -> torch.Tensor:
    """The map's token ids [V_d] (int64, sorted ascending: argmax ties then break as over the
    whole vocabulary), checked against the target's `vocab_size`."""
    path = Path(path)
    try:
        if path.suffix == ".json":
            ids = torch.tensor(json.loads(path.read_text(encoding="utf-8")))
        else:
            ids = torch.load(path, map_location="cpu", weights_only=True)
            ids = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids)
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        raise TokenMapError(
            f"speculative_token_map {path}: not readable as token ids (a JSON list, or a tensor saved "
            f"with torch.save): {e}"
        ) from None
    if ids.dim() != 1 or not ids.numel() or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TokenMapError(
            f"speculative_token_map {path}: expected a non-empty 1-D list of integer token ids, got "
            f"{ids.dtype} of shape {tuple(ids.shape)}"
        )
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise TokenMapError(f"speculative_token_map {path}: token id {bad} is outside the target's [0, {vocab_size})")
    unique = ids.unique()  # sorted
    if len(unique) != len(ids):
        raise TokenMapError(f"speculative_token_map {path}: {len(ids) - len(unique)} token ids appear twice")
    return unique


def restrict_draft_vocab(head: nn.Module, token_ids: torch.Tensor) -> int:
    """Cut every LM head of `head` over the target's vocabulary (a linear layer of
    `head.target_vocab_size` outputs) to the rows of `token_ids` [V_d], and map drafts back
    through them (`head.draft_to_target`). A layer tied across stages (the MLP speculator's
    `tie_weights`) stays one layer. Returns how many LM heads were cut."""
    cut: dict[int, nn.Linear] = {}  # id of a full LM head -> its cut copy
    for parent in list(head.modules()):
        # _modules, not named_children(): a tied layer stands at several names and each is replaced.
        for name, child in list(parent._modules.items()):
            if isinstance(child, nn.Linear) and child.out_features == head.target_vocab_size:
                if id(child) not in cut:
                    cut[id(child)] = _rows(child, token_ids)
                setattr(parent, name, cut[id(child)])
    if not cut:
        raise TokenMapError(
            f"speculative_token_map: this {type(head).__name__} has no LM head over the target's whole "
            "vocabulary to cut (its checkpoint drafts over a draft vocabulary of its own)"
        )
    head.draft_to_target = token_ids.to(next(head.parameters()).device)
    return len(cut)


def _rows(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """A linear layer of `linear`'s rows `rows` alone (its own copy: a tied or borrowed weight
    stays whole for whoever else holds it)."""
    weight, rows = linear.weight.detach(), rows.to(linear.weight.device)
    out = nn.Linear(
        linear.in_features, len(rows), bias=linear.bias is not None, device=weight.device, dtype=weight.dtype
    )
    with torch.no_grad():
        out.weight.copy_(weight[rows])
        if linear.bias is not None:
            out.bias.copy_(linear.bias.detach()[rows])
    return out
