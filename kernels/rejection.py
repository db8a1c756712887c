"""OpenAI Triton kernels for speculative-decoding verification, each beside its torch reference.

Layout (vLLM V1): drafts are flattened over requests; request ``i`` owns the flattened slots
``[cu_num_draft_tokens[i-1], cu_num_draft_tokens[i])``. The accept functions fill row ``i`` of an
output ``[batch, max_spec_len + 1]`` int64 tensor that the caller pre-fills with
``PLACEHOLDER_TOKEN_ID``: the accepted drafts, then the target's token at the first rejection or the
bonus token when every draft is accepted. Each accept function writes only its own requests' rows
(greedy or random), so one output serves a mixed batch.

A kernel and its ``*_ref`` take the same arguments and give bit-identical results: the float
arithmetic they share (an fp32 subtraction and product, an fp64 product) is correctly rounded on
every device, and argmax ties go to the lowest token id in both.
"""

import torch
import triton
import triton.language as tl

PLACEHOLDER_TOKEN_ID = -1
_MAX_VOCAB_BLOCK = 1024  # vocab tile of the recovered-token kernel


@triton.jit
def _request_drafts(cu_num_draft_tokens_ptr, draft_token_ids_ptr, BLOCK: tl.constexpr):
    """This program's request: (req, number of drafts, their flattened slots, the mask of the
    slots in range, the draft tokens with -1 past the end)."""
    req = tl.program_id(0)
    end = tl.load(cu_num_draft_tokens_ptr + req)
    start = tl.load(cu_num_draft_tokens_ptr + req - 1, mask=req > 0, other=0)
    num_drafts = end - start
    offs = tl.arange(0, BLOCK)
    in_drafts = offs < num_drafts
    slots = start + offs
    draft = tl.load(draft_token_ids_ptr + slots, mask=in_drafts, other=-1)
    return req, num_drafts, slots, in_drafts, draft


@triton.jit
def _emit_tokens(
    out_ptr, out_stride, req, num_drafts, accepted, accept_tokens, reject_tokens, bonus, enabled, BLOCK: tl.constexpr
):
    """Write the accepted prefix, then the reject token at the first rejection (or the bonus)."""
    offs = tl.arange(0, BLOCK)
    in_drafts = offs < num_drafts
    # Branch-free walk: the first rejected position (num_drafts if none) ends the emitted run.
    first_reject = tl.min(tl.where(in_drafts & (accepted == 0), offs, num_drafts), axis=0)
    tokens = tl.where(offs < first_reject, accept_tokens, tl.where(in_drafts, reject_tokens, bonus))
    # Disabled rows stop before slot 0. (Folding the scalar flag into the index rather than and-ing
    # it into the mask also dodges a TRITON_INTERPRET bug: a broadcast scalar comparison turns into
    # int32 data, which the interpreter's store rejects as a mask.)
    last = tl.where(enabled, first_reject, -1)
    tl.store(out_ptr + req * out_stride + offs, tokens, mask=offs <= last)


def _emit_tokens_ref(
    out: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    rows: list[bool],
    accepted: list[bool],
    accept_tokens: list[int],
    reject_tokens: list[int],
    bonus_token_ids: list[int],
) -> None:
    """Torch twin of ``_emit_tokens``, written as the sequential walk of vLLM's pseudo-code."""
    start = 0
    for req, end in enumerate(cu_num_draft_tokens.tolist()):
        if rows[req]:
            emitted = []
            for pos in range(start, end):
                if not accepted[pos]:
                    emitted.append(reject_tokens[pos])
                    break
                emitted.append(accept_tokens[pos])
            else:
                emitted.append(bonus_token_ids[req])
            out[req, : len(emitted)] = torch.tensor(emitted, dtype=out.dtype)
        start = end


# --- (a) greedy accept ----------------------------------------------------------------------------


@triton.jit
def _greedy_accept_kernel(
    out_ptr,
    out_stride,
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    target_argmax_ptr,
    bonus_token_ids_ptr,
    is_greedy_ptr,
    BLOCK: tl.constexpr,
):
    req, num_drafts, slots, in_drafts, draft = _request_drafts(cu_num_draft_tokens_ptr, draft_token_ids_ptr, BLOCK)
    target = tl.load(target_argmax_ptr + slots, mask=in_drafts, other=-1)
    # An accepted draft equals the target token, so the target token is emitted at every position.
    _emit_tokens(
        out_ptr,
        out_stride,
        req,
        num_drafts,
        draft == target,
        target,
        target,
        tl.load(bonus_token_ids_ptr + req),
        tl.load(is_greedy_ptr + req) != 0,
        BLOCK,
    )


def greedy_accept(
    out: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_argmax: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor,
) -> None:
    """Fill the greedy requests' rows of ``out``: accept while draft == target argmax.

    ``target_argmax``: [num_drafts], the argmax of each draft's target row (never a -1 draft).
    """
    _greedy_accept_kernel[(len(cu_num_draft_tokens),)](
        out,
        out.stride(0),
        cu_num_draft_tokens,
        draft_token_ids,
        target_argmax,
        bonus_token_ids,
        is_greedy,
        BLOCK=triton.next_power_of_2(out.shape[1]),
    )


def greedy_accept_ref(
    out: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_argmax: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor,
) -> None:
    """Torch reference of :func:`greedy_accept`."""
    target = target_argmax.tolist()
    _emit_tokens_ref(
        out,
        cu_num_draft_tokens,
        is_greedy.tolist(),
        (draft_token_ids == target_argmax).tolist(),
        target,
        target,
        bonus_token_ids.tolist(),
    )


# --- (b) random accept ----------------------------------------------------------------------------


@triton.jit
def _random_accept_kernel(
    out_ptr,
    out_stride,
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    target_probs_ptr,
    draft_probs_ptr,
    uniform_probs_ptr,
    recovered_token_ids_ptr,
    bonus_token_ids_ptr,
    is_greedy_ptr,
    BLOCK: tl.constexpr,
):
    req, num_drafts, slots, in_drafts, draft = _request_drafts(cu_num_draft_tokens_ptr, draft_token_ids_ptr, BLOCK)
    p = tl.load(target_probs_ptr + slots, mask=in_drafts, other=0.0).to(tl.float64)
    q = tl.load(draft_probs_ptr + slots, mask=in_drafts, other=1.0).to(tl.float64)
    u = tl.load(uniform_probs_ptr + slots, mask=in_drafts, other=1.0)
    # p / q >= u, written as a product so it rounds the same on every device.
    accepted = (draft >= 0) & (q > 0) & (p >= u * q)
    recovered = tl.load(recovered_token_ids_ptr + slots, mask=in_drafts, other=-1)
    _emit_tokens(
        out_ptr,
        out_stride,
        req,
        num_drafts,
        accepted,
        draft,
        recovered,
        tl.load(bonus_token_ids_ptr + req),
        tl.load(is_greedy_ptr + req) == 0,
        BLOCK,
    )


def random_accept(
    out: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    uniform_probs: torch.Tensor,
    recovered_token_ids: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor,
) -> None:
    """Fill the random requests' rows of ``out``: accept draft x while p(x) / q(x) >= u.

    ``target_probs`` / ``draft_probs``: p and q already gathered at each draft token ([num_drafts]
    fp32; q = 1 for drafts without probabilities); q = 0 or a -1 draft rejects.
    ``uniform_probs``: one float64 U[0, 1) per draft; ``recovered_token_ids``: [num_drafts].
    """
    _random_accept_kernel[(len(cu_num_draft_tokens),)](
        out,
        out.stride(0),
        cu_num_draft_tokens,
        draft_token_ids,
        target_probs,
        draft_probs,
        uniform_probs,
        recovered_token_ids,
        bonus_token_ids,
        is_greedy,
        BLOCK=triton.next_power_of_2(out.shape[1]),
    )


def random_accept_ref(
    out: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    uniform_probs: torch.Tensor,
    recovered_token_ids: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor,
) -> None:
    """Torch reference of :func:`random_accept`."""
    q = draft_probs.double()
    accepted = (draft_token_ids >= 0) & (q > 0) & (target_probs.double() >= uniform_probs * q)
    _emit_tokens_ref(
        out,
        cu_num_draft_tokens,
        (~is_greedy).tolist(),
        accepted.tolist(),
        draft_token_ids.tolist(),
        recovered_token_ids.tolist(),
        bonus_token_ids.tolist(),
    )


# --- (c) recovered-token sampling -----------------------------------------------------------------


@triton.jit
def _recovered_tokens_kernel(
    out_ptr,
    draft_token_ids_ptr,
    draft_req_ids_ptr,
    target_probs_ptr,
    draft_probs_ptr,
    inv_exp_noise_ptr,
    is_greedy_ptr,
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    token = tl.program_id(0)
    req = tl.load(draft_req_ids_ptr + token)
    if tl.load(is_greedy_ptr + req) == 0:
        draft = tl.load(draft_token_ids_ptr + token)
        row = token.to(tl.int64) * vocab_size
        noise_row = req * vocab_size
        # Exponential race over the residual, one vocab tile at a time; only a strictly better tile
        # takes over, so ties keep the lowest token id, like torch.argmax.
        best_score = -1.0
        best_token = 0
        for v0 in range(0, vocab_size, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            in_vocab = cols < vocab_size
            p = tl.load(target_probs_ptr + row + cols, mask=in_vocab, other=0.0)
            if HAS_DRAFT_PROBS:
                q = tl.load(draft_probs_ptr + row + cols, mask=in_vocab, other=0.0)
                residual = tl.maximum(p - q, 0.0)
            else:
                residual = tl.where(cols == draft, 0.0, p)
            noise = tl.load(inv_exp_noise_ptr + noise_row + cols, mask=in_vocab, other=0.0)
            score = tl.where(in_vocab, residual * noise, -1.0)
            tile_best = tl.max(score, axis=0)
            better = tile_best > best_score
            best_token = tl.where(better, v0 + tl.argmax(score, axis=0), best_token)
            best_score = tl.where(better, tile_best, best_score)
        tl.store(out_ptr + token, best_token)


def sample_recovered_tokens(
    draft_token_ids: torch.Tensor,
    draft_req_ids: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    inv_exp_noise: torch.Tensor,
    is_greedy: torch.Tensor,
) -> torch.Tensor:
    """The token to emit if each draft is rejected: [num_drafts], -1 for greedy requests' drafts.

    Samples normalize(max(p - q, 0)) by the exponential race argmax(residual / E), given
    ``inv_exp_noise`` = 1/E, [batch, V]: one vector per request, shared by its positions. Without
    draft probabilities q is one-hot at the draft: the residual is p without the draft token.
    ``target_probs`` / ``draft_probs``: [num_drafts, V] fp32; ``draft_req_ids``: their requests.
    """
    num_tokens, vocab_size = target_probs.shape
    out = torch.full((num_tokens,), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=target_probs.device)
    if num_tokens:
        has_draft_probs = draft_probs is not None
        _recovered_tokens_kernel[(num_tokens,)](
            out,
            draft_token_ids,
            draft_req_ids,
            target_probs.contiguous(),
            draft_probs.contiguous() if has_draft_probs else target_probs,  # unread stand-in
            inv_exp_noise.contiguous(),
            is_greedy,
            vocab_size,
            HAS_DRAFT_PROBS=has_draft_probs,
            BLOCK_V=min(triton.next_power_of_2(vocab_size), _MAX_VOCAB_BLOCK),
        )
    return out


def sample_recovered_tokens_ref(
    draft_token_ids: torch.Tensor,
    draft_req_ids: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    inv_exp_noise: torch.Tensor,
    is_greedy: torch.Tensor,
) -> torch.Tensor:
    """Torch reference of :func:`sample_recovered_tokens`."""
    if draft_probs is None:
        vocab_ids = torch.arange(target_probs.shape[1], device=target_probs.device)
        is_draft = vocab_ids == draft_token_ids.unsqueeze(1)  # a -1 draft removes nothing
        residual = target_probs.masked_fill(is_draft, 0.0)
    else:
        residual = (target_probs - draft_probs).clamp_min(0.0)
    recovered = (residual * inv_exp_noise[draft_req_ids]).argmax(dim=1)
    return recovered.masked_fill(is_greedy[draft_req_ids], PLACEHOLDER_TOKEN_ID)
