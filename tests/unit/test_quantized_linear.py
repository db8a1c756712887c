"""The int8 and int4 linear kernels (a quantized drafter's linear layers on the lean runtime):
the quantized arithmetic each promises, checked against the same quantization done in torch;
each row the same alone as among others; the same bits from the AVX-512 VNNI and the AVX2
builds; and a whole quantized model that stays close to its bf16 self and batches without
changing a bit."""

from __future__ import annotations

import pytest
import torch

from backends.runtime import cpu_kernels, linear_kernels
from backends.runtime.lean_lm import LeanCausalLM, _Int4Linear, _Int8Linear
from tests.fixtures.lean_models import FAMILIES, assert_same, build, decode, tokens
from tests.unit.test_batch_invariance import _with_kernel_flags, needs_avx2

# Both kernels are built where the CPU has AVX-512 VNNI or AVX2 + FMA.
pytestmark = pytest.mark.skipif(
    not linear_kernels.int8_linear_available(),
    reason="this CPU has neither AVX-512 VNNI nor AVX2 (the int8 and int4 linear kernels)",
)


def quantized_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x per row as the kernels quantize it (symmetric, to [-127, 127]): the integers, the scales."""
    xf = x.double()
    x_scale = (xf.abs().amax(dim=1) / 127).float().double()
    return torch.round((xf.float() * (1 / x_scale.float())[:, None]).double()), x_scale


def quantized_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T as the int8 kernel computes it: W symmetric per output, x per row (the kernel's
    zero point of 128 cancels), in float64 from the integers."""
    w = weight.float()
    w_scale = w.abs().amax(dim=1) / 127
    q = torch.round(w / w_scale[:, None]).clamp(-127, 127).double()  # divided in float32, as the packing does
    xq, x_scale = quantized_x(x)
    return (xq @ q.T) * x_scale[:, None] * w_scale[None, :].double()


def int4_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T as the int4 kernel computes it: W symmetric per output and 64 positions of K, to
    [-7, 7], x per row, in float64 from the integers."""
    n, k = weight.shape
    w = weight.float().view(n, k // 64, 64)
    w_scale = w.abs().amax(dim=2, keepdim=True) / 7
    q = torch.round(w / w_scale).clamp(-7, 7).double()  # divided in float32, as the packing does
    xq, x_scale = quantized_x(x)
    groups = torch.einsum("mcg,ncg->mnc", xq.view(-1, k // 64, 64), q)  # exact integer sums per group
    return (groups * w_scale[:, :, 0].double()).sum(dim=2) * x_scale[:, None]


# per kernel: its packing, its call, its arithmetic in torch, a K (int8: not a multiple of 16, the
# quantizer's masked tail; int4: five groups of 64 positions, each with its own scale) and how
# near the unquantized matmul it stays, as a share of the largest output
KERNELS = {
    "int8": (linear_kernels.pack_linear_int8, linear_kernels.int8_linear, quantized_reference, 584, 0.05),
    "int4": (linear_kernels.pack_linear_int4, linear_kernels.int4_linear, int4_reference, 320, 0.2),
}


@pytest.mark.parametrize("kind", sorted(KERNELS))
@pytest.mark.parametrize("n", [64, 200, 3])  # whole groups of 64 outputs, a partial last group, less than one
def test_the_quantized_linear_is_its_arithmetic_and_row_invariant(kind, n):
    pack, linear, reference, k, near = KERNELS[kind]
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    weight[:, 64:128] *= 8  # larger weights in one group: int4's per-group scales keep the others'
    bias = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(13, k + 8, generator=gen).bfloat16()[:, :k]  # strided rows
    residual = torch.randn(13, n, generator=gen).bfloat16()
    packed = pack(weight)
    out = linear(x, packed, bias, residual)
    want = reference(x, weight) + bias.double() + residual.double()
    torch.testing.assert_close(out.double(), want, rtol=8e-3, atol=1e-2)  # bf16 rounding of the output
    exact = x.double() @ weight.double().T + bias.double() + residual.double()
    assert (out.double() - exact).abs().max() < near * exact.abs().max()  # and near the unquantized matmul
    for i in (0, 5, 12):  # alone == among 13 rows (tiles of 6 or 4: whole and partial)
        alone = linear(x[i : i + 1].clone(), packed, bias, residual[i : i + 1])
        assert torch.equal(alone[0], out[i])
    zero = linear(torch.zeros(2, k, dtype=torch.bfloat16), packed)
    assert torch.equal(zero, torch.zeros(2, n, dtype=torch.bfloat16))  # an all-zero row's scale is no NaN


def test_int8_linear_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="multiple of 4"):
        linear_kernels.pack_linear_int8(torch.zeros(4, 6))
    weight = torch.full((4, 8), 0.5)
    packed = linear_kernels.pack_linear_int8(weight)
    assert torch.equal(weight, torch.full((4, 8), 0.5))  # a float32 weight is quantized from a copy
    with pytest.raises(ValueError, match="bf16 rows"):
        linear_kernels.int8_linear(torch.zeros(2, 8), packed)
    with pytest.raises(ValueError, match="residual must be"):
        linear_kernels.int8_linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, residual=torch.zeros(2, 5))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_int8_model_stays_near_bf16_and_batches_exactly(family):
    hf = build(family).bfloat16()
    bf16 = LeanCausalLM.from_hf(hf, batch_invariant=True)
    int8 = LeanCausalLM.from_hf(hf, batch_invariant=True, quantization="int8")
    assert isinstance(int8.lm_head, _Int8Linear) and all(isinstance(layer.down, _Int8Linear) for layer in int8.layers)
    seq = tokens(40, seed=2)
    plain = decode(int8, seq, [16] + [1] * 24)
    want = decode(bf16, seq, [16] + [1] * 24)[0].float()
    got = plain[0].float()
    # quantization moves logits a little, not the ranking of a confident model's top tokens
    assert (got - want).abs().max() < 0.1 * want.abs().max()
    assert torch.nn.functional.cosine_similarity(got, want, dim=1).min() > 0.99
    assert_same(decode(int8, seq, [16] + [4] * 6), plain)  # verification-sized steps
    assert_same(decode(int8, seq, [16] + [1] * 24, traffic=3), plain)  # beside other rows


@pytest.mark.parametrize("family", ["llama-tied-biased", "qwen2"])
def test_an_int8_layer_in_one_c_call_is_the_calls_one_by_one(family):
    """int8 layers run as one run_layers call too (a drafter's step), with the bits of the
    kernels called one by one."""
    lm = LeanCausalLM.from_hf(build(family).bfloat16(), batch_invariant=True, quantization="int8")
    assert lm.layer_steps is not None
    seq, chunks = tokens(40, seed=4), [12] + [5] * 4 + [1] * 8
    fused = decode(lm, seq, chunks, traffic=3)
    lm.layer_steps = None
    assert_same(decode(lm, seq, chunks, traffic=3), fused)


def test_the_lean_runtime_quantizes_to_int8_or_int4_only():
    with pytest.raises(ValueError, match="int8 or int4, not 'int2'"):
        LeanCausalLM.from_hf(build("llama"), quantization="int2")


def test_int4_packing_in_chunks_of_outputs_is_the_whole_weights(monkeypatch):
    weight = (torch.randn(200, 128, generator=torch.Generator().manual_seed(9)) * 0.05).bfloat16()
    whole = linear_kernels.pack_linear_int4(weight)
    monkeypatch.setattr(linear_kernels, "PACK_CHUNK", linear_kernels.GROUP)  # 4 chunks, the last partial
    chunked = linear_kernels.pack_linear_int4(weight)
    assert torch.equal(chunked.packed, whole.packed) and torch.equal(chunked.scale, whole.scale)


def test_int4_linear_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="multiple of 64"):
        linear_kernels.pack_linear_int4(torch.zeros(4, 96))
    packed = linear_kernels.pack_linear_int4(torch.full((4, 64), 0.5))
    with pytest.raises(ValueError, match="bf16 rows"):
        linear_kernels.int4_linear(torch.zeros(2, 64), packed)
    with pytest.raises(cpu_kernels.KernelArgumentError, match="not 4 outputs x K 32"):  # packed for K 64
        linear_kernels.int4_linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed)


# Both quantized kernels over fixed random inputs, saved to argv[1]: rows in tiles whole and
# partial, outputs in whole and partial groups.
_QUANTIZED_OUTPUTS = """
import sys, torch
from backends.runtime import linear_kernels
gen = torch.Generator().manual_seed(7)
outs = []
for n, k, m in ((64, 128, 1), (200, 192, 5), (3, 64, 9)):
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    bias, residual = torch.randn(n, generator=gen).bfloat16(), torch.randn(m, n, generator=gen).bfloat16()
    outs.append(linear_kernels.int8_linear(x, linear_kernels.pack_linear_int8(w), bias, residual))
    outs.append(linear_kernels.int4_linear(x, linear_kernels.pack_linear_int4(w), bias, residual))
torch.save(outs, sys.argv[1])
"""


@needs_avx2
def test_the_avx2_quantized_kernels_give_the_native_bits(tmp_path):
    """The AVX2 int8 and int4 kernels (vpmaddwd / vpmaddubsw for VNNI's integer sums) give the
    bits of the kernels this CPU builds natively (AVX-512 VNNI where it has it)."""
    outputs = []
    for name, flags in (("native", ""), ("avx2", "-mno-avx512f")):
        path = tmp_path / f"{name}.pt"
        done = _with_kernel_flags(flags, "-c", _QUANTIZED_OUTPUTS, str(path))
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(torch.load(path))
    assert [len(o) for o in outputs] == [6, 6]
    for native, avx2 in zip(*outputs):
        assert native.isfinite().all() and torch.equal(native, avx2)


@pytest.mark.parametrize("family", ["llama-tied-biased", "qwen2"])
def test_an_int4_model_stays_near_bf16_and_batches_exactly(family):
    """int4 where K is a multiple of 64 (the tiny models' hidden size), int8 where it is not
    (their intermediate size, 96: down_proj); each layer still one C call with the bits of the
    kernels called one by one."""
    hf = build(family).bfloat16()
    bf16 = LeanCausalLM.from_hf(hf, batch_invariant=True)
    int4 = LeanCausalLM.from_hf(hf, batch_invariant=True, quantization="int4")
    assert isinstance(int4.lm_head, _Int4Linear)
    assert all(isinstance(layer.qkv, _Int4Linear) and isinstance(layer.down, _Int8Linear) for layer in int4.layers)
    assert int4.layer_steps is not None
    seq = tokens(40, seed=2)
    plain = decode(int4, seq, [16] + [1] * 24)
    want = decode(bf16, seq, [16] + [1] * 24)[0].float()
    got = plain[0].float()
    # random tiny weights are int4's worst case (int8 keeps a cosine of 0.99 here); a broken
    # kernel's logits would be unrelated to bf16's (a cosine near 0)
    assert torch.nn.functional.cosine_similarity(got, want, dim=1).mean() > 0.85
    assert_same(decode(int4, seq, [16] + [4] * 6), plain)  # verification-sized steps
    assert_same(decode(int4, seq, [16] + [1] * 24, traffic=3), plain)  # beside other rows
    int4.layer_steps = None
    assert_same(decode(int4, seq, [16] + [1] * 24, traffic=3), plain)  # the kernels one call at a time
