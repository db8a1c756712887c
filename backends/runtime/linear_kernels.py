"""The lean runtime's linear layers in C (``cpu_kernels.c``): bf16 on packed weights (where the
CPU has AVX-512 BF16 or AVX2 + FMA), int8 and int4 for quantized drafters (AVX-512 VNNI or
AVX2 + FMA, the same bits on both), and DSpark's greedy Markov chain on the packed kernel. As
in ``cpu_kernels.py``, every extent is checked before any C runs.

Why linear layers: a decode step streams every weight from memory once, and oneDNN's kernels
got ~19 GB/s of this machine's ~33 on SmolLM2's small matrices. The packed kernel (see
``cpu_kernels.c``) took 0.63-0.77x oneDNN's time for 1 to 17 rows, and it is batch invariant by
construction, so the K-split probing of oneDNN's weights is not needed where it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cpu_kernels import KernelArgumentError, kernels_built
from .kernel_library import KernelUnavailable
from .kernel_library import library as _library

GROUP = 64  # cpu_kernels.c: outputs per packed group of a linear layer's weight


def _available(kernel: str) -> bool:
    return kernels_built() and bool(getattr(_library(), f"{kernel}_available")())


def packed_linear_available() -> bool:
    """Does this CPU run the packed bf16 linear kernel (AVX-512 BF16, or AVX2 + FMA)?"""
    return _available("packed_linear")


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 ``[n, k]`` weight (k even) in the packed kernel's layout."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or k % 2:
        raise ValueError(f"the packed linear kernel takes bf16 weights with an even K, got {weight.dtype} {n}x{k}")
    weight = weight.contiguous()
    out = weight.new_empty(-(-n // GROUP) * GROUP * k)
    _library().pack_linear(weight.data_ptr(), n, k // 2, out.data_ptr())  # words of 2 bf16
    return out


def packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias) (+ residual)`` for ``x`` ``[m, k]`` bf16 (rows may be strided) and W
    as ``pack_linear`` left it -> ``[m, n]``."""
    _check_weight("packed linear", x, packed, 1, n, bias)
    out, rc = _linear(_library().packed_linear, "packed linear", x, (packed.data_ptr(),), n, bias, residual)
    if rc != 0:
        reasons = {-2: "it is not built for this CPU", -3: "out of memory for its widened rows"}
        raise KernelUnavailable(f"packed linear kernel: {reasons.get(rc, f'odd K {x.shape[1]}')}")
    return out


def _check_weight(
    name: str, x: torch.Tensor, packed: torch.Tensor, per_k: float, n: int, bias: torch.Tensor | None
) -> None:
    """``packed`` (``per_k`` values per output and position of K) was packed for ``x``'s K and
    ``n`` outputs, and ``bias`` has one value per output."""
    k, padded = x.shape[-1], -(-n // GROUP) * GROUP
    if packed.numel() != padded * k * per_k:
        raise KernelArgumentError(f"{name}: a packed weight of {packed.numel()} values is not {n} outputs x K {k}")
    if bias is not None and (bias.numel() < n or not bias.is_contiguous()):
        raise KernelArgumentError(f"{name}: bias of {bias.numel()} values for {n} outputs")


def _linear(
    kernel: Callable[..., int],
    name: str,
    x: torch.Tensor,
    weight: tuple[int, ...],
    n: int,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, int]:
    """Check ``x`` and ``residual`` and call the C linear layer ``kernel`` (``name`` in errors)
    with its weight's pointers: its output and return code."""
    m, k = x.shape
    if x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError(f"the {name} kernel takes bf16 rows with unit stride")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be [{m}, {n}] with unit stride, got {list(residual.shape)}")
    out = x.new_empty(m, n)
    rc = kernel(
        x.data_ptr(),
        x.stride(0),
        *weight,
        None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        out.data_ptr(),
        n,
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    return out, rc


def markov_greedy(
    base: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, to_target: torch.Tensor | None, anchors: torch.Tensor
) -> torch.Tensor | None:
    """DSpark's vanilla Markov chain, greedy, in one call: draft i of row r is the argmax of
    ``base[r, i] + w2 @ w1[prev]`` (``base`` ``[rows, steps, V_d]`` float32 slot logits, ``w1``
    ``[V, rank]`` bf16, ``w2`` its ``[V_d, rank]`` weight as ``pack_linear`` left it), mapped by
    ``to_target`` ``[V_d]``; prev is the row's anchor (``anchors`` ``[rows]``), then its last
    draft. The drafts ``[rows, steps]`` as target ids, the bits of the step-by-step chain on
    the packed kernel; None where a step's logits hold a NaN (torch's argmax then decides)."""
    rows, steps, vocab = base.shape
    rank = w1.shape[1]
    if base.dtype != torch.float32 or not base.is_contiguous() or w1.dtype != torch.bfloat16 or not w1.is_contiguous():
        raise KernelArgumentError("markov_greedy takes contiguous float32 logits and a contiguous bf16 w1")
    _check_weight("markov_greedy", w1, w2, 1, vocab, None)
    for name, t, n in (("anchors", anchors, rows), ("to_target", to_target, vocab)):
        if t is not None and (t.dtype != torch.int64 or not t.is_contiguous() or t.numel() != n):
            raise KernelArgumentError(f"markov_greedy: {name} must be {n} contiguous int64 ids")
    out = torch.empty(rows, steps, dtype=torch.int64)
    rc = _library().markov_greedy(
        base.data_ptr(),
        rows,
        steps,
        vocab,
        w1.data_ptr(),
        rank,
        w2.data_ptr(),
        None if to_target is None else to_target.data_ptr(),
        anchors.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc == -1:
        return None
    if rc != 0:
        raise KernelUnavailable(f"markov_greedy: packed linear kernel failed ({rc})")
    return out


def int8_linear_available() -> bool:
    """Does this CPU run the int8 linear kernel (AVX-512 VNNI, or AVX2 + FMA)?"""
    return _available("int8_linear")


@dataclass
class Int8Weight:
    """A linear layer's weight for ``int8_linear``: per output, q = round(w / scale) in
    [-127, 127], packed; ``wsum`` = sum(q) per output (the activations' zero point cancels
    with it)."""

    packed: torch.Tensor
    scale: torch.Tensor
    wsum: torch.Tensor
    out_features: int


def pack_linear_int8(weight: torch.Tensor) -> Int8Weight:
    """Quantize a ``[n, k]`` weight (k a multiple of 4) symmetrically per output and pack it."""
    n, k = weight.shape
    if k % 4:
        raise ValueError(f"the int8 linear kernel takes weights whose K is a multiple of 4, got {n}x{k}")
    w = weight.detach().to(torch.float32, copy=True)  # quantized in place below
    scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = w.div_(scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    packed = torch.empty(-(-n // GROUP) * GROUP * k, dtype=torch.int8)
    _library().pack_linear(q.data_ptr(), n, k // 4, packed.data_ptr())  # words of 4 int8
    return Int8Weight(packed, scale.contiguous(), q.sum(dim=1, dtype=torch.int32), n)


def int8_linear(
    x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T (+ bias) (+ residual)`` for ``x`` ``[m, k]`` bf16 (rows may be strided), each
    row quantized to int8 on the fly, W as ``pack_linear_int8`` left it -> ``[m, n]`` bf16."""
    _check_weight("int8 linear", x, weight.packed, 1, weight.out_features, bias)
    pointers = (weight.packed.data_ptr(), weight.scale.data_ptr(), weight.wsum.data_ptr())
    out, rc = _linear(_library().int8_linear, "int8 linear", x, pointers, weight.out_features, bias, residual)
    if rc != 0:
        reasons = {-1: f"K {x.shape[1]} is not a multiple of 4", -2: "the int8 linear kernel is not built for this CPU"}
        raise KernelUnavailable(reasons.get(rc, "out of memory for the quantized activations"))
    return out


Q4_GROUP = 64  # cpu_kernels.c: positions of K sharing one int4 scale
PACK_CHUNK = 64 * GROUP  # outputs pack_linear_int4 quantizes at a time (whole groups)


def int4_linear_available() -> bool:
    """Does this CPU run the int4 linear kernel (AVX-512 VNNI, or AVX2 + FMA)?"""
    return _available("int4_linear")


@dataclass
class Int4Weight:
    """A linear layer's weight for ``int4_linear``: per output and Q4_GROUP positions of K,
    q = round(w / scale) in [-7, 7], packed as nibbles q + 8; ``scale`` ``[groups, K / Q4_GROUP,
    GROUP]`` float32 (the kernel reads 16 outputs' scales at once)."""

    packed: torch.Tensor
    scale: torch.Tensor
    out_features: int


def pack_linear_int4(weight: torch.Tensor) -> Int4Weight:
    """Quantize a ``[n, k]`` weight (k a multiple of Q4_GROUP) symmetrically per output and
    group of K, and pack it in cpu_kernels.c's int4 layout; PACK_CHUNK outputs at a time, so an
    LM head's float32 copies stay small (Qwen2.5's 151936 x 896: 15 MB, not 545 MB each)."""
    n, k = weight.shape
    if k % Q4_GROUP:
        raise ValueError(f"the int4 linear kernel takes weights whose K is a multiple of {Q4_GROUP}, got {n}x{k}")
    padded = -(-n // GROUP) * GROUP
    packed = torch.empty(padded * k // 2, dtype=torch.uint8)
    scales = torch.empty(padded // GROUP, k // Q4_GROUP, GROUP)
    for start in range(0, padded, PACK_CHUNK):  # whole groups of outputs: contiguous in both layouts
        rows, real = min(PACK_CHUNK, padded - start), weight[start : start + PACK_CHUNK].detach()
        w = torch.zeros(rows, k // Q4_GROUP, Q4_GROUP)
        w[: real.shape[0]] = real.to(torch.float32).view(real.shape[0], -1, Q4_GROUP)
        scale = (w.abs().amax(dim=2) / 7).clamp_min(torch.finfo(torch.float32).tiny)
        nibbles = w.div_(scale[..., None]).round_().clamp_(-7, 7).add_(8).to(torch.uint8)
        # [outputs (group, 4, 16), octets of K (low half, high half) x 4] -> [group, octet, 4, 16, 4]
        nibbles = nibbles.view(rows // GROUP, 4, 16, k // 8, 2, 4).permute(0, 3, 1, 2, 5, 4)
        packed[start * k // 2 : (start + rows) * k // 2] = (nibbles[..., 0] | nibbles[..., 1] << 4).reshape(-1)
        scales[start // GROUP : (start + rows) // GROUP] = scale.view(rows // GROUP, GROUP, -1).transpose(1, 2)
    return Int4Weight(packed, scales, n)


def int4_linear(
    x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T (+ bias) (+ residual)`` for ``x`` ``[m, k]`` bf16 (rows may be strided), each
    row quantized to int8 on the fly, W as ``pack_linear_int4`` left it -> ``[m, n]`` bf16."""
    _check_weight("int4 linear", x, weight.packed, 0.5, weight.out_features, bias)
    pointers = (weight.packed.data_ptr(), weight.scale.data_ptr())
    out, rc = _linear(_library().int4_linear, "int4 linear", x, pointers, weight.out_features, bias, residual)
    if rc != 0:
        reasons = {
            -1: f"K {x.shape[1]} is not a multiple of {Q4_GROUP}",
            -2: "the int4 linear kernel is not built for this CPU",
        }
        raise KernelUnavailable(reasons.get(rc, "out of memory for the quantized activations"))
    return out
