"""Batch-invariant kernels for the lean runtime on a GPU (OpenAI Triton), each beside its torch
reference: linear layers, RMSNorm and attention over the paged KV pool.

Why: cuBLAS picks its tiles and split-K by the shape of the call, and torch's row reductions
spread a row over more threads when there are few rows, so a token's logits change in their last
bits with how many tokens share its forward. In bfloat16 that flips near-tie argmaxes and
speculative output departs from plain output. Every choice here that touches a row's arithmetic
is fixed, whatever the call's shape:

- ``linear``: one tile shape (``TILE``) for every call, the K loop in one order, no split-K; a
  row's output is the same bits alone or among any number of rows.
- ``rms_norm``: one program per row, the whole row in one block.
- ``attend``: one program per (query token, kv head) walking that token's own key list in
  blocks of ``key_block`` keys (fixed per model) with an online softmax, so the order of its
  sums depends only on its own keys.

The float arithmetic follows the CPU runtime's (float32 sums, one rounding to the output dtype), so
both devices agree to float32 rounding; bit equality holds within one device, which is what
batch invariance asks.

Triton's interpreter (tests, without CUDA) gets two bfloat16 things wrong, which the kernels
mend there only (``INTERPRETED``): dot products of bf16 tiles (the tiles are widened to float32
first, exact for bf16 values, and the dot runs in IEEE float32), and narrowing float32 to bf16,
which it truncates (``_narrow`` rounds to nearest even by hand, as a GPU does). float32 tiles
always take the IEEE dot (a GPU would otherwise round their products to TF32).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TILE = (64, 64, 64)  # rows x outputs x K of every linear's tile: never chosen by shape
# Keys per block of the attention walk: fixed per model (never per call), sized so a block's
# [group, keys, head_dim] tile stays within registers.
MAX_KEY_BLOCK, KEY_TILE = 32, 8192
_LINEAR_WARPS, _LINEAR_STAGES = 4, 3


@triton.jit
def _narrow(x, dtype: tl.constexpr, FIX: tl.constexpr):
    """``x.to(dtype)``, rounding to nearest even in the interpreter too."""
    if FIX and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    r_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_x,
    stride_r,
    stride_y,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    WIDE: tl.constexpr,
    FIX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    in_rows, in_cols = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = (k0 + ks) < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + (k0 + ks)[None, :], mask=in_rows[:, None] & in_k[None, :], other=0.0
        )
        w = tl.load(w_ptr + cols[None, :] * K + (k0 + ks)[:, None], mask=in_cols[None, :] & in_k[:, None], other=0.0)
        if FIX:  # the interpreter: numpy's BLAS (tl.dot there) need not give a row the same bits
            # alone as among others (OpenBLAS on AVX2 does not); products summed over K do
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        elif WIDE:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)[None, :]
    out = in_rows[:, None] & in_cols[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=out, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], _narrow(acc, y_ptr.dtype.element_ty, FIX), mask=out)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T (+ bias) (+ residual)`` with one rounding, row invariant.
    ``x`` ``[M, K]`` (rows may be strided), ``weight`` ``[N, K]`` contiguous."""
    (m, k), n = x.shape, weight.shape[0]
    if x.stride(1) != 1 or not weight.is_contiguous() or weight.shape[1] != k:
        raise ValueError(f"linear: x {tuple(x.shape)} (unit column stride) against weight {tuple(weight.shape)}")
    y = x.new_empty(m, n)
    if residual is not None and (residual.shape != y.shape or residual.stride(1) != 1):
        raise ValueError(f"linear: residual {tuple(residual.shape)} for an output of {(m, n)}")
    bm, bn, bk = TILE
    _linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x,
        weight,
        bias if bias is not None else weight,
        residual if residual is not None else y,
        y,
        m,
        n,
        k,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        y.stride(0),
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        WIDE=INTERPRETED or x.dtype == torch.float32,  # float32: IEEE products, not TF32
        FIX=INTERPRETED,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=_LINEAR_WARPS,
        num_stages=_LINEAR_STAGES,
    )
    return y


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    y = x.float() @ weight.float().T
    if bias is not None:
        y += bias.float()
    if residual is not None:
        y += residual.float()
    return y.to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, W, stride_x, stride_y, eps, FIX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / H
    # transformers' LlamaRMSNorm: normalise in float32, round to the input dtype, then scale
    normed = _narrow(x * (1.0 / tl.sqrt(variance + eps)), y_ptr.dtype.element_ty, FIX).to(tl.float32)
    w = tl.load(w_ptr + (row % W) * H + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, _narrow(w * normed, y_ptr.dtype.element_ty, FIX), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` ``[R, H]``; ``weight`` ``[H]``, or ``[W, H]`` where row r takes
    weight row ``r % W`` (Qwen3's per-head q/k norms over ``[tokens * heads, head_dim]``)."""
    rows, h = x.shape
    weight = weight.reshape(-1, h).contiguous()
    if x.stride(1) != 1:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} needs a unit column stride")
    y = x.new_empty(rows, h)
    _rms_norm_kernel[(rows,)](
        x,
        weight,
        y,
        h,
        weight.shape[0],
        x.stride(0),
        y.stride(0),
        eps,
        FIX=INTERPRETED,
        BLOCK=triton.next_power_of_2(h),
    )
    return y


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows, h = x.shape
    weight = weight.reshape(-1, h)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight.repeat(rows // weight.shape[0], 1) * normed


@triton.jit
def _attend_kernel(
    q_ptr,
    kv_ptr,
    slots_ptr,
    start_ptr,
    length_ptr,
    out_ptr,
    stride_q,
    stride_slot,
    stride_kv,
    scale,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    FIX: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # one program per (token, kv head): the GROUP query heads that share it read each key once
    token, kv_head = tl.program_id(0), tl.program_id(1)
    members = tl.arange(0, BLOCK_G)
    heads = members * KV_HEADS + kv_head  # group-major: head j * kv_heads + kv reads kv head kv
    dims = tl.arange(0, BLOCK_D)
    in_d = dims < D
    in_q = (members < GROUP)[:, None] & in_d[None, :]
    q = tl.load(q_ptr + token * stride_q + heads[:, None] * D + dims[None, :], mask=in_q, other=0.0)
    q = q.to(tl.float32) * scale
    start = tl.load(start_ptr + token)
    length = tl.load(length_ptr + token)
    top = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for n0 in range(0, length, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        in_keys = keys < length
        slot = tl.load(slots_ptr + start + keys, mask=in_keys, other=0)
        base = kv_ptr + slot[:, None] * stride_slot + kv_head * D + dims[None, :]
        in_kv = in_keys[:, None] & in_d[None, :]
        k = tl.load(base, mask=in_kv, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [group, keys]
        scores = tl.where(in_keys[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, axis=1))
        fade = tl.exp(top - new_top)
        p = tl.exp(scores - new_top[:, None])
        v = tl.load(base + stride_kv, mask=in_kv, other=0.0).to(tl.float32)
        acc = acc * fade[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        total = total * fade + tl.sum(p, axis=1)
        top = new_top
    out = _narrow(acc / total[:, None], out_ptr.dtype.element_ty, FIX)
    tl.store(out_ptr + token * (KV_HEADS * GROUP * D) + heads[:, None] * D + dims[None, :], out, mask=in_q)


def key_block(group: int, head_dim: int) -> int:
    """Keys per block of the attention walk for a model's query group and head size."""
    tile = triton.next_power_of_2(group) * triton.next_power_of_2(head_dim)
    return max(8, min(MAX_KEY_BLOCK, KEY_TILE // tile))


def attend(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """Attention of ``q`` ``[tokens, >= heads * head_dim]`` (rows may be strided, heads
    group-major) over ``kv_layer`` ``[slots, 2, kv_heads, head_dim]``: token t reads the pool slots
    ``slots[start[t] : start[t] + length[t]]`` (length >= 1) -> ``[tokens, heads * head_dim]``."""
    tokens = start.shape[0]
    _, two, kv_heads, d = kv_layer.shape
    if two != 2 or not kv_layer.is_contiguous() or q.stride(1) != 1 or num_heads % kv_heads:
        raise ValueError(f"attend: q {tuple(q.shape)}, {num_heads} heads over a pool layer {tuple(kv_layer.shape)}")
    out = q.new_empty(tokens, num_heads * d)
    group = num_heads // kv_heads
    _attend_kernel[(tokens, kv_heads)](
        q,
        kv_layer,
        slots,
        start,
        length,
        out,
        q.stride(0),
        kv_layer.stride(0),
        kv_layer.stride(1),
        d**-0.5,
        KV_HEADS=kv_heads,
        GROUP=group,
        D=d,
        FIX=INTERPRETED,
        BLOCK_G=triton.next_power_of_2(group),
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=key_block(group, d),
    )
    return out


def attend_ref(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    _, _, kv_heads, d = kv_layer.shape
    out = []
    for t, (a, n) in enumerate(zip(start.tolist(), length.tolist())):
        kv = kv_layer[slots[a : a + n]].float()  # [n, 2, kv_heads, d]
        heads = q[t, : num_heads * d].float().view(num_heads, d)
        kv_of = torch.arange(num_heads) % kv_heads
        scores = torch.einsum("hd,nhd->hn", heads, kv[:, 0, kv_of]) * d**-0.5
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), kv[:, 1, kv_of]).reshape(-1))
    return torch.stack(out).to(q.dtype)
