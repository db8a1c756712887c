"""The int8 linear kernel (a quantized drafter's linear layers on the lean runtime): the
quantized arithmetic it promises, checked against the same quantization done in torch; each
row the same alone as among others; and a whole int8 model that stays close to its bf16 self
and batches without changing a bit."""

from __future__ import annotations

import pytest
import torch

from backends.runtime import cpu_kernels
from backends.runtime.lean_lm import LeanCausalLM, _Int8Linear
from tests.fixtures.lean_models import FAMILIES, assert_same, build, decode, tokens

pytestmark = pytest.mark.skipif(
    not cpu_kernels.int8_linear_available(),
    reason="this CPU has neither AVX-512 VNNI nor AVX2 (the int8 linear kernel)",
)


def quantized_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T as the kernel computes it: W symmetric per output, x per row (zero point 128), in
    float64 from the integers."""
    w = weight.double()
    w_scale = (w.abs().amax(dim=1) / 127).float().double()
    q = torch.round(w / w_scale[:, None]).clamp(-127, 127)
    xf = x.double()
    x_scale = (xf.abs().amax(dim=1) / 127).float().double()
    xq = torch.round((xf.float() * (1 / x_scale.float())[:, None]).double())
    return (xq @ q.T) * x_scale[:, None] * w_scale[None, :]


@pytest.mark.parametrize("n", [64, 200, 3])  # whole groups of 64 outputs, a partial last group, less than one
def test_int8_linear_is_the_quantized_matmul_and_row_invariant(n):
    gen = torch.Generator().manual_seed(3)
    k = 584  # not a multiple of 16: the quantizer's masked tail
    weight = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(13, k + 8, generator=gen).bfloat16()[:, :k]  # strided rows
    residual = torch.randn(13, n, generator=gen).bfloat16()
    packed = cpu_kernels.pack_linear_int8(weight)
    out = cpu_kernels.int8_linear(x, packed, bias, residual)
    want = quantized_reference(x, weight) + bias.double() + residual.double()
    torch.testing.assert_close(out.double(), want, rtol=8e-3, atol=1e-2)  # bf16 rounding of the output
    exact = x.double() @ weight.double().T + bias.double() + residual.double()
    assert (out.double() - exact).abs().max() < 0.05 * exact.abs().max()  # and near the unquantized matmul
    for i in (0, 5, 12):  # alone == among 13 rows (tiles of 6: whole and partial)
        alone = cpu_kernels.int8_linear(x[i : i + 1].clone(), packed, bias, residual[i : i + 1])
        assert torch.equal(alone[0], out[i])
    zero = cpu_kernels.int8_linear(torch.zeros(2, k, dtype=torch.bfloat16), packed)
    assert torch.equal(zero, torch.zeros(2, n, dtype=torch.bfloat16))  # an all-zero row's scale is no NaN


def test_int8_linear_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="multiple of 4"):
        cpu_kernels.pack_linear_int8(torch.zeros(4, 6))
    weight = torch.full((4, 8), 0.5)
    packed = cpu_kernels.pack_linear_int8(weight)
    assert torch.equal(weight, torch.full((4, 8), 0.5))  # a float32 weight is quantized from a copy
    with pytest.raises(ValueError, match="bf16 rows"):
        cpu_kernels.int8_linear(torch.zeros(2, 8), packed)
    with pytest.raises(ValueError, match="residual must be"):
        cpu_kernels.int8_linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, residual=torch.zeros(2, 5))


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
    """int8 layers run as one layer_step call too (a drafter's step), with the bits of the
    kernels called one by one."""
    lm = LeanCausalLM.from_hf(build(family).bfloat16(), batch_invariant=True, quantization="int8")
    assert lm.layer_steps is not None
    seq, chunks = tokens(40, seed=4), [12] + [5] * 4 + [1] * 8
    fused = decode(lm, seq, chunks, traffic=3)
    lm.layer_steps = None
    assert_same(decode(lm, seq, chunks, traffic=3), fused)


def test_int8_needs_the_cpu_kernels():
    with pytest.raises(ValueError, match="int8 only"):
        LeanCausalLM.from_hf(build("llama"), quantization="int4")
