"""The lean runtime's C kernels (``cpu_kernels.c``), built once per machine with gcc: batch-invariant
attention; RMSNorm, RoPE with the KV write and SiLU-and-multiply for bf16 steps; whole bf16
decoder layers in one call; and the argmax of rows. The linear layers' wrappers (bf16 on packed
weights, int8 and int4): ``linear_kernels.py``.

Why an attention kernel of our own: SDPA's CPU kernels block queries and keys by the sizes in the call, so
a token's attention output changes in its last bits with the number of tokens verified beside
it and with the cached length of other rows (measured: no fixed padding or batching of SDPA calls
made it stable in bf16 or float32). ``cpu_kernels.c`` computes every query token from its own
key list with one fixed order of operations, so the result does not depend on the step it is in.

Why the others: a layer's work between its matmuls was ~20 tensor ops of a few microseconds
each (``F.rms_norm`` alone ~8 ops, ~45 us, twice per layer: 2.6 ms of a 17 ms SmolLM2 step).
Each kernel here does in one call what those ops did, with the same bf16 rounding.

Building, trusting and loading the shared object: ``kernel_library.py``.
"""

from __future__ import annotations

import ctypes
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
    return kernels_built()


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

    @classmethod
    def of(cls, tensors: tuple[torch.Tensor | None, ...]) -> LinearWeights:
        """The struct of a linear's ``kernel_weights()`` (which must outlive it)."""
        return cls(*(None if t is None else t.data_ptr() for t in tensors))


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
                LayerWeights(*ptrs(norms), *(LinearWeights.of(linear) for linear in linears))
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
    _check_layer_tensors(first, end, h, sizes, kv, attn_in)
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


@dataclass(frozen=True)
class EagleChain:
    """An EAGLE-family head's propose call for a greedy chain of ``steps`` drafts per row in one
    call (cpu_kernels.c's eagle_chain), through its one decoder layer ``layer`` (KV pool ``kv``).
    The layer's inputs follow the head's layout: EAGLE-3's ``pair_norms`` (input_layernorm,
    hidden_norm; ``norm_before_residual``), EAGLE-1's ``fc`` over [embedding | state], or MTP's
    (DeepSeek) ``pair_norms`` (enorm, hnorm), ``fc`` (eh_proj) and ``attn_norm``
    (input_layernorm); the LM head reads the state or, with ``final_norm``, its norm.
    ``context``: (token ids ``[ctx]``, the states ``[ctx, hidden]`` bf16: EAGLE-3's fc features,
    the others' target states; each row's last pair's index ``[rows]``) of the new pairs, row
    after row; ``queries``: (slots, cos, sin, key lists) of the context's pairs, then of the
    steps - 1 fed positions step-major (fed step s of row r is query ctx + s * rows + r);
    ``lm_head`` over ``vocab`` draft ids, mapped to target ids by ``to_target`` (None: the same
    ids) that index ``embed`` ``[V, hidden]``."""

    layer: LayerSteps
    sizes: tuple[int, int, int, int, int]
    eps: float
    kv: torch.Tensor
    context: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    steps: int
    queries: tuple[torch.Tensor, torch.Tensor, torch.Tensor, KeyLists]
    embed: torch.Tensor
    lm_head: LinearWeights
    vocab: int
    to_target: torch.Tensor | None
    fc: LinearWeights | None = None
    pair_norms: tuple[torch.Tensor, torch.Tensor] | None = None
    attn_norm: torch.Tensor | None = None
    final_norm: torch.Tensor | None = None
    norm_before_residual: bool = False

    def check(self) -> None:
        """Every tensor the C call reads through a pointer, and every index it follows."""
        hidden, _, _, _, d = self.sizes
        ids, features, last = self.context
        ctx, rows, steps, kv, embed = features.shape[0], last.shape[0], self.steps, self.kv, self.embed
        slots, cos, sin, keys = self.queries
        _check_layer_tensors(0, 1, features, self.sizes, kv, None)
        if steps < 1 or len(self.layer) != 1 or not 0 < rows <= ctx:
            raise KernelArgumentError(
                f"a chain of {steps} drafts for {rows} rows from {ctx} pairs through {len(self.layer)} layers"
            )
        if (self.fc is None and self.pair_norms is None) or (self.fc is None and self.attn_norm is not None):
            raise KernelArgumentError("a chain's layer inputs: EAGLE-3's pair norms, EAGLE-1's fc, or MTP's both")
        _check_tokens("eagle_chain", ctx + (steps - 1) * rows, slots, cos, sin, kv.shape[1], d)
        keys.check(ctx + (steps - 1) * rows, kv.shape[1])
        if keys.mask is not None:
            raise KernelArgumentError("a chain's key lists hide no keys")
        norms = [*(self.pair_norms or ()), self.attn_norm, self.final_norm]
        tables = (("embed", embed), *((f"norm {i}", n.view(1, -1)) for i, n in enumerate(norms) if n is not None))
        for name, table in tables:
            if table.dtype != torch.bfloat16 or not table.is_contiguous() or table.shape[-1] != hidden:
                raise KernelArgumentError(
                    f"{name} must be a contiguous bf16 [.., {hidden}], got {table.dtype} {list(table.shape)}"
                )
        # every id the kernel indexes with: the pairs' tokens and the drafts' target ids
        # (embedding rows), each row's last pair
        indices = [("ids", ids, ctx, embed.shape[0]), ("last", last, rows, ctx)]
        if self.to_target is not None:
            indices.append(("to_target", self.to_target, self.vocab, embed.shape[0]))
        elif self.vocab > embed.shape[0]:
            raise KernelArgumentError(
                f"{self.vocab} draft ids without to_target past the {embed.shape[0]}-row embedding"
            )
        for name, index, count, bound in indices:
            if index.dtype != torch.int64 or not index.is_contiguous() or index.shape != (count,):
                raise KernelArgumentError(f"{name} must be a contiguous int64 [{count}]")
            if count and not 0 <= int(index.min()) <= int(index.max()) < bound:
                raise KernelArgumentError(f"{name} holds an index outside [0, {bound})")


def eagle_chain(chain: EagleChain) -> list[list[int]] | None:
    """`chain` in one C call: each row's drafts as target ids, or None where logits held a NaN
    (the caller drafts in torch)."""
    chain.check()
    hidden, _, _, _, d = chain.sizes
    ids, features, last = chain.context
    ctx, rows = features.shape[0], last.shape[0]
    slots, cos, sin, keys = chain.queries
    widest = max(ctx, rows)
    state, logits = features.new_empty(rows, hidden), features.new_empty(rows, chain.vocab)
    attn_in, cat = features.new_empty(widest, 2 * hidden), features.new_empty(widest, 2 * hidden)
    scratch = features.new_empty(layer_scratch(widest, chain.sizes))
    drafts, out = torch.empty(rows, dtype=torch.int64), torch.empty(rows, chain.steps, dtype=torch.int64)
    norms = [*(chain.pair_norms or (None, None)), chain.attn_norm, chain.final_norm]
    rc = _library().eagle_chain(
        features.data_ptr(),
        ids.data_ptr(),
        ctx,
        last.data_ptr(),
        rows,
        chain.steps,
        *chain.sizes,
        chain.eps,
        d**-0.5,
        ctypes.byref(chain.layer.weights),
        chain.kv.data_ptr(),
        chain.embed.data_ptr(),
        None if chain.fc is None else ctypes.byref(chain.fc),
        *(None if n is None else n.data_ptr() for n in norms),
        int(chain.norm_before_residual),
        ctypes.byref(chain.lm_head),
        chain.vocab,
        None if chain.to_target is None else chain.to_target.data_ptr(),
        *(t.data_ptr() for t in (slots, cos, sin, keys.slots, keys.start, keys.length)),
        *(t.data_ptr() for t in (state, drafts, logits, attn_in, cat, scratch, out)),
        torch.get_num_threads(),
    )
    if rc == -1:
        return None
    if rc != 0:
        raise KernelUnavailable(f"eagle_chain refused its sizes {chain.sizes} (or ran out of memory: {rc})")
    return out.tolist()


def _check_layer_tensors(
    first: int,
    end: int,
    h: torch.Tensor,
    sizes: tuple[int, int, int, int, int],
    kv: torch.Tensor,
    attn_in: torch.Tensor | None,
) -> None:
    """``run_layers``' residual stream ``h``, its ``attn_in`` if given and its KV pool ``kv``
    have the shapes, dtype and layout its C reads them with."""
    hidden, _, _, kv_heads, d = sizes
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


def layer_scratch(tokens: int, sizes: tuple[int, int, int, int, int]) -> int:
    """bf16 values of scratch ``run_layers`` needs for ``tokens`` tokens."""
    hidden, inter, heads, kv_heads, d = sizes
    return tokens * (hidden + (heads + 2 * kv_heads) * d + heads * d + 3 * inter)


@cache
def kernels_built() -> bool:
    """Do the kernels build and load here? (Asked once: a failed build is not retried per call.)"""
    try:
        _library()
    except (KernelUnavailable, OSError):
        return False
    return True


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """torch.argmax of each row of ``logits`` ``[rows, V]`` (the first of equal maxima), as a
    list: greedy verification runs it on every row of every step, and torch widens a copy
    first (~50 us a row of 49k bf16 values here) where the kernel reads them in place (~8 us)."""
    fits = logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float32)
    if fits and logits.dim() == 2 and logits.numel() and logits.stride(1) == 1 and kernels_built():
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        bf16 = int(logits.dtype == torch.bfloat16)
        _library().argmax_rows(logits.data_ptr(), logits.stride(0), *logits.shape, bf16, out.data_ptr())
        found = out.tolist()
        if -1 not in found:  # -1: a row with a NaN, which torch's argmax picks
            return found
    return logits.float().argmax(dim=-1).tolist()
