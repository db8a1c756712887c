"""Token bitmasks (llguidance's and xgrammar's layout: int32 words, bit b of word w allows token
32w + b) applied to the target's logits. Kept free of the grammar library: the verifier only
ever sees masks."""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask."""
    return (vocab_size + 31) // 32


def allowed_tokens(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask -> [rows, vocab_size] bool (columns past the mask: not allowed)."""
    bits = (mask.unsqueeze(-1) >> _BITS).bitwise_and_(1).view(mask.shape[0], -1)  # [rows, 32 * words]
    allowed = torch.zeros(mask.shape[0], vocab_size, dtype=torch.bool)
    n = min(vocab_size, bits.shape[1])
    allowed[:, :n] = bits[:, :n].bool()
    return allowed


def apply_token_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[rows, V] logits -> float32 logits where tokens the [rows, words] mask disallows are -inf:
    greedy takes the masked argmax and sampling draws from the masked distribution."""
    allowed = allowed_tokens(mask, logits.shape[-1]).to(logits.device)
    return logits.float().masked_fill(~allowed, float("-inf"))
