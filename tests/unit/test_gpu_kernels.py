"""The lean runtime's GPU path: the OpenAI Triton kernels of kernels/batch_invariant.py against
their torch references, their row invariance, and a whole model on them (issue: exact in
bfloat16 too, the GPU variant).

Without CUDA the kernels run in Triton's interpreter on CPU tensors (slow: the model tests keep
to a few short steps); scripts/gpu_check.sh runs this file compiled on a GPU. Invariance is
checked with torch.equal on either device; closeness to the references with tolerances that
allow the GPU's other summation order.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.runtime.lean_lm import LeanCausalLM, UnsupportedArchitecture
from backends.serving import target
from backends.serving.target import TargetRunner, VerifyRequest
from kernels import batch_invariant as bi
from tests.fixtures.lean_models import assert_same, build, decode, tokens

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float32]


def close(dtype: torch.dtype) -> dict:
    """Tolerances for a result against its reference: a few bf16 ulps, or float32 rounding."""
    return dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("bias", "residual"), [(False, False), (True, False), (False, True), (True, True)])
def test_linear_is_the_matmul_and_row_invariant(dtype, bias, residual):
    m, k, n = 70, 100, 130  # past one tile of rows and outputs, K not a whole number of tiles
    x = randn(m, k + 8, dtype=dtype, seed=0)[:, :k]  # strided rows
    w = randn(n, k, dtype=dtype, seed=1)
    b = randn(n, dtype=dtype, seed=2) if bias else None
    r = randn(m, n, dtype=dtype, seed=3) if residual else None
    y = bi.linear(x, w, b, r)
    torch.testing.assert_close(y.float(), bi.linear_ref(x, w, b, r).float(), **close(dtype))
    for rows in (1, 5, 17, 64, 65):
        together = bi.linear(x[:rows], w, b, None if r is None else r[:rows])
        assert torch.equal(together, y[:rows])
    for i in (0, 3, 63, 64, 69):
        assert torch.equal(bi.linear(x[i : i + 1], w, b, None if r is None else r[i : i + 1])[0], y[i])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_rows", [1, 6])
def test_rms_norm_is_transformers_and_row_invariant(dtype, weight_rows):
    """One weight for every row, or Qwen3's per-head weights (row r takes weight row r % W)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    h = 96
    x = randn(24, h + 4, dtype=dtype, seed=4)[:, :h]
    weight = (randn(weight_rows, h, dtype=dtype, seed=5) + 2).squeeze(0)
    y = bi.rms_norm(x, weight, 1e-5)
    ref = bi.rms_norm_ref(x, weight, 1e-5)
    torch.testing.assert_close(y.float(), ref.float(), **close(dtype))
    if weight_rows == 1:  # the reference is transformers' LlamaRMSNorm
        norm = LlamaRMSNorm(h, eps=1e-5).to(DEVICE, dtype)
        norm.weight.data.copy_(weight)
        assert torch.equal(ref, norm(x))
    for i in range(0, 24, 5):
        assert torch.equal(bi.rms_norm(x[i : i + 1], weight.reshape(weight_rows, h)[i % weight_rows], 1e-5)[0], y[i])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (9, 3, 64), (8, 1, 32)])
def test_attend_is_attention_and_token_invariant(dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(6)
    slots = 300
    kv = randn(slots, 2, kv_heads, head_dim, dtype=dtype, seed=7)
    q = randn(5, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=8)[:, : heads * head_dim]  # strided q
    # five queries over shuffled slot lists of lengths 1 .. 200 (not whole key blocks)
    lists = [torch.randperm(slots, generator=gen)[:n] for n in (1, 2, 33, 64, 200)]
    lengths = torch.tensor([len(k) for k in lists])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    flat = [t.to(DEVICE) for t in (torch.cat(lists), starts, lengths)]
    out = bi.attend(q, kv, *flat, heads)
    torch.testing.assert_close(out.float(), bi.attend_ref(q, kv, *flat, heads).float(), **close(dtype))
    for t, keys in enumerate(lists):
        alone = [keys.to(DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE), lengths[t : t + 1].to(DEVICE)]
        assert torch.equal(bi.attend(q[t : t + 1], kv, *alone, heads)[0], out[t])


def test_kernels_compile_for_a_gpu(tmp_path):
    """Without a GPU too: the kernels go through Triton's GPU compiler and ptxas for sm_90, which
    the interpreter never exercises (tests/fixtures/gpu_compile.py, in its own process)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.fixtures.gpu_compile"],
        cwd=Path(__file__).parents[2],
        env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("bytes") == 7, done.stdout


def test_kernels_refuse_what_they_cannot_take():
    x = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="linear"):
        bi.linear(x, torch.zeros(4, 6, device=DEVICE))
    with pytest.raises(ValueError, match="unit column stride"):
        bi.rms_norm(x.t(), torch.ones(3, device=DEVICE), 1e-6)
    kv = torch.zeros(4, 2, 3, 8, device=DEVICE)
    one = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="4 heads"):
        bi.attend(torch.zeros(1, 32, device=DEVICE), kv, one, one, one + 1, 4)


# ------------------------------------------------------------------------- a model on them


@pytest.fixture(scope="module", params=[("llama-tied-biased", d) for d in DTYPES] + [("qwen3", torch.bfloat16)])
def hf_and_lean(request):
    family, dtype = request.param
    hf = build(family).to(DEVICE, dtype)
    return hf, LeanCausalLM.from_hf(hf, batch_invariant=True, triton_kernels=True)


def test_the_model_is_transformers_and_batch_invariant(hf_and_lean):
    hf, lm = hf_and_lean
    assert lm.triton_kernels and not lm.fused and lm.device.type == DEVICE
    seq = tokens(16, seed=1)
    plain = decode(lm, seq, [8] + [1] * 8)
    want = hf(torch.tensor([seq], device=DEVICE)).logits[0]
    if lm.dtype == torch.float32:
        torch.testing.assert_close(plain[0], want, **close(lm.dtype))
        assert torch.equal(plain[0].argmax(-1), want.argmax(-1))
    else:  # bf16 roundings of two layer stacks drift apart a little
        torch.testing.assert_close(plain[0].float(), want.float(), rtol=0.05, atol=0.15)
    assert_same(decode(lm, seq, [8, 5, 3]), plain)  # verification of k + 1 = 5, then 3
    assert_same(decode(lm, seq, [3, 5, 4, 4], traffic=2), plain)  # a chunked prompt beside other rows


def test_without_invariance_the_gpu_path_is_refused(hf_and_lean):
    hf, _ = hf_and_lean
    with pytest.raises(UnsupportedArchitecture, match="batch-invariant only"):
        LeanCausalLM.from_hf(hf, triton_kernels=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_target_speculative_output_is_plain_output(target_dir, dtype, monkeypatch):
    """The verifier on these kernels (the GPU path; here interpreted): drafts verified k + 1 at a
    time, accepted or not, give the tokens of plain 1-token decoding, in bf16 too."""
    if DEVICE == "cpu":  # the verifier takes the CPU's kernels there; ask for the Triton ones
        from_hf = LeanCausalLM.from_hf.__func__
        monkeypatch.setattr(
            LeanCausalLM, "from_hf", classmethod(lambda cls, m, **kw: from_hf(cls, m, **kw, triton_kernels=True))
        )
        # The start-up step-cost probe (29 forwards of up to 64 tokens) times steps and decides
        # no token; interpreted, it took most of this test's minutes.
        cheap_probe = functools.partial(target.measure_step_cost, context=4, sizes=(1, 2))
        monkeypatch.setattr(target, "measure_step_cost", cheap_probe)
    runner = TargetRunner(target_dir, dtype=dtype, device=DEVICE, batch_invariant="on")
    assert runner.engine.lm.triton_kernels and runner.batch_invariant
    prompt = tokens(6, seed=3)
    plain = runner.verify(VerifyRequest(1, prompt, [], max_new_tokens=12)).token_ids
    while len(plain) < 8:
        plain += runner.verify(VerifyRequest(1, [], [])).token_ids
    runner.release(1)
    out = runner.verify(VerifyRequest(2, prompt, [], max_new_tokens=12)).token_ids
    # three drafts, all right; then two, the second wrong
    for draft, accepted in (plain[1:4], 3), ([plain[5], (plain[6] + 1) % runner.vocab_size], 1):
        result = runner.verify(VerifyRequest(2, [], draft))
        assert result.num_accepted == accepted
        assert result.token_ids == plain[len(out) : len(out) + accepted + 1]
        out += result.token_ids
    runner.release(2)
