"""Batched n-gram match (vLLM's `ngram_gpu`): an OpenAI Triton kernel beside its torch reference.

Both take ``tokens [batch, T]`` (rows padded past their length with anything), ``seq_lens
[batch]`` and return ``drafts [batch, k]`` int32, padded with -1 after the tokens that follow the
match, and ``num_valid_draft_tokens [batch]`` int32. The match is the `ngram` rule: the longest
n in [min_n, max_n] whose last n tokens occurred earlier (window ending at index <= len-2), at
its earliest occurrence. Unlike `ngram` there is no max_model_len clamp.

Windows are identified by their end e: the match length at e is how many tokens, counted
backwards, agree with the end of the sequence. The best window is the longest, then the
earliest, so one pass computes per-end match lengths and reduces with a single key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PAD_TOKEN_ID = -1
_BLOCK = 1024  # window ends per kernel iteration


def ngram_match_ref(
    tokens: torch.Tensor, seq_lens: torch.Tensor, min_n: int, max_n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version: [batch, T] work per n, vectorised over the whole batch."""
    if tokens.shape[1] == 0:  # all rows empty: one pad column keeps the indexing below valid
        tokens = tokens.new_zeros((tokens.shape[0], 1))
    width = tokens.shape[1]
    ends = torch.arange(width, device=tokens.device)
    last = seq_lens.to(torch.int64)[:, None] - 1
    running = ends[None, :] <= last - 1  # a window must end before the last token
    match_len = torch.zeros(tokens.shape, dtype=torch.int64, device=tokens.device)
    for j in range(max_n):
        running = running & (ends >= j)[None, :]
        back = tokens[:, (ends - j).clamp_min(0)]
        target = tokens.gather(1, (last - j).clamp_min(0))
        running = running & (back == target)
        match_len += running
    best_len = match_len.max(dim=1, keepdim=True).values
    first_end = torch.where(match_len == best_len, ends, width).min(dim=1, keepdim=True).values
    idx = first_end + 1 + torch.arange(k, device=tokens.device)
    valid = (best_len >= min_n) & (idx <= last)
    drafts = torch.where(valid, tokens.gather(1, idx.clamp(max=width - 1)), PAD_TOKEN_ID)
    return drafts.to(torch.int32), valid.sum(dim=1).to(torch.int32)


@triton.jit
def _ngram_match_kernel(
    tokens_ptr,
    tokens_stride,
    seq_lens_ptr,
    drafts_ptr,
    drafts_stride,
    num_valid_ptr,
    min_n,
    width,
    MAX_N: tl.constexpr,
    K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    PAD: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = tokens_ptr + row.to(tl.int64) * tokens_stride
    n = tl.load(seq_lens_ptr + row)
    # key = match_len * (width + 1) + (width - end): the max is the longest, then earliest, window.
    span = width + 1
    best = tl.full([], -1, tl.int64)
    for start in range(0, n - 1, BLOCK):
        ends = start + tl.arange(0, BLOCK)
        running = ends <= n - 2
        match_len = tl.zeros([BLOCK], dtype=tl.int64)
        for j in tl.static_range(MAX_N):
            running = running & (ends >= j)
            back = tl.load(row_ptr + ends - j, mask=running, other=0)
            target = tl.load(row_ptr + tl.maximum(n - 1 - j, 0))
            running = running & (back == target)
            match_len += running.to(tl.int64)
        # Ends out of range have match_len 0, so their keys never stand for a match.
        key = match_len * span + (width - ends)
        best = tl.maximum(best, tl.max(key, axis=0))
    best_len = tl.where(best >= 0, best // span, 0)
    first_end = width - best % span
    # No match: the copy limit drops to 0 (a scalar flag folded into the index, not the mask,
    # which the interpreter's load would reject, see kernels/rejection.py).
    limit = tl.where(best_len >= min_n, n, 0)
    offs = tl.arange(0, K_BLOCK)
    idx = first_end + 1 + offs
    valid = (offs < K) & (idx < limit)
    drafts = tl.load(row_ptr + idx, mask=valid, other=PAD)
    tl.store(drafts_ptr + row * drafts_stride + offs, drafts.to(tl.int32), mask=offs < K)
    tl.store(num_valid_ptr + row, tl.sum(valid.to(tl.int32), axis=0))


def ngram_match(
    tokens: torch.Tensor, seq_lens: torch.Tensor, min_n: int, max_n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel version: one program per sequence; same arguments and results as the reference."""
    batch, width = tokens.shape
    drafts = torch.empty((batch, k), dtype=torch.int32, device=tokens.device)
    num_valid = torch.empty(batch, dtype=torch.int32, device=tokens.device)
    if batch and k:
        tokens = tokens.contiguous()
        _ngram_match_kernel[(batch,)](
            tokens,
            tokens.stride(0),
            seq_lens.contiguous(),
            drafts,
            drafts.stride(0),
            num_valid,
            min_n,
            width,
            MAX_N=max_n,
            K=k,
            K_BLOCK=triton.next_power_of_2(k),
            BLOCK=_BLOCK,
            PAD=PAD_TOKEN_ID,  # compiled kernels read no plain globals (the interpreter does)
        )
    elif batch:
        num_valid.zero_()
    return drafts, num_valid
