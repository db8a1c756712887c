"""Lean batched forward for Llama-style decoders (Llama/SmolLM2, Qwen2, Qwen3, Mistral without
sliding window) over the paged KV pool of ``kv_cache.py``.

One ``forward`` call runs a ragged batch: every row brings its own new tokens (a prompt chunk, one
token, k+1 tokens to verify) and attends over its own cached tokens plus those new tokens (causal
among them by default, or any given ``[n, n]`` mask for trees). New K/V are written into the row's
pool slots first; after the call the row's cached length has grown by n, and a caller that rejects
drafts rolls back with ``pool.truncate``.

How it is laid out, and why (2-core CPU, SmolLM2-135M bf16, 2 threads; the step table is printed
by ``scripts/bench_runtime.py``):

- bf16 matmuls, on CPUs with AVX-512 BF16 or AVX2 + FMA, run in ``linear_kernels.packed_linear`` on
  weights packed once at load (``_PackedLinear``): 0.63-0.77x oneDNN's time for 1 to 17 rows,
  0.91x for 40, equal from 128 to 512 (SmolLM2's 30 layers of weights, cold caches), and row
  invariant by construction. On AVX2, where oneDNN has no bf16, it halves the 1-token step of
  oneDNN's float32 on widened weights (whole SmolLM2 steps: 21-25 against 37-42 ms). Elsewhere (float32, other CPUs) matmuls go through oneDNN with weights
  prepacked at load (``mkldnn._reorder_linear_weight``, ``mkldnn._linear_pointwise``), the
  fastest torch path at every row count measured (30 layers ~12 ms at 1 and 5 rows, vs ~16 and
  ~18-25 ms for ``F.linear`` / ``torch.mm``). Either way the residual adds after o_proj and
  down_proj are fused into those matmuls.
- Q, K, V come from one fused projection, gate and up from another; RoPE is applied in place on
  the q|k part of the fused output (a half-swap and a sign-folded sin: two arithmetic kernels),
  and K|V, adjacent in that output, go into the pool with one ``index_copy_``.
- Attention is SDPA with GQA folded into the query axis: the ``heads / kv_heads`` query heads that
  share a kv head become extra query rows of one head. Per call at 200 cached keys, folded vs
  ``enable_gqa=True``: 27 vs 114 us for 1 new token, 57 vs 79 us for 5, 106 vs 131 us for 17,
  2.1 vs 2.2 ms for 256. Query heads are stored group-major (the q_proj rows and o_proj columns
  are permuted at load), so the fold is a view for one token and unfolding the output is a view.
  Past ``FOLD_MAX_TOKENS`` new tokens in a row (long prompt chunks) the folded mask would cost
  ``heads / kv_heads`` times the memory, so those use SDPA's own GQA (no mask from position 0).
- Rows are grouped by their number of new tokens; each group is one SDPA call. A group of one row
  whose blocks are contiguous (the pool hands out one run of blocks when it can) reads a view of
  the pool: no gather, no copy. Larger groups gather their keys per layer into a padded batch:
  for 8 rows at 200 keys, gather + one SDPA took 164 us per layer (1 token) and 278 us (5
  tokens), one SDPA per row on views 242 and 410 us.
- In bf16 a layer's work between matmuls is four C calls (``cpu_kernels``: two RMSNorms, RoPE
  with the KV write, SiLU * up) instead of ~20 tensor ops of a few microseconds each (the
  norms alone were 2.6 ms of a 17 ms step); float32 keeps the tensor ops, whose sums are
  transformers'.
- Where every part of a bf16 layer has its C kernel (packed linears, key-list attention, no
  q/k norms: SmolLM2, Llama, Qwen2, Mistral on AVX-512 BF16 or AVX2), a step's whole stack of
  layers is one C call (``cpu_kernels.run_layers``; one per run between hidden states asked
  for): the same kernels in the same order, so the same bits, without ~8 Python -> C calls a
  layer (~7 us each) or a call per layer (~10 us each on the Zen 1 host).
- Positions default to cached length + index; explicit per-row positions are accepted (trees).
- RoPE cos/sin come from transformers' own init functions (default, linear, dynamic, yarn,
  llama3, longrope), computed like its rotary embedding (float32, then cast), as a table by
  position. ``dynamic`` and ``longrope`` change frequencies past a length: they are recomputed for
  the row from the row's own length (transformers uses the batch's longest, and keeps a grown
  table after a rollback; a single sequence decoding forward gets the same numbers).
- Hidden states use vLLM's numbering: id i < num_layers is the residual stream entering decoder
  layer i (transformers' ``hidden_states[i]``); id num_layers or -1 is the final normed state.

Batch-invariant mode (``from_hf(..., batch_invariant=True)``, the verifier's default): attention
runs in ``cpu_kernels.c`` instead of SDPA (each token over its own key list, in one fixed order;
no step plan of groups and masks is built), and every oneDNN matmul is split along K as far as
the load-time probe needs (``_Linear.invariant``; packed bf16 matmuls need no split and are
checked once per shape). A token's logits are then the same bits whatever else shares its
step; measured at 0.96-1.06x the SDPA path's step time.

On a GPU the lean runtime runs batch-invariant only, on the OpenAI Triton kernels of
``kernels/batch_invariant.py`` (linear layers with one fixed tile, RMSNorm a row per program,
attention a token per program over the same key lists); the rest of a layer is the tensor ops,
which are per element. Tests run that path on a CPU in Triton's interpreter
(``from_hf(..., triton_kernels=True)``); ``scripts/gpu_check.sh`` runs it compiled.

Not here (yet): a ``torch.compile`` path. Inductor cannot trace the prepacked oneDNN weights
(opaque ``_mkldnn`` tensors fail ``fullgraph`` compilation), so a compiled step would keep plain
weights as frozen module parameters and let ``freezing=True`` prepack them itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from kernels import batch_invariant as gpu_kernels

from . import cpu_kernels, linear_kernels
from .kv_cache import BLOCK_SIZE, KVCachePool, SequenceError
from .model_store import model_config, read_safetensors
from .threads import governed

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# Above this many new tokens in a row GQA is not folded into the query axis: folding measured
# faster up to 256, but its mask grows heads/kv_heads times (long prompt chunks).
FOLD_MAX_TOKENS = 256
# Batch invariance (see _Linear): K chunk sizes tried in turn (None = unsplit), the row counts
# probed (every count of a 1-token step up to a k = 16 verification, then the edges of powers of
# two), and the most rows one matmul is given.
K_CHUNKS = (None, 1024, 512, 256, 128)
ROW_SLAB = 256
LOGITS_SLAB = 64  # the lm head: its matmul is the costliest to probe (a vocabulary of rows)
PROBE_ROWS = (*range(1, 18), 24, 31, 32, 33, 48, 63, 64, 65, 96, 127, 128, 129, 192, 255, 256)


class UnsupportedArchitecture(ValueError):
    """The model is not one the lean runtime runs; serve it through transformers instead."""


@dataclass
class Row:
    """One sequence's part of a step.

    ``mask``: ``[n, n]`` bool among the new tokens, True where token i may attend to token j
    (default causal; the cached tokens are all seen), or ``[n, cached + n]`` over the cached
    tokens too (a drafter's tree nodes fed a level at a time see only their ancestors); every
    token must be allowed to see itself. ``positions``: ``[n]`` RoPE
    positions (default: cached length + index).
    """

    seq_id: Hashable
    token_ids: torch.Tensor | Sequence[int]
    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None


@dataclass
class StepOutput:
    """Per row, in the order of the rows given: logits ``[m, vocab]`` of the row's last m new
    tokens, and ``{layer id as asked: [n, hidden]}`` over all n new tokens."""

    logits: list[torch.Tensor]
    hidden: list[dict[int, torch.Tensor]]


def unsupported_reason(config) -> str | None:
    """Why the lean runtime cannot run this transformers config, or None when it can."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    if model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return f"sliding window attention (sliding_window={config.sliding_window})"
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "sliding window attention on some layers (use_sliding_window)"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in _ROPE_TYPES:
        return f"rope_type {rope.get('rope_type')!r}"
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings"
    return None


def bf16_matmul_dtype() -> torch.dtype:
    """What a bf16 linear layer off the packed kernel multiplies in: bf16 where oneDNN has bf16
    kernels (AVX-512 or AVX-NE-CONVERT); elsewhere float32 on its bf16 weights widened once at
    load (on AVX2, 3-5x faster than ATen's bf16 GEMM from 5 rows up). Its input and output stay
    bf16."""
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


# The K chunk that passed the row-invariance probe, by weight shape, bias, fused add, row slab,
# dtype and thread count: what oneDNN runs depends on nothing else in a process, so one that
# builds models again (a drafter beside the target, a reload, the tests: ~0.5 s a tiny model)
# probes each shape once.
_PROBED_K_CHUNKS: dict[tuple, int | None] = {}


class _Linear:
    """y = x W^T + b on weights prepacked for oneDNN (optionally + residual, fused).

    Batch-invariant linears (``invariant``) split K into the chunks whose matmul gives each row
    the same bits at every row count, and feed at most ``ROW_SLAB`` rows to one matmul (the
    probed range). On the 2-core EPYC here oneDNN's bf16 and float32 kernels were row-invariant up
    to K = 1024 and not above (SmolLM2's down_proj, K = 1536, changed at 2 rows in float32 and 7
    in bf16): the chunked matmul accumulates chunk by chunk through the fused add.
    """

    device = torch.device("cpu")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        k_chunk: int | None = None,
        slab: int | None = None,
    ) -> None:
        self.out_features, k = weight.shape
        self.dtype = weight.dtype
        self.compute_dtype = bf16_matmul_dtype() if weight.dtype == torch.bfloat16 else weight.dtype
        step = k_chunk or k
        self.bounds = [(a, min(a + step, k)) for a in range(0, k, step)]
        self.weights = [
            torch.ops.mkldnn._reorder_linear_weight(weight[:, a:b].to(self.compute_dtype).contiguous(), 8)
            for a, b in self.bounds
        ]
        self.bias = None if bias is None else bias.to(self.compute_dtype)
        self.k_chunk = k_chunk
        self.slab = slab

    def _whole(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        """The fields of a linear whose kernel takes K whole and any number of rows (no chunks,
        no slabs); the kernel's own form of the weight is the subclass's."""
        self.out_features, k = weight.shape
        self.dtype = dtype
        self.bounds = [(0, k)]
        self.bias = bias
        self.k_chunk = self.slab = None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors it holds (its weights in whatever form its kernel takes)."""
        return [t for t in (*self.weights, self.bias) if t is not None]

    @classmethod
    def invariant(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, slab: int = ROW_SLAB, adds: bool = True
    ) -> _Linear:
        """The least-split linear that passes the row-invariance probe on this machine (rows up
        to ``slab``; ``adds``: the fused residual add is used too)."""
        for k_chunk in K_CHUNKS:
            if k_chunk is not None and k_chunk >= weight.shape[1]:
                continue
            linear = cls(weight, bias, k_chunk, slab)
            if linear.row_invariant(adds):
                return linear
        raise UnsupportedArchitecture(
            f"no row-invariant matmul found for a {tuple(weight.shape)} weight on this CPU; serve with batch "
            "invariance off"
        )

    def row_invariant(self, adds: bool, max_rows: int | None = None) -> bool:
        """Does each row get the same bits alone as among up to ``max_rows`` (``slab``) rows?"""
        rows = [m for m in PROBE_ROWS if m <= (max_rows or self.slab)]
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(rows[-1], self.bounds[-1][1], generator=gen).to(self.device, self.dtype)
        r = torch.randn(rows[-1], self.out_features, generator=gen).to(self.device, self.dtype) if adds else None

        def run(a: int, b: int) -> list[torch.Tensor]:
            out = [self(x[a:b])]
            if adds:
                out.append(self.add(x[a:b], r[a:b]))
            return out

        alone = [run(i, i + 1) for i in range(rows[-1])]
        for m in rows:
            together = run(0, m)
            for i in range(m):
                if not all(torch.equal(t[i], a[0]) for t, a in zip(together, alone[i])):
                    return False
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self._run(x, residual)

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if self.slab is not None and x.shape[0] > self.slab:
            return torch.cat(
                [
                    self._run(x[i : i + self.slab], None if residual is None else residual[i : i + self.slab])
                    for i in range(0, x.shape[0], self.slab)
                ]
            )
        rows = x.shape[0]
        padded = onednn_rows(rows) if self.slab is None else min(onednn_rows(rows), self.slab)
        x = _padded_rows(x.to(self.compute_dtype), padded)
        y = None if residual is None else _padded_rows(residual.to(self.compute_dtype), padded)
        for index, ((a, b), weight) in enumerate(zip(self.bounds, self.weights)):
            part = x if len(self.bounds) == 1 else x[:, a:b]
            bias = self.bias if index == 0 else None
            if y is None:
                y = torch.ops.mkldnn._linear_pointwise(part, weight, bias, "none", [], "")
            else:
                y = torch.ops.mkldnn._linear_pointwise.binary(part, y, weight, bias, "add")
        return y[:rows].to(self.dtype)


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN matmul of `rows` rows runs at: up to 16 as is (decode steps and
    verifications), above that rounded up to one of 8 counts an octave (at most 12.5% more).
    oneDNN and torch's ideep wrapper cache a primitive per shape (1024 each), ~0.5 MB of memory
    apiece at SmolLM2's sizes: with every row count a prompt chunk or a ragged batch can have,
    a float32 server's memory climbed for as long as new counts turned up (a probe of 256 row
    counts by 6 weight shapes: +3.5 GB, 15 s of primitive builds; with these 48 counts +0.2 GB,
    1.5 s), so `tritonspec soak` never saw it flat."""
    if rows <= 16:
        return rows
    step = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def _padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` [m, k] with zero rows below it up to `rows`."""
    return x if x.shape[0] >= rows else F.pad(x, (0, 0, 0, rows - x.shape[0]))


class _TritonLinear(_Linear):
    """A linear layer in ``kernels/batch_invariant.linear`` (the GPU path): one tile shape for
    every call and no split-K, so row invariant by construction."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self._whole(weight, bias, weight.dtype)
        self.device = weight.device
        self.weight = weight.contiguous()

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.bias) if t is not None]

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return gpu_kernels.linear(x, self.weight, self.bias, residual)


class _CLinear(_Linear):
    """A linear layer on one of ``linear_kernels``' C kernels: a layer of them runs in one C call."""

    def kernel_weights(self) -> tuple[torch.Tensor | None, ...]:
        """Its fields of ``cpu_kernels.LinearWeights``."""
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self.kernel_weights() if t is not None]


class _PackedLinear(_CLinear):
    """A bf16 linear layer in ``linear_kernels.packed_linear`` (AVX-512 BF16 or AVX2): faster than oneDNN
    here up to 40 rows, level with it from 128, and row invariant by construction (no K split)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self._whole(weight, bias, weight.dtype)
        self.packed = linear_kernels.pack_linear(weight)

    @staticmethod
    def runs(weight: torch.Tensor) -> bool:
        return weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and linear_kernels.packed_linear_available()

    def row_invariant(self, adds: bool, max_rows: int | None = None) -> bool:
        """The probe runs once per build of the kernels, weight shape and thread count: a shape
        that held is remembered beside the build (cpu_kernels.row_invariant_shapes)."""
        shape = (
            f"packed {self.out_features}x{self.bounds[-1][1]} bias={self.bias is not None} adds={adds} "
            f"rows={max_rows} threads={torch.get_num_threads()}"
        )
        if shape in cpu_kernels.row_invariant_shapes():
            return True
        if not super().row_invariant(adds, max_rows):
            return False
        cpu_kernels.remember_row_invariant(shape)
        return True

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return linear_kernels.packed_linear(x, self.packed, self.out_features, self.bias, residual)

    def kernel_weights(self) -> tuple[torch.Tensor | None, ...]:
        return self.packed, self.bias, None, None


class KernelLinear(nn.Linear):
    """An ``nn.Linear`` whose bf16 inference runs in the packed kernel, or the int8 one: what a
    drafter head's own layers (fc, LM heads, Medusa blocks, ...) become under
    ``kernel_linears``. On the 2-core EPYC here ATen's bf16 matmul took 3-7x the packed kernel's
    time at 1-16 rows (an LM head of 49152 x 576 at 7 rows: 21.8 vs 4.3 ms; int8: 2.0 ms), and
    both kernels are row invariant, so a head's drafts are the same alone or batched. Training
    (gradients wanted) and other dtypes keep ``nn.Linear``'s forward; the weight is packed on
    first use and again after it changes."""

    int8 = False  # weights quantized per output channel, activations per row (drafts, not exact bits)
    _packed: tuple[int, _Linear] | None = None  # (the weight's version, the runtime's linear on it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(x)
        return self.kernel()(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)

    def kernel(self) -> _CLinear:
        """The runtime's linear on this weight (packed on first use and after it changes)."""
        if self._packed is None or self._packed[0] != self.weight._version:
            kernel = _Int8Linear if self.int8 else _PackedLinear
            self._packed = (self.weight._version, kernel(self.weight.detach(), self.bias))
        return self._packed[1]


def kernel_linears(module: nn.Module, int8: bool = False) -> int:
    """Turn ``module``'s bf16 ``nn.Linear`` layers on the CPU into ``KernelLinear`` where the
    packed kernel runs here (AVX-512 BF16 or AVX2 + FMA, an even K); ``int8``: on the int8
    kernel where it runs (AVX-512 VNNI or AVX2, K a multiple of 4). How many it put on the
    kernel asked for."""
    turned = 0
    for m in module.modules():
        if type(m) in (nn.Linear, KernelLinear) and m.weight.device.type == "cpu" and _PackedLinear.runs(m.weight):
            m.__class__ = KernelLinear
            m.int8, m._packed = int8 and _Int8Linear.runs(m.weight), None
            turned += m.int8 if int8 else 1
    return turned


class _Int4Linear(_CLinear):
    """A linear layer quantized to int4 (``linear_kernels.int4_linear``, AVX-512 VNNI or AVX2): weights
    per output channel and 64 positions of K, activations per row as they come. A quarter of
    bf16's bytes: a drafter whose step streams its weights (Qwen2.5-Coder-0.5B: 7.4 against
    int8's 11.4 ms for a token's linear layers here)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self._whole(weight, bias, torch.bfloat16)
        self.weight = linear_kernels.pack_linear_int4(weight)

    @staticmethod
    def runs(weight: torch.Tensor) -> bool:
        return weight.shape[1] % linear_kernels.Q4_GROUP == 0 and linear_kernels.int4_linear_available()

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return linear_kernels.int4_linear(x, self.weight, self.bias, residual)

    def kernel_weights(self) -> tuple[torch.Tensor | None, ...]:
        return self.weight.packed, self.bias, self.weight.scale, None


class _Int8Linear(_CLinear):
    """A linear layer quantized to int8 (``linear_kernels.int8_linear``, AVX-512 VNNI or AVX2): weights per
    output channel, activations per row as they come. For drafters, which need speed, not the
    target's exact bits: half the bytes of bf16 to stream per step."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self._whole(weight, bias, torch.bfloat16)  # bias: bf16, as every weight _Weights hands out for int8
        self.weight = linear_kernels.pack_linear_int8(weight)

    @staticmethod
    def runs(weight: torch.Tensor) -> bool:
        return weight.shape[1] % 4 == 0 and linear_kernels.int8_linear_available()

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return linear_kernels.int8_linear(x, self.weight, self.bias, residual)

    def kernel_weights(self) -> tuple[torch.Tensor | None, ...]:
        return self.weight.packed, self.bias, self.weight.scale, self.weight.wsum


@dataclass
class _Layer:
    attn_norm: torch.Tensor | None  # None: the caller gives the attention its input (drafter heads)
    qkv: _Linear
    qk_norm: torch.Tensor | None  # Qwen3: [heads + kv_heads, head_dim] per-head RMSNorm weights
    o: _Linear
    mlp_norm: torch.Tensor
    gate_up: _Linear
    down: _Linear


def _default_rope(config, device=None, seq_len=None) -> tuple[torch.Tensor, float]:
    # transformers keeps the plain RoPE formula on each model's rotary class, not in ROPE_INIT_FUNCTIONS
    dim = _head_dim(config)
    base = config.rope_parameters["rope_theta"]
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class _Rope:
    """cos and sign-folded sin by position, computed as transformers' rotary embedding does."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        self.config = config
        self.dtype = dtype
        rope = config.rope_parameters
        kind = rope["rope_type"]
        if kind == "default":
            self.init_fn = _default_rope
        else:  # imported here: transformers' rope module costs a server's start ~0.4 s
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            self.init_fn = ROPE_INIT_FUNCTIONS[kind]
        # dynamic / longrope switch frequencies once a sequence is longer than this
        self.limit = {"dynamic": config.max_position_embeddings}.get(kind)
        if kind == "longrope":
            self.limit = rope["original_max_position_embeddings"]
        self.inv_freq, self.scale = self.init_fn(config)
        self.cos, self.sin = self._table(torch.arange(self.limit or config.max_position_embeddings))

    def _table(self, positions: torch.Tensor, inv_freq=None, scale=None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        scale = self.scale if scale is None else scale
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * scale).to(self.dtype)
        sin = (emb.sin() * scale).to(self.dtype)
        # rotate_half(x) * sin == swap_halves(x) * [-sin_lo, sin_hi]
        half = sin.shape[-1] // 2
        sin[:, :half].neg_()
        return cos, sin

    def lookup(self, positions: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[len(positions), head_dim]`` for a row whose sequence is ``seq_len`` long."""
        if self.limit is not None and seq_len > self.limit:
            inv_freq, scale = self.init_fn(self.config, None, seq_len=seq_len)
            return self._table(positions, inv_freq, scale)
        if seq_len > self.cos.shape[0]:  # static frequencies: grow the table
            self.cos, self.sin = self._table(torch.arange(2 * seq_len))
        return self.cos[positions], self.sin[positions]

    def span(self, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``lookup`` of positions ``first`` to ``first + n - 1`` in a sequence that long: views
        of the tables where they hold them (a step's common case, no gather)."""
        end = first + n
        # the table ends at the switch of dynamic / longrope frequencies, and never grows past it
        if end > self.cos.shape[0]:
            return self.lookup(torch.arange(first, end), end)
        return self.cos[first:end], self.sin[first:end]


@dataclass
class _Group:
    """Rows with the same number of new tokens, adjacent in the flat token order: one SDPA call."""

    t0: int  # flat token range
    t1: int
    rows: int
    n: int  # new tokens per row
    fold: bool  # GQA folded into the query axis
    key_len: int  # keys per row (the longest row's; shorter rows are padded and masked)
    mask: torch.Tensor | None  # additive, [rows, 1, queries, key_len]
    causal: bool  # no mask: plain causal attention from position 0 (unfolded only)
    views: list[tuple[torch.Tensor, torch.Tensor]] | None  # per layer (k, v): one contiguous row
    slots: torch.Tensor | None  # otherwise: pool slots to gather, [rows * key_len]


@dataclass
class _Step:
    ids: torch.Tensor  # [T] flat new tokens, rows ordered by n
    positions: torch.Tensor  # [T] their RoPE positions (on the CPU)
    cos: torch.Tensor  # [T, 1, head_dim]
    sin: torch.Tensor
    slots: torch.Tensor  # [T] pool slot of each new token
    groups: list[_Group]  # SDPA calls (empty when batch-invariant)
    keys: cpu_kernels.KeyLists | None  # batch-invariant: each new token's key slots
    spans: list[tuple[int, int]]  # flat token range of each row, in the caller's row order
    scratch: torch.Tensor | None = None  # the fused layers' buffers (LeanDecoder.layer_steps)


class _Weights:
    """Turns a model's modules into the runtime's weights: fused, in ``dtype``, and its linear
    layers on the kernel that runs here (one probe or check per weight shape, shared by every
    layer of that shape)."""

    def __init__(
        self, config, dtype: torch.dtype, batch_invariant: bool, triton_kernels: bool, quantization: str | None = None
    ) -> None:
        self.dtype, self.batch_invariant, self.triton_kernels = dtype, batch_invariant, triton_kernels
        self.quantization = quantization  # None, "int8" or "int4"
        self.int8_fallbacks: set[tuple[int, int]] = set()  # int4 weight shapes the int4 kernel cannot take
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            _head_dim(config),
        )
        self.splits: dict[tuple, int | None] = {}  # oneDNN weight shapes -> their probed K chunk
        self.checked: set[tuple] = set()  # kernel weight shapes whose row invariance was checked

    def cat(self, *tensors: torch.Tensor | None) -> torch.Tensor | None:
        if tensors[0] is None:
            return None
        return torch.cat([t.detach() for t in tensors]).to(self.dtype)

    def regroup(self, t: torch.Tensor | None, dim: int) -> torch.Tensor | None:
        """Query heads from transformers' order (kv head major) to group-major: see _attend."""
        if t is None:
            return None
        shape = (self.kv_heads, self.heads // self.kv_heads, self.head_dim)
        return t.unflatten(dim, shape).transpose(dim, dim + 1).flatten(dim, dim + 2)

    def linear(
        self, weight: torch.Tensor, bias: torch.Tensor | None, adds: bool = True, slab: int = ROW_SLAB
    ) -> _Linear:
        invariant = self.batch_invariant
        if self.quantization == "int4" and _Int4Linear.runs(weight):
            return _Int4Linear(weight, bias)
        if self.quantization:
            if self.quantization == "int4":
                self.int8_fallbacks.add(tuple(weight.shape))
            if not _Int8Linear.runs(weight):
                raise UnsupportedArchitecture(
                    f"int8 linear layers need AVX-512 VNNI or AVX2 and a K divisible by 4 (weight {tuple(weight.shape)})"
                )
            return _Int8Linear(weight, bias)
        if self.triton_kernels or _PackedLinear.runs(weight):
            kernel = (_TritonLinear if self.triton_kernels else _PackedLinear)(weight, bias)
            shape = (tuple(weight.shape), bias is not None, adds)
            # invariant by construction: checked once per shape (not in Triton's interpreter,
            # whose arithmetic is numpy's, not the GPU's, nor on tests' meta tensors)
            interpreted = self.triton_kernels and gpu_kernels.INTERPRETED
            if invariant and shape not in self.checked and not interpreted and weight.device.type != "meta":
                if not kernel.row_invariant(adds, LOGITS_SLAB):
                    raise UnsupportedArchitecture(f"{type(kernel).__name__}'s kernel is not row invariant here")
                self.checked.add(shape)
            return kernel
        if not invariant:
            return _Linear(weight, bias)
        shape = (tuple(weight.shape), bias is not None, adds, slab)
        if shape not in self.splits:
            key = (*shape, weight.dtype, torch.get_num_threads())
            if key not in _PROBED_K_CHUNKS:
                _PROBED_K_CHUNKS[key] = _Linear.invariant(weight, bias, slab, adds).k_chunk
            self.splits[shape] = _PROBED_K_CHUNKS[key]
        return _Linear(weight, bias, self.splits[shape], slab)

    def layer(self, layer, input_norm: bool = True) -> _Layer:
        """A transformers-style decoder layer (``self_attn.{q,k,v,o}_proj``, ``mlp.*_proj``,
        ``input_layernorm``, ``post_attention_layernorm``). ``input_norm=False``: the caller
        gives the attention its input (drafter heads, whose ``input_layernorm``, where they have
        one, is theirs to apply)."""
        a, mlp, w, regroup = layer.self_attn, layer.mlp, self.cat, self.regroup
        qk_norm = None
        if hasattr(a, "q_norm"):
            qk_norm = w(a.q_norm.weight.expand(self.heads, -1), a.k_norm.weight.expand(self.kv_heads, -1))
        return _Layer(
            attn_norm=w(layer.input_layernorm.weight) if input_norm else None,
            qkv=self.linear(
                w(regroup(a.q_proj.weight, 0), a.k_proj.weight, a.v_proj.weight),
                w(regroup(a.q_proj.bias, 0), a.k_proj.bias, a.v_proj.bias),
            ),
            qk_norm=qk_norm,
            o=self.linear(w(regroup(a.o_proj.weight, 1)), w(a.o_proj.bias)),
            mlp_norm=w(layer.post_attention_layernorm.weight),
            gate_up=self.linear(w(mlp.gate_proj.weight, mlp.up_proj.weight), w(mlp.gate_proj.bias, mlp.up_proj.bias)),
            down=self.linear(w(mlp.down_proj.weight), w(mlp.down_proj.bias)),
        )

    def log_kernels(self, device: torch.device) -> None:
        if self.triton_kernels:
            log.info("lean runtime on %s: the OpenAI Triton kernels (batch-invariant)", device)
        elif self.quantization == "int8":
            log.info("linear layers: the int8 kernel (weights per channel, activations per row)")
        elif self.quantization == "int4":
            log.info(
                "linear layers: the int4 kernel (weights per channel and %d positions of K, activations per row)%s",
                linear_kernels.Q4_GROUP,
                f"; int8 for weights whose K it cannot take: {sorted(self.int8_fallbacks)}"
                if self.int8_fallbacks
                else "",
            )
        elif self.checked:
            log.info("linear layers: the packed bf16 kernel (row invariant by construction)")
        if self.splits:
            log.info("batch-invariant matmuls (weight shape -> K chunk): %s", {k[0]: v for k, v in self.splits.items()})


def _kernels_for(config, device: torch.device, batch_invariant: bool, triton_kernels: bool | None) -> bool:
    """Whether the OpenAI Triton kernels run (else the CPU's); raises UnsupportedArchitecture
    where the lean runtime cannot run ``config`` on ``device`` as asked."""
    reason = unsupported_reason(config)
    if reason is not None:
        raise UnsupportedArchitecture(f"lean runtime cannot run this model: {reason}")
    on_cpu = device.type == "cpu"
    triton_kernels = not on_cpu if triton_kernels is None else triton_kernels
    if triton_kernels and not batch_invariant:
        raise UnsupportedArchitecture(
            f"on {device} the lean runtime runs batch-invariant only (its OpenAI Triton kernels)"
        )
    if not triton_kernels and (not on_cpu or not torch.backends.mkldnn.is_available()):
        raise UnsupportedArchitecture("lean runtime cannot run this model: its CPU path needs oneDNN")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if batch_invariant and not triton_kernels:
        if (reason := cpu_kernels.unavailable_reason(_head_dim(config), heads, kv_heads)) is not None:
            raise UnsupportedArchitecture(f"batch-invariant attention is unavailable: {reason}")
    return triton_kernels


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat, without the copy for one tensor (a step's common case: one row)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _check_rows(pool: KVCachePool, rows: Sequence[Row], toks: list[torch.Tensor], counts: list[int]) -> None:
    """Each sequence once a step, with new tokens, at most that many logits rows, a mask and
    positions that fit them, and room in its reservation."""
    seen = set()
    for r, t, m in zip(rows, toks, counts):
        n = t.shape[0]
        if r.seq_id in seen:
            raise SequenceError(f"sequence {r.seq_id!r} appears twice in one step")
        seen.add(r.seq_id)
        if n == 0 or not 0 <= m <= n:
            raise SequenceError(f"sequence {r.seq_id!r}: {n} new tokens, {m} logits rows asked")
        _check_mask(r, n, pool.length(r.seq_id))
        if r.positions is not None and tuple(r.positions.shape) != (n,):
            raise SequenceError(f"sequence {r.seq_id!r}: positions {tuple(r.positions.shape)} for {n} new tokens")
        if n > pool.room(r.seq_id):
            raise SequenceError(
                f"sequence {r.seq_id!r}: {pool.length(r.seq_id)} cached + {n} new tokens exceed its "
                f"reservation of {pool.reserved(r.seq_id)}; admit it with a larger reserve_tokens"
            )


def _check_mask(row: Row, n: int, cached: int) -> None:
    if row.mask is not None and tuple(row.mask.shape) not in ((n, n), (n, cached + n)):
        raise SequenceError(
            f"sequence {row.seq_id!r}: mask {tuple(row.mask.shape)} for {n} new tokens after {cached} cached"
        )


def _fusable(layer: _Layer) -> bool:
    """Can ``run_layers`` take it? A layer without an input norm (a drafter head's, whose caller
    gives the attention its input) runs there with its ``attn_in``."""
    linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
    return layer.qk_norm is None and all(isinstance(x, _CLinear) for x in linears)


class LeanDecoder:
    """Decoder layers over a paged KV pool: what a causal LM's step and a drafter head's step
    share. ``plan`` checks a ragged batch of rows and writes their place in the pool; ``layer``
    runs one decoder layer of that step. Build with ``from_layers`` (heads) or use
    ``LeanCausalLM``."""

    def __init__(
        self,
        config,
        layers: list[_Layer],
        dtype: torch.dtype,
        batch_invariant: bool = False,
        triton_kernels: bool = False,
        device: torch.device | None = None,
    ) -> None:
        self.config = config
        self.layers = layers
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        self.triton_kernels = triton_kernels
        self.device = device or torch.device("cpu")
        self.num_layers = len(layers)
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        self.eps = config.rms_norm_eps
        self.rope = _Rope(config, dtype)
        # bf16: a layer's norms, RoPE + KV write and SiLU * up in the C kernels, one call each
        # with the bf16 tensor ops' rounding (RMSNorm's transformers' bit for bit, which
        # F.rms_norm is not). float32 keeps the tensor ops, whose sums match transformers
        # exactly (the norm kernel's other order drifted logits 1.2e-4 over 30 layers).
        self.fused = (
            not triton_kernels
            and dtype == torch.bfloat16
            and cpu_kernels.layer_kernels_available(self.hidden_size, config.intermediate_size, self.head_dim)
        )
        # Where every part of a layer has its C kernel (bf16, packed, int8 or int4 linears, key-list
        # attention, no q/k norms), a layer is one C call: the same kernels in the same order.
        self.sizes = (self.hidden_size, config.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim)
        self.layer_steps = None
        if self.fused and batch_invariant and all(_fusable(layer) for layer in layers):
            self.layer_steps = cpu_kernels.LayerSteps(
                [
                    (
                        (layer.attn_norm, layer.mlp_norm),
                        [lin.kernel_weights() for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)],
                    )
                    for layer in layers
                ]
            )

    def tensors(self) -> list[torch.Tensor]:
        """Every weight tensor it holds (its KV lives in the pools it makes)."""
        held = []
        for layer in self.layers:
            held += [t for t in (layer.attn_norm, layer.qk_norm, layer.mlp_norm) if t is not None]
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
                held += linear.tensors()
        return held

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in {id(t): t for t in self.tensors()}.values())

    @classmethod
    def from_layers(cls, config, modules: Sequence, dtype: torch.dtype, *, input_norm: bool = False) -> LeanDecoder:
        """A drafter head's decoder layers ``modules`` (transformers-style, see ``_Weights.layer``;
        their attention may read a wider input than the residual, as EAGLE-3's) of a model
        described by the Llama-style ``config``, on the modules' device: batch-invariant where
        its kernels build (bit-identical drafts alone or batched; the only path on a GPU), else
        the SDPA path. Without ``input_norm`` the caller gives every layer its attention input
        (``layer(..., attn_in=...)``)."""
        device = next(modules[0].parameters()).device

        def build(batch_invariant: bool) -> LeanDecoder:
            triton_kernels = _kernels_for(config, device, batch_invariant, None)
            weights = _Weights(config, dtype, batch_invariant, triton_kernels)
            layers = [weights.layer(m, input_norm=input_norm) for m in modules]
            weights.log_kernels(device)
            return cls(config, layers, dtype, batch_invariant, triton_kernels, device)

        try:
            return build(batch_invariant=True)
        except UnsupportedArchitecture as e:
            if device.type != "cpu":
                raise
            log.info("drafter head: batch-invariant kernels unavailable (%s); drafting on the SDPA path", e)
            return build(batch_invariant=False)

    def new_pool(
        self,
        *,
        capacity_tokens: int | None = None,
        memory_gb: float | None = None,
        block_size: int = BLOCK_SIZE,
        prefix_caching: bool = False,
    ) -> KVCachePool:
        """A KV pool shaped for this model (one per model instance); ``prefix_caching``: its
        sequences share the blocks of prompts that start alike (kv_cache.py)."""
        return KVCachePool(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            capacity_tokens=capacity_tokens,
            memory_gb=memory_gb,
            block_size=block_size,
            dtype=self.dtype,
            device=self.device,
            prefix_caching=prefix_caching,
        )

    # -- one step -----------------------------------------------------------------------------

    def plan(self, pool: KVCachePool, rows: Sequence[Row], counts: list[int] | None = None) -> _Step:
        """Check the rows, order them by new-token count, grow their lengths, build the groups.
        ``counts``: the logits rows each row asks for (checked against its new tokens)."""
        if not rows:
            raise SequenceError("a step needs at least one row")
        counts = [0] * len(rows) if counts is None else counts
        if len(counts) != len(rows):
            raise ValueError(f"logits_rows has {len(counts)} entries for {len(rows)} rows")
        toks = [torch.as_tensor(r.token_ids, dtype=torch.long).reshape(-1) for r in rows]
        _check_rows(pool, rows, toks, counts)
        order = sorted(range(len(rows)), key=lambda i: toks[i].shape[0])
        cached = {i: pool.extend(rows[i].seq_id, toks[i].shape[0]) for i in order}
        spans: list[tuple[int, int]] = [(0, 0)] * len(rows)
        positions, cos, sin, slots = [], [], [], []
        t = 0
        for i in order:
            r, n, c = rows[i], toks[i].shape[0], cached[i]
            if r.positions is None:
                row_positions = torch.arange(c, c + n)
                row_cos, row_sin = self.rope.span(c, n)
            else:
                row_positions = r.positions.long()
                row_cos, row_sin = self.rope.lookup(row_positions, max(c + n, int(row_positions.max()) + 1))
            positions.append(row_positions)
            cos.append(row_cos)
            sin.append(row_sin)
            slots.append(pool.slots(r.seq_id)[c : c + n])
            spans[i] = (t, t + n)
            t += n

        groups, keys = self._attention(pool, rows, toks, cached, order, spans)
        cat = lambda ts: _joined(ts).to(self.device)
        scratch = None
        if self.layer_steps is not None:
            scratch = torch.empty(cpu_kernels.layer_scratch(t, self.sizes), dtype=self.dtype)
        return _Step(
            ids=cat([toks[i] for i in order]),
            positions=_joined(positions),
            cos=cat(cos).unsqueeze(1),
            sin=cat(sin).unsqueeze(1),
            slots=cat(slots),
            groups=groups,
            keys=keys,
            spans=spans,
            scratch=scratch,
        )

    def remask(self, pool: KVCachePool, step: _Step, rows: Sequence[Row]) -> _Step:
        """``step``, planned for these rows' sequences and tokens, attending as ``rows``' masks
        say instead of the planned rows' (same checks as ``plan``'s): for drafters whose layers
        see differently, as DFlash's sliding-window layers."""
        toks = [torch.as_tensor(r.token_ids, dtype=torch.long).reshape(-1) for r in rows]
        order = sorted(range(len(rows)), key=lambda i: toks[i].shape[0])
        cached = {i: pool.length(r.seq_id) - t.shape[0] for i, (r, t) in enumerate(zip(rows, toks))}
        for r, t, c in zip(rows, toks, cached.values()):
            _check_mask(r, t.shape[0], c)
        if [step.spans[i][1] - step.spans[i][0] for i in range(len(rows))] != [t.shape[0] for t in toks]:
            raise SequenceError("remask takes the rows the step was planned for")
        groups, keys = self._attention(pool, rows, toks, cached, order, step.spans)
        return replace(step, groups=groups, keys=keys)

    def _attention(
        self,
        pool: KVCachePool,
        rows: Sequence[Row],
        toks: list[torch.Tensor],
        cached: dict[int, int],
        order: list[int],
        spans: list[tuple[int, int]],
    ) -> tuple[list[_Group], cpu_kernels.KeyLists | None]:
        """What the step's attention reads: each token's key list (batch-invariant), or one SDPA
        group per run of rows (in ``order``) with the same number of new tokens."""
        if self.batch_invariant:
            keys = self._key_lists(
                pool, [rows[i] for i in order], [cached[i] for i in order], share_trees=not self.triton_kernels
            )
            return [], keys.to(self.device)
        groups, start = [], 0
        while start < len(order):
            end = start + 1
            while end < len(order) and toks[order[end]].shape[0] == toks[order[start]].shape[0]:
                end += 1
            members = order[start:end]
            groups.append(
                self._group(
                    pool,
                    [rows[i] for i in members],
                    [cached[i] for i in members],
                    spans[members[0]][0],
                    toks[members[0]].shape[0],
                )
            )
            start = end
        return groups, None

    @staticmethod
    def _key_lists(
        pool: KVCachePool, rows: list[Row], cached: list[int], share_trees: bool = True
    ) -> cpu_kernels.KeyLists:
        """Each new token's keys, rows in flat order: the cached tokens, then the new tokens its
        row's mask allows (causal: itself and those before it).

        With ``share_trees`` (the CPU kernel), a tree's nodes (a mask that sees no later new
        token) share one list as a chain's tokens do, each hiding the other branches by a key
        mask, so the cached keys are read once for all nodes (at 1000 cached keys, 13 nodes:
        1.4x faster); so do a drafter's tree level's nodes, which also hide cached nodes of
        earlier levels. Only where the keys a mask hides all fall in the chunk (KEY_CHUNK) of
        the row's last key: a node's chunks are then those of its own list, so its bits are too."""
        slots, starts, lengths, offset, token = [], [], [], 0, 0
        hides: dict[int, tuple[int, torch.Tensor]] = {}  # a tree's first token -> (mask_from, mask)
        for r, c in zip(rows, cached):
            n = len(r.token_ids)
            table = pool.slots(r.seq_id)[: c + n]
            seen = None if r.mask is None else r.mask.bool()
            full = seen is not None and seen.shape[1] == c + n  # the mask covers the cached tokens too
            shared = False
            if seen is not None and share_trees:
                start = c  # the first key any node may hide: a cached one, or else the first new one
                if full:
                    hidden = (~seen[:, :c]).any(0).nonzero()
                    start = int(hidden[0]) if len(hidden) else c
                shared = start // cpu_kernels.KEY_CHUNK == (c + n - 1) // cpu_kernels.KEY_CHUNK and not (
                    seen[:, -n:].triu(1).any()
                )
            if seen is None or shared:  # all the row's tokens share one list, each a longer prefix
                if shared:
                    hides[token] = (start, seen[:, start:] if full else seen)
                token += n
                slots.append(table)
                starts.append(torch.full((n,), offset))
                lengths.append(torch.arange(c + 1, c + n + 1))
                offset += c + n
                continue
            for allowed in seen:
                own = table[allowed] if full else torch.cat([table[:c], table[c:][allowed]])
                slots.append(own)
                starts.append(torch.tensor([offset]))
                lengths.append(torch.tensor([own.shape[0]]))
                offset += own.shape[0]
            token += n
        length = _joined(lengths)
        if not hides:
            return cpu_kernels.KeyLists(_joined(slots), _joined(starts), length)
        mask_from = length.clone()  # nothing hidden
        mask = torch.zeros(length.shape[0], max(m.shape[1] for _, m in hides.values()), dtype=torch.bool)
        for t, (start, m) in hides.items():
            mask_from[t : t + m.shape[0]] = start
            mask[t : t + m.shape[0], : m.shape[1]] = m
        return cpu_kernels.KeyLists(_joined(slots), _joined(starts), length, mask_from, mask)

    def _group(self, pool: KVCachePool, rows: list[Row], cached: list[int], t0: int, n: int) -> _Group:
        lengths = [c + n for c in cached]
        key_len = max(lengths)
        start = pool.contiguous_start(rows[0].seq_id) if len(rows) == 1 else None
        views = slots = None
        if start is not None:
            # every layer's (k, v) view of this row, made by a few ops for the whole step
            kv = pool.kv[:, start : start + key_len].permute(2, 0, 3, 1, 4).unsqueeze(2)
            views = list(zip(kv[0].unbind(0), kv[1].unbind(0)))  # [1, kv_heads, key_len, head_dim]
        else:
            # pad shorter rows by repeating their last slot; the mask hides the padding
            slots = torch.cat(
                [pool.slots(r.seq_id)[torch.arange(key_len).clamp_(max=L - 1)] for r, L in zip(rows, lengths)]
            )
        fold = n <= FOLD_MAX_TOKENS
        custom = any(r.mask is not None for r in rows)
        causal = not fold and not custom and all(c == 0 for c in cached)
        mask = None
        if not causal and (n > 1 or custom or any(L != key_len for L in lengths)):
            mask = torch.full((len(rows), 1, n, key_len), float("-inf"), dtype=self.dtype)
            for m, r, c in zip(mask, rows, cached):
                if r.mask is not None and r.mask.shape[1] == c + n:  # the mask covers the cached tokens too
                    m[0, :, : c + n].masked_fill_(r.mask.bool(), 0)
                    continue
                m[0, :, :c] = 0
                allowed = torch.ones(n, n, dtype=torch.bool).tril_() if r.mask is None else r.mask.bool()
                m[0, :, c : c + n].masked_fill_(allowed, 0)
            if fold:
                mask = mask.repeat_interleave(self.num_heads // self.num_kv_heads, dim=2)
        return _Group(t0, t0 + len(rows) * n, len(rows), n, fold, key_len, mask, causal and n > 1, views, slots)

    def layer(
        self, index: int, h: torch.Tensor, pool: KVCachePool, step: _Step, attn_in: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Decoder layer ``index`` of ``step`` on the residual stream ``h`` ``[T, hidden]``. Its
        attention reads the normed ``h``, or ``attn_in`` where the caller gives one (drafter
        heads: EAGLE-3's [embedding | hidden] input, a first layer without input norm). A layer
        run in one C call (``layer_steps``) updates ``h`` in place and returns it."""
        layer, kv_layer = self.layers[index], pool.layers[index]
        if step.scratch is not None:  # the whole layer in one C call, in place
            if attn_in is not None and attn_in.shape[-1] != layer.qkv.bounds[-1][1]:
                raise ValueError(
                    f"layer {index}'s attention reads {layer.qkv.bounds[-1][1]} features, got {attn_in.shape[-1]}"
                )
            return self.run_layers(index, index + 1, h, pool, step, attn_in)
        if attn_in is None:
            attn_in = self._norm(h, layer.attn_norm)
        q = self._store_kv(layer, attn_in, kv_layer, step)
        if self.triton_kernels:
            keys = step.keys
            attended = gpu_kernels.attend(q, kv_layer, keys.slots, keys.start, keys.length, self.num_heads)
        elif step.keys is not None:
            attended = cpu_kernels.attend(q, kv_layer, step.keys, self.num_heads)
        else:
            outs = [self._attend(q[g.t0 : g.t1], g, index, kv_layer) for g in step.groups]
            attended = outs[0] if len(outs) == 1 else torch.cat(outs)
        h = layer.o.add(attended, h)
        x = self._norm(h, layer.mlp_norm)
        gate_up = layer.gate_up(x)
        if self.fused:
            return layer.down.add(cpu_kernels.silu_mul(gate_up), h)
        inter = gate_up.shape[1] // 2
        return layer.down.add(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], h)

    def run_layers(
        self, first: int, end: int, h: torch.Tensor, pool: KVCachePool, step: _Step, attn_in: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Layers ``first`` to ``end`` - 1 of a step planned with ``layer_steps`` in one C call,
        updating ``h`` in place (returned); ``attn_in``: one layer's attention input (``layer``)."""
        cpu_kernels.run_layers(
            self.layer_steps,
            first,
            end,
            h,
            self.sizes,
            self.eps,
            pool.kv,
            step.slots,
            step.cos,
            step.sin,
            step.keys,
            step.scratch,
            None if attn_in is None else attn_in.contiguous(),
        )
        return h

    def store_kv(self, index: int, x: torch.Tensor, pool: KVCachePool, step: _Step) -> None:
        """Write layer ``index``'s keys and values of ``x`` ``[T, hidden]`` (its attention input as
        is: no input norm) to the step's slots, and nothing else of the layer: cache entries
        made from something other than the layer's own stream (DFlash's context features)."""
        self._store_kv(self.layers[index], x, pool.layers[index], step)

    def _store_kv(self, layer: _Layer, x: torch.Tensor, kv_layer: torch.Tensor, step: _Step) -> torch.Tensor:
        """Project ``x``, norm q and k (Qwen3), rotate them, store k and v; the queries."""
        T = x.shape[0]
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = layer.qkv(x)
        qk = qkv[:, : (heads + kv_heads) * d].view(T, heads + kv_heads, d)
        if layer.qk_norm is not None and self.triton_kernels:
            qk.copy_(gpu_kernels.rms_norm(qk.reshape(-1, d), layer.qk_norm, self.eps).view_as(qk))
        elif layer.qk_norm is not None:
            torch.mul(F.rms_norm(qk, (d,), None, self.eps), layer.qk_norm, out=qk)
        if self.fused:
            cpu_kernels.rope_store(qkv, step.cos[:, 0], step.sin[:, 0], kv_layer, step.slots, heads)
        else:
            swapped = qk.view(T, heads + kv_heads, 2, d // 2).flip(2).view(T, heads + kv_heads, d)
            qk.mul_(step.cos).addcmul_(swapped, step.sin)
            kv_layer.index_copy_(0, step.slots, qkv[:, heads * d :].view(T, 2, kv_heads, d))
        return qkv[:, : heads * d]

    def _norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.triton_kernels:
            return gpu_kernels.rms_norm(h, weight, self.eps)
        if self.fused:
            return cpu_kernels.rms_norm(h, weight, self.eps)
        return F.rms_norm(h, (self.hidden_size,), weight, self.eps)

    def _attend(self, q: torch.Tensor, g: _Group, index: int, kv_layer: torch.Tensor) -> torch.Tensor:
        """Attention of one group: q ``[rows * n, heads * head_dim]`` -> same shape.

        Query heads are stored group-major (head j * kv_heads + kv uses kv head kv), so folding the
        query heads that share a kv head into extra query rows is a view for one new token (a
        small copy for more), and unfolding the output is a view.
        """
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        if g.views is not None:
            k, v = g.views[index]
        else:
            gathered = kv_layer.index_select(0, g.slots).view(g.rows, g.key_len, 2, kv_heads, d)
            k, v = gathered.permute(2, 0, 3, 1, 4).unbind(0)
        if g.fold:
            q = q.reshape(g.rows, g.n * (heads // kv_heads), kv_heads, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask)
            return o.transpose(1, 2).reshape(g.rows * g.n, heads * d)
        # long blocks of new tokens: SDPA's own GQA, heads back in transformers' order
        group = heads // kv_heads
        q = q.view(g.rows * g.n, group, kv_heads, d).transpose(1, 2).reshape(g.rows, g.n, heads, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, is_causal=g.causal, enable_gqa=True)
        o = o.transpose(1, 2).reshape(g.rows * g.n, kv_heads, group, d).transpose(1, 2)
        return o.reshape(g.rows * g.n, heads * d)


def checkpoint_modules(path: Path, config, dtype: torch.dtype, device: torch.device | str = "cpu") -> SimpleNamespace:
    """A causal LM's safetensors directory as the attributes ``LeanCausalLM.from_hf`` reads of a
    transformers model (``model.layers[i].self_attn.q_proj.weight``, ``lm_head``, ``config``,
    ...), the same tensors transformers would load, without building its model: importing and
    loading that took about 2 of a SmolLM2 server's 9-13 s to start, and held a second copy of
    the weights. Raises UnsupportedArchitecture for a model the runtime does not run or a
    checkpoint not in transformers' names (the caller loads it through transformers then)."""
    reason = unsupported_reason(config)
    if reason is not None:
        raise UnsupportedArchitecture(f"lean runtime cannot run this model: {reason}")
    num_layers = config.num_hidden_layers

    def keep(name: str) -> bool:  # not a checkpoint's extra layers (MTP modules) or other towers
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            return len(parts) > 2 and parts[2].isdigit() and int(parts[2]) < num_layers
        return parts[0] in ("model", "lm_head")

    files = _safetensors_files(Path(path))
    state = read_safetensors(files, keep, dtype, device)
    layer_names = [
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    wanted = ["model.embed_tokens.weight", "model.norm.weight"]
    wanted += [f"model.layers.{i}.{name}" for i in range(num_layers) for name in layer_names]
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [name for name in wanted + ([] if tied else ["lm_head.weight"]) if name not in state]
    if not files or missing:
        raise UnsupportedArchitecture(
            f"{path}: not a safetensors checkpoint in transformers' names (missing {', '.join(missing[:3]) or 'files'})"
        )
    modules = _as_modules(state)
    if tied:
        modules.lm_head = SimpleNamespace(weight=modules.model.embed_tokens.weight, bias=None)
    return SimpleNamespace(
        config=config, device=torch.device(device), dtype=dtype, model=modules.model, lm_head=modules.lm_head
    )


def read_checkpoint(path: Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> SimpleNamespace | None:
    """``checkpoint_modules`` of a model directory the lean runtime runs, or None where
    transformers is to load the model: a GGUF file, another architecture, a checkpoint not in
    transformers' names (said in the log)."""
    if not path.is_dir():
        return None
    config = model_config(path)
    if unsupported_reason(config) is not None:
        return None
    try:
        return checkpoint_modules(path, config, dtype, device)
    except UnsupportedArchitecture as e:
        log.info("%s loads through transformers: %s", path, e)
        return None


def _safetensors_files(path: Path) -> list[Path]:
    """The files transformers loads a model from: those its index names, else model.safetensors
    (other safetensors beside them, a drafter head's say, are not the model's)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [path / "model.safetensors"] if (path / "model.safetensors").exists() else []


def _as_modules(state: dict[str, torch.Tensor]) -> SimpleNamespace:
    """Dotted names as attributes; numbered parts become lists, and a module with a weight and
    no bias has bias None (as transformers' ``nn.Linear``)."""
    tree: dict = {}
    for name, tensor in state.items():
        *parts, leaf = name.split(".")
        node = tree
        for part in parts:
            node = node.setdefault(part, {})
        node[leaf] = tensor

    def build(node):
        if not isinstance(node, dict):
            return node
        if all(key.isdigit() for key in node):
            return [build(node[key]) for key in sorted(node, key=int)]
        module = SimpleNamespace(**{key: build(value) for key, value in node.items()})
        if "weight" in node and "bias" not in node:
            module.bias = None
        return module

    return build(tree)


class LeanCausalLM(LeanDecoder):
    """A decoder-only LM run over a paged KV pool. Build with ``from_hf``."""

    def __init__(
        self,
        config,
        embed: torch.Tensor,
        layers: list[_Layer],
        norm: torch.Tensor,
        lm_head: _Linear,
        dtype: torch.dtype,
        batch_invariant: bool = False,
        triton_kernels: bool = False,
    ) -> None:
        super().__init__(config, layers, dtype, batch_invariant, triton_kernels, embed.device)
        self.embed = embed
        self.norm = norm
        self.lm_head = lm_head
        self.vocab_size = embed.shape[0]
        # Every step the same bits on any number of threads: the layers, the final norm and the
        # head in the C kernels, each thread computing whole rows or outputs (threads.governed).
        self.thread_invariant = self.layer_steps is not None and isinstance(lm_head, _CLinear)

    def tensors(self) -> list[torch.Tensor]:
        return [self.embed, *super().tensors(), self.norm, *self.lm_head.tensors()]

    @classmethod
    def from_hf(
        cls,
        hf_model,
        dtype: torch.dtype | None = None,
        batch_invariant: bool = False,
        triton_kernels: bool | None = None,
        quantization: str | None = None,
    ) -> LeanCausalLM:
        """Take the weights of a loaded transformers ``*ForCausalLM``, or of ``checkpoint_modules``
        (fused and prepacked copies; the embedding is shared), on the model's device. Raises UnsupportedArchitecture for
        models it does not run.

        ``quantization="int8"``: the linear layers (the LM head too) in int8 (``_Int8Linear``),
        the rest in bf16; for drafters on a CPU with AVX-512 VNNI or AVX2. ``"int4"``: in int4
        (``_Int4Linear``) where K is a multiple of 64, else int8.

        ``batch_invariant``: every token's logits and hidden states are the same bits whatever
        else shares its step (other tokens of its row, other rows, a prompt chunked or not); the
        matmul splits are probed once per weight shape in a process (about a second for SmolLM2).
        ``triton_kernels``: run the OpenAI Triton kernels (``kernels/batch_invariant.py``)
        instead of the CPU's; the default on a GPU, where only that batch-invariant path runs.
        On a CPU they run in Triton's interpreter: for tests."""
        config = hf_model.config
        triton_kernels = _kernels_for(config, hf_model.device, batch_invariant, triton_kernels)
        if quantization not in (None, "int8", "int4"):
            raise ValueError(f"the lean runtime quantizes to int8 or int4, not {quantization!r}")
        if quantization and triton_kernels:
            raise UnsupportedArchitecture(f"{quantization} linear layers run on the CPU kernels only")
        weights = _Weights(
            config,
            torch.bfloat16 if quantization else dtype or hf_model.dtype,
            batch_invariant,
            triton_kernels,
            quantization,
        )
        layers = [weights.layer(layer) for layer in hf_model.model.layers]
        embed = hf_model.model.embed_tokens.weight.detach().to(weights.dtype)
        w = weights.cat
        head = weights.linear(w(hf_model.lm_head.weight), w(hf_model.lm_head.bias), adds=False, slab=LOGITS_SLAB)
        weights.log_kernels(hf_model.device)
        return cls(
            config, embed, layers, w(hf_model.model.norm.weight), head, weights.dtype, batch_invariant, triton_kernels
        )

    @torch.inference_mode()
    def forward(
        self,
        pool: KVCachePool,
        rows: Sequence[Row],
        logits_rows: int | Sequence[int] = 1,
        hidden_layers: Sequence[int] = (),
    ) -> StepOutput:
        """Run one ragged step; each row's cached length in ``pool`` grows by its new tokens.

        ``logits_rows``: logits for the last m new tokens of each row (one int for all rows, or
        one per row; 0 = none). ``hidden_layers``: layer ids to return hidden states of (vLLM's
        numbering, -1 = final normed).
        """
        counts = [logits_rows] * len(rows) if isinstance(logits_rows, int) else list(logits_rows)
        want = {self.num_layers if i == -1 else i for i in hidden_layers}
        if not all(0 <= i <= self.num_layers for i in want):
            raise ValueError(f"hidden layer ids must be in [-1, {self.num_layers}], got {list(hidden_layers)}")
        step = self.plan(pool, rows, counts)
        saved = {}
        with governed(self.thread_invariant):  # its threads fewer while a core is busy elsewhere
            h = F.embedding(step.ids, self.embed)
            if step.scratch is not None:  # the layers in C, in place: one call per run between saved states
                cuts = sorted({0, self.num_layers} | want)
                for first, end in zip(cuts, cuts[1:]):
                    if first in want:
                        saved[first] = h.clone()
                    self.run_layers(first, end, h, pool, step)
            else:
                for i in range(self.num_layers):
                    if i in want:
                        saved[i] = h
                    h = self.layer(i, h, pool, step)
            logits = self._logits(h, step, counts, saved, self.num_layers in want)
        hidden = [{i: saved[self.num_layers if i == -1 else i][a:b] for i in hidden_layers} for a, b in step.spans]
        return StepOutput(logits, hidden)

    __call__ = forward

    def _logits(
        self, h: torch.Tensor, step: _Step, counts: list[int], saved: dict, keep_final: bool
    ) -> list[torch.Tensor]:
        if keep_final:
            saved[self.num_layers] = self._norm(h, self.norm)
        if sum(counts) == 0:
            return [h.new_empty(0, self.vocab_size) for _ in counts]
        if len(counts) == 1:
            picked = slice(h.shape[0] - counts[0], h.shape[0])
        else:
            picked = torch.cat([torch.arange(b - m, b) for (_, b), m in zip(step.spans, counts)]).to(h.device)
        if keep_final:
            x = saved[self.num_layers][picked]
        else:
            x = self._norm(h[picked], self.norm)
        return list(self.lm_head(x).split(counts))
