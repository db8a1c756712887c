"""The lean runtime's C kernels (``cpu_kernels.c``), built once per machine with gcc: batch-invariant
attention; RMSNorm, RoPE with the KV write and SiLU-and-multiply for bf16 steps; bf16
linear layers on packed weights (where the CPU has AVX-512 BF16 or AVX2 + FMA); and int8 and int4
linear layers for quantized drafters (AVX-512 VNNI or AVX2 + FMA, the same bits on both).

Why an attention kernel of our own: SDPA's CPU kernels block queries and keys by the sizes in the call, so
a token's attention output changes in its last bits with the number of tokens verified beside
it and with the cached length of other rows (measured: no fixed padding or batching of SDPA calls
made it stable in bf16 or float32). ``cpu_kernels.c`` computes every query token from its own
key list with one fixed order of operations, so the result does not depend on the step it is in.

Why the others: a layer's work between its matmuls was ~20 tensor ops of a few microseconds
each (``F.rms_norm`` alone ~8 ops, ~45 us, twice per layer: 2.6 ms of a 17 ms SmolLM2 step).
Each kernel here does in one call what those ops did, with the same bf16 rounding.

Why linear layers: a decode step streams every weight from memory once, and oneDNN's kernels
got ~19 GB/s of this machine's ~33 on SmolLM2's small matrices. The packed kernel (see
``cpu_kernels.c``) took 0.63-0.77x oneDNN's time for 1 to 17 rows, and it is batch invariant by
construction, so the K-split probing of oneDNN's weights is not needed where it runs.

Building, trusting and loading the shared object: ``kernel_library.py``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

# re-exported: the runtime's callers know the kernels by this module
from .kernel_library import KernelUnavailable as KernelUnavailable
from .kernel_library import library as _library
from .kernel_library import remember_row_invariant as remember_row_invariant
from .kernel_library import row_invariant_shapes as row_invariant_shapes

# cpu_kernels.c's limits: whole vectors of 16 floats per head or row, its stack buffers
MAX_HEAD_DIM = 256
MAX_GROUP = 32
MAX_NORM = 16384
KEY_CHUNK = 256  # a longer key list is attended in chunks of this many keys


def unavailable_reason(head_dim: int, num_heads: int, num_kv_heads: int) -> str | None:
    """None when the kernel builds and loads here and takes these heads, else why not."""
    group = num_heads // num_kv_heads
    if head_dim % 16 or head_dim > MAX_HEAD_DIM:
        return f"head dim {head_dim} (the kernel takes multiples of 16 up to {MAX_HEAD_DIM})"
    if num_heads % num_kv_heads or group > MAX_GROUP:
        return f"{num_heads} query heads over {num_kv_heads} kv heads (at most {MAX_GROUP} per kv head)"
    try:
        _library()
    except (KernelUnavailable, OSError) as e:
        return str(e)
    return None


class KernelArgumentError(ValueError):
    """An argument the C kernels would read or write out of bounds (a slot past the pool, a
    query with no key, a row count past a tensor): refused before any C runs, since the kernels
    trust their extents and a slip there is a crash of the serving process, not an exception."""


def _check_slots(name: str, slots: torch.Tensor, pool_slots: int) -> None:
    """Every entry of ``slots`` (int64) indexes a pool of ``pool_slots`` slots."""
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        raise KernelArgumentError(f"{name} must be contiguous int64, got {slots.dtype}")
    if slots.numel():
        low, high = (int(v) for v in torch.aminmax(slots))
        if low < 0 or high >= pool_slots:
            bad = low if low < 0 else high
            raise KernelArgumentError(f"{name}: slot {bad} is outside the KV pool's {pool_slots} slots")


def _check_table(name: str, table: torch.Tensor, rows: int, width: int) -> None:
    """``table`` holds at least ``rows`` rows of ``width`` values each."""
    if table.dim() < 1 or table.shape[0] < rows or table.numel() < rows * width:
        raise KernelArgumentError(f"{name} of shape {list(table.shape)} has no {rows} rows of {width} values")


def _check_tokens(
    kernel: str, tokens: int, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool_slots: int, d: int
) -> None:
    """A step's ``tokens`` new tokens: one pool slot each to write, one RoPE row each."""
    if slots.shape != (tokens,):
        raise KernelArgumentError(f"{kernel}: {list(slots.shape)} slots for {tokens} tokens")
    _check_slots("slots", slots, pool_slots)
    _check_table("cos", cos, tokens, d)
    _check_table("sin", sin, tokens, d)


def _check_rows(x: torch.Tensor, *others: torch.Tensor) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16) or any(o.dtype != x.dtype for o in others):
        raise TypeError(f"the CPU kernels run float32 or bfloat16, got {[t.dtype for t in (x, *others)]}")
    if x.stride(-1) != 1 or not all(o.is_contiguous() for o in others):
        raise ValueError("the CPU kernels need rows with unit stride and contiguous tables")


class KeyLists:
    """Per query token of a step, the pool slots it attends to, in position order.

    Token t reads ``slots[start[t] : start[t] + length[t]]``; with ``mask_from`` given, less the
    keys j >= ``mask_from[t]`` of that list where ``mask[t, j - mask_from[t]]`` is False (the
    nodes of a draft tree sharing one list: see cpu_kernels.c's key_mask). Only the CPU kernel
    reads masks. Built once per step and shared by every layer (the slots are the same in each
    layer's pool).
    """

    def __init__(
        self,
        slots: torch.Tensor,
        start: torch.Tensor,
        length: torch.Tensor,
        mask_from: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> None:
        self.slots = slots.to(torch.int64).contiguous()
        self.start = start.to(torch.int64).contiguous()
        self.length = length.to(torch.int64).contiguous()
        self.tokens = self.start.shape[0]
        self.mask_from = None if mask_from is None else mask_from.to(torch.int64).contiguous()
        self.mask = None if mask is None else mask.to(torch.uint8).contiguous()
        if self.mask is not None and (self.mask.dim() != 2 or self.mask.shape[0] != self.tokens):
            raise ValueError(f"a key mask of shape {tuple(self.mask.shape)} for {self.tokens} tokens")
        self._checked: tuple[int, int] | None = None  # (tokens, pool slots) check() passed for

    def check(self, tokens: int, pool_slots: int) -> None:
        """Refuse lists the kernels would read out of bounds, for a call of ``tokens`` queries on a
        pool of ``pool_slots`` slots: every query has at least one key (itself), each list lies
        within ``slots``, every slot within the pool, and a mask covers what it may hide. Done
        once per list and pool, not per layer: a step's lists serve all its layers."""
        if self._checked == (tokens, pool_slots):
            return
        if self.tokens != tokens or self.length.shape != (tokens,):
            raise KernelArgumentError(f"key lists for {self.tokens} queries in a call of {tokens}")
        if tokens:
            shortest = int(self.length.min())
            if shortest < 1:
                raise KernelArgumentError(f"key_len {shortest}: every query attends to at least one key (itself)")
            if int(self.start.min()) < 0 or int((self.start + self.length).max()) > self.slots.shape[0]:
                raise KernelArgumentError(f"key_start + key_len past the {self.slots.shape[0]} key slots")
        _check_slots("key slots", self.slots, pool_slots)
        if self.mask is not None:
            from_, width = self.mask_from, self.mask.shape[1]
            if from_ is None or from_.shape != (tokens,) or (tokens and int(from_.min()) < 0):
                raise KernelArgumentError("mask_from must give each query a key index >= 0")
            if tokens and int((self.length - from_).max()) > width:
                raise KernelArgumentError(f"a key mask of {width} columns hides fewer keys than mask_from leaves")
        self._checked = (tokens, pool_slots)

    def to(self, device: torch.device) -> KeyLists:
        if self.slots.device == torch.device(device):
            return self
        if self.mask is not None and torch.device(device).type != "cpu":
            raise ValueError("key masks are read by the CPU kernel only")
        return KeyLists(self.slots.to(device), self.start.to(device), self.length.to(device), self.mask_from, self.mask)

    def mask_args(self) -> tuple[int | None, int | None, int]:
        """(mask_from, mask, mask width) as the C functions take them."""
        if self.mask is None:
            return None, None, 0
        return self.mask_from.data_ptr(), self.mask.data_ptr(), self.mask.shape[1]


def attend(
    q: torch.Tensor, kv_layer: torch.Tensor, keys: KeyLists, num_heads: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of ``q`` ``[tokens, >= heads * head_dim]`` (rows may be strided, heads
    group-major) over ``kv_layer`` ``[slots, 2, kv_heads, head_dim]`` -> ``[tokens, heads * head_dim]``."""
    _, _, kv_heads, d = kv_layer.shape
    _check_rows(q, kv_layer)
    keys.check(q.shape[0], kv_layer.shape[0])
    if q.shape[1] < num_heads * d:
        raise KernelArgumentError(f"q rows of {q.shape[1]} values hold no {num_heads} heads of {d}")
    if out is None:
        out = q.new_empty(keys.tokens, num_heads * d)
    elif not out.is_contiguous() or out.shape != (keys.tokens, num_heads * d):
        raise KernelArgumentError(f"out must be a contiguous [{keys.tokens}, {num_heads * d}], got {list(out.shape)}")
    rc = _library().attend(
        q.data_ptr(),
        q.stride(0),
        kv_layer.data_ptr(),
        keys.slots.data_ptr(),
        keys.start.data_ptr(),
        keys.length.data_ptr(),
        *keys.mask_args(),
        out.data_ptr(),
        keys.tokens,
        num_heads,
        kv_heads,
        d,
        d**-0.5,
        int(q.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if rc == -2:
        raise MemoryError("batch-invariant attention: out of memory for its scratch buffers")
    if rc != 0:
        raise KernelUnavailable(unavailable_reason(d, num_heads, kv_heads) or "the kernel refused its arguments")
    return out


def bf16_attention_on_dots() -> bool:
    """Does bf16 attention run on AVX-512 BF16's dot products here (cpu_kernels.c's header),
    rather than in float32 as float32 attention does?"""
    return bool(_library().attend_bf16_dots())


def layer_kernels_available(hidden_size: int, intermediate_size: int, head_dim: int) -> bool:
    """Can rms_norm, rope_store and silu_mul run a layer of these sizes here?"""
    if (
        any(n % 16 or n > MAX_NORM for n in (hidden_size, intermediate_size))
        or head_dim % 16
        or head_dim > MAX_HEAD_DIM
    ):
        return False
    return _kernels_built()


def _ran(kernel: str, *args: int | float) -> bool:
    """One of the lane-wise kernels (rms_norm, rope_store, silu_mul) on torch's thread count;
    False where it refused the sizes it was given."""
    return getattr(_library(), kernel)(*args, torch.get_num_threads()) == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of each row of ``x`` ``[rows, n]`` (rows may be strided; float32 or
    bfloat16, ``weight`` of the same dtype). Callers check ``layer_kernels_available`` once."""
    rows, n = x.shape
    _check_rows(x, weight)
    _check_table("weight", weight.view(1, -1), 1, n)
    out = x.new_empty(rows, n)
    pointers = (x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0))
    if not _ran("rms_norm", *pointers, rows, n, eps, int(x.dtype == torch.bfloat16)):
        raise KernelUnavailable(f"rms_norm takes rows of a multiple of 16 values up to {MAX_NORM}, got {n}")
    return out


def rope_store(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor, num_heads: int
) -> None:
    """RoPE on the q and k heads of ``qkv`` ``[tokens, (heads + 2 kv_heads) * head_dim]`` in place
    (``cos``, ``sin``: ``[tokens, head_dim]``, sin sign-folded as lean_lm's _Rope makes it), then
    each token's k and v heads into ``kv_layer[slots[t]]`` (``[slots, 2, kv_heads, head_dim]``)."""
    _check_rows(qkv, cos, sin, kv_layer)
    _, _, kv_heads, d = kv_layer.shape
    tokens = qkv.shape[0]
    _check_table("qkv", qkv.view(tokens, -1) if tokens else qkv, tokens, (num_heads + 2 * kv_heads) * d)
    _check_tokens("rope_store", tokens, slots, cos, sin, kv_layer.shape[0], d)
    pointers = (qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), kv_layer.data_ptr(), slots.data_ptr())
    if not _ran("rope_store", *pointers, qkv.shape[0], num_heads, kv_heads, d, int(qkv.dtype == torch.bfloat16)):
        raise KernelUnavailable(f"rope_store takes a head dim that is a multiple of 16 up to {MAX_HEAD_DIM}, got {d}")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[rows, 2 n]`` (gate first) -> ``[rows, n]``."""
    _check_rows(gate_up)
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, n)
    pointers = (gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0))
    if not _ran("silu_mul", *pointers, rows, n, int(gate_up.dtype == torch.bfloat16)):
        raise KernelUnavailable(f"silu_mul takes rows of a multiple of 16 values up to {MAX_NORM}, got {n}")
    return out


class LinearWeights(ctypes.Structure):
    """cpu_kernels.c's linear_weights: a packed weight, its bias (or NULL), for int8 its
    per-output scales and sums, for int4 its scales only (NULL for bf16)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("packed", "bias", "scale", "wsum")]


class LayerWeights(ctypes.Structure):
    """cpu_kernels.c's layer_weights: one decoder layer's bf16 norms and its four linears."""

    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p)] + [
        (name, LinearWeights) for name in ("qkv", "o", "gate_up", "down")
    ]


class LayerSteps:
    """bf16 decoder layers run by ``run_layers``, any run of them in one call: per layer RMSNorm,
    the q|k|v projection, RoPE and the KV write, attention over key lists, o_proj into the
    residual, RMSNorm, gate|up, SiLU * up and down_proj into the residual. The same kernels in
    the same order as lean_lm's calls one by one, so the same bits (tested), without their
    per-call Python cost. Per layer, ``norms``: (attn, mlp); ``linears``: q|k|v, o, gate|up,
    down, each as LinearWeights' fields (tensors or None)."""

    def __init__(self, layers: list[tuple[tuple[torch.Tensor, torch.Tensor], list[tuple[torch.Tensor | None, ...]]]]):
        # kept alive: the structs hold their addresses
        self.tensors = [t for norms, linears in layers for t in (*norms, *(t for linear in linears for t in linear))]

        def ptrs(tensors):
            return [None if t is None else t.data_ptr() for t in tensors]

        self.weights = (LayerWeights * len(layers))(
            *(
                LayerWeights(*ptrs(norms), *(LinearWeights(*ptrs(linear)) for linear in linears))
                for norms, linears in layers
            )
        )

    def __len__(self) -> int:
        return len(self.weights)


def run_layers(
    layers: LayerSteps,
    first: int,
    end: int,
    h: torch.Tensor,
    sizes: tuple[int, int, int, int, int],
    eps: float,
    kv: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: KeyLists,
    scratch: torch.Tensor,
    attn_in: torch.Tensor | None = None,
) -> None:
    """Decoder layers ``first`` to ``end`` - 1 on the residual stream ``h`` ``[tokens, hidden]``
    bf16 (contiguous), in place, in one call. ``sizes``: (hidden, intermediate, heads,
    kv_heads, head_dim); ``kv``: the pool's ``[layers, slots, ...]`` KV; ``scratch``: at least
    ``layer_scratch(tokens, sizes)`` bf16 values. ``attn_in``: one layer only, whose attention
    reads this contiguous bf16 ``[tokens, width]`` (``width``: its q|k|v weight's K) instead of
    its input norm of ``h`` (drafter heads). Every extent is checked here, once per call (a few
    integer comparisons; the key lists' slots once per step), before any C runs."""
    hidden, inter, heads, kv_heads, d = sizes
    if not 0 <= first < end <= len(layers) or kv.shape[0] < end:
        raise KernelArgumentError(f"layers {first} to {end} of {len(layers)} (KV of {kv.shape[0]})")
    tokens = h.shape[0]
    if h.dtype != torch.bfloat16 or not h.is_contiguous() or h.shape != (tokens, hidden):
        raise KernelArgumentError(f"h must be a contiguous bf16 [tokens, {hidden}], got {h.dtype} {list(h.shape)}")
    if attn_in is not None and (
        end != first + 1
        or attn_in.dtype != torch.bfloat16
        or not attn_in.is_contiguous()
        or attn_in.dim() != 2
        or attn_in.shape[0] != tokens
    ):
        raise KernelArgumentError(
            f"attn_in must be a contiguous bf16 [{tokens}, width] for one layer, got {attn_in.dtype} "
            f"{list(attn_in.shape)} for layers {first} to {end}"
        )
    if kv.dtype != torch.bfloat16 or kv.dim() != 5 or kv.shape[2:] != (2, kv_heads, d) or not kv.is_contiguous():
        raise KernelArgumentError(f"kv must be a contiguous bf16 [layers, slots, 2, {kv_heads}, {d}]")
    _check_tokens("run_layers", tokens, slots, cos, sin, kv.shape[1], d)
    keys.check(tokens, kv.shape[1])
    if scratch.numel() < layer_scratch(tokens, sizes):
        raise KernelArgumentError(
            f"scratch of {scratch.numel()} values, {tokens} tokens need {layer_scratch(tokens, sizes)}"
        )
    layer_bytes = kv.stride(0) * kv.element_size()
    sized = (hidden, inter, heads, kv_heads, d, eps, d**-0.5)
    weights = ctypes.byref(layers.weights, first * ctypes.sizeof(LayerWeights))
    if attn_in is None:
        run = _library().run_layers
        head = (h.data_ptr(), tokens, *sized, weights, end - first, kv.data_ptr() + first * layer_bytes, layer_bytes)
    else:
        run = _library().run_layer_attn_in
        head = (h.data_ptr(), attn_in.data_ptr(), attn_in.shape[1], tokens, *sized, weights)
        head += (kv.data_ptr() + first * layer_bytes,)
    rc = run(
        *head,
        slots.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        keys.slots.data_ptr(),
        keys.start.data_ptr(),
        keys.length.data_ptr(),
        *keys.mask_args(),
        scratch.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise KernelUnavailable(f"run_layers refused its sizes {sizes} (or ran out of memory: {rc})")


def layer_scratch(tokens: int, sizes: tuple[int, int, int, int, int]) -> int:
    """bf16 values of scratch ``run_layers`` needs for ``tokens`` tokens."""
    hidden, inter, heads, kv_heads, d = sizes
    return tokens * (hidden + (heads + 2 * kv_heads) * d + heads * d + 3 * inter)


GROUP = 64  # cpu_kernels.c: outputs per packed group of a linear layer's weight


@cache
def _kernels_built() -> bool:
    """Do the kernels build and load here? (Asked once: a failed build is not retried per call.)"""
    try:
        _library()
    except (KernelUnavailable, OSError):
        return False
    return True


def _available(kernel: str) -> bool:
    return _kernels_built() and bool(getattr(_library(), f"{kernel}_available")())


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """torch.argmax of each row of ``logits`` ``[rows, V]`` (the first of equal maxima), as a
    list: greedy verification runs it on every row of every step, and torch widens a copy
    first (~50 us a row of 49k bf16 values here) where the kernel reads them in place (~8 us)."""
    fits = logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float32)
    if fits and logits.dim() == 2 and logits.numel() and logits.stride(1) == 1 and _kernels_built():
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        bf16 = int(logits.dtype == torch.bfloat16)
        _library().argmax_rows(logits.data_ptr(), logits.stride(0), *logits.shape, bf16, out.data_ptr())
        found = out.tolist()
        if -1 not in found:  # -1: a row with a NaN, which torch's argmax picks
            return found
    return logits.float().argmax(dim=-1).tolist()


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
