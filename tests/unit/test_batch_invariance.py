"""Batch invariance of the lean runtime: a token's logits and hidden states are the same bits
whatever shares its step (issue: exact in bfloat16 too).

Every comparison is torch.equal, in bfloat16 and float32: a 1-token step against the same token
verified among k+1, a prompt in one pass against chunks of any size, a row alone against the
same row batched with other traffic, a tree node against the chain that is its root path. The
kernel itself is checked against a float64 reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from backends.runtime import cpu_kernels, kernel_library, linear_kernels
from backends.runtime.kv_cache import KVCachePool
from backends.runtime.lean_lm import (
    K_CHUNKS,
    KernelLinear,
    LeanCausalLM,
    LeanDecoder,
    Row,
    _Linear,
    kernel_linears,
    onednn_rows,
)
from backends.serving.tree import DraftTree
from tests.fixtures.helpers import run_as_stub
from tests.fixtures.lean_models import FAMILIES, assert_same, build, decode, tokens

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module", params=[(f, d) for f in FAMILIES for d in DTYPES], ids=lambda p: f"{p[0]}-{p[1]}")
def model(request) -> LeanCausalLM:
    name, dtype = request.param
    return LeanCausalLM.from_hf(build(name).to(dtype), batch_invariant=True)


def test_verification_chunked_prefill_and_batching_change_no_bit(model):
    seq = tokens(60, seed=1)
    plain = decode(model, seq, [20] + [1] * 40)  # a prompt, then 1-token steps
    assert_same(decode(model, seq, [20] + [5] * 8), plain)  # verification steps of k+1 = 5
    assert_same(decode(model, seq, [20, 17, 3, 9, 11]), plain)  # mixed verification sizes
    assert_same(decode(model, seq, [7, 13] + [1] * 40), plain)  # the prompt in chunks
    assert_same(decode(model, seq, [1] * 60), plain)  # the prompt one token at a time
    assert_same(decode(model, seq, [20] + [1] * 40, traffic=3), plain)  # beside other rows
    assert_same(decode(model, seq, [20] + [5] * 8, traffic=7), plain)


@pytest.mark.parametrize("cached", [10, 254, 300])
def test_tree_node_equals_its_root_path(model, cached):
    """A node of a draft tree gets the bits of the chain along its root path: its nodes sharing
    one key list (10 or 300 cached tokens), or each its own (254: the nodes cross the 256-key
    chunk boundary)."""
    prefix, a, b1, b2, c = tokens(cached, seed=2), 11, 22, 33, 44
    at = len(prefix)
    pool = model.new_pool(capacity_tokens=512)
    pool.admit("t", cached + 8)
    model.forward(pool, [Row("t", prefix)])
    # a -> b1, a -> b2 -> c
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    positions = torch.tensor([at, at + 1, at + 1, at + 2])
    tree = model.forward(pool, [Row("t", [a, b1, b2, c], mask, positions)], logits_rows=4).logits[0]
    for node, path in ((1, [a, b1]), (3, [a, b2, c])):
        chain = decode(model, prefix + path, [len(prefix)] + [1] * len(path))[0]
        assert torch.equal(tree[node], chain[-1])


needs_avx2 = pytest.mark.skipif(
    not {"avx2", "fma"} <= set(kernel_library._cpu_flags().split()), reason="this CPU has no AVX2 + FMA"
)


def _with_kernel_flags(flags: str, *args: str) -> subprocess.CompletedProcess:
    """Python run with `args` in the repository, its CPU kernels built with extra `flags`."""
    return subprocess.run(
        [sys.executable, *args],
        env={**os.environ, kernel_library.FLAGS_ENV: flags},
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
    )


@needs_avx2
def test_the_avx2_packed_linear_kernel_passes_the_packed_tests():
    """The AVX2 + FMA variant (what an AVX2-only CPU builds) is also tested on a CPU with
    AVX-512, which builds the AVX-512 BF16 one: in a process whose kernels are built without
    AVX-512, the packed kernel's tests run (none skipped) and pass."""
    tests = [
        f"{__file__}::{name}"
        for name in (
            "test_packed_linear_is_the_matmul_and_row_invariant",
            "test_packed_linear_refuses_what_it_cannot_take",
            "test_a_prefill_batch_gives_each_row_of_the_packed_linear_its_bits_alone",
        )
    ]
    done = _with_kernel_flags("-mno-avx512f", "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests)
    assert done.returncode == 0 and "6 passed" in done.stdout, done.stdout[-3000:]
    # the flags reach the build: without AVX2 either, no packed kernel is built
    ask = "from backends.runtime import linear_kernels; print(linear_kernels.packed_linear_available())"
    off = _with_kernel_flags("-mno-avx512f -mno-avx2", "-c", ask)
    assert off.stdout.strip() == "False", off.stderr[-3000:]


_NOISY_COMPILER = """#!/bin/sh
printf '\\342\\200\\230hsum16\\342\\200\\231: warning \\377\\n' >&2
[ -n "$FAIL" ] && exit 1
exec gcc "$@"
"""


@pytest.mark.parametrize("fail", [False, True])
def test_the_kernels_build_in_an_ascii_locale_whatever_the_compiler_prints(tmp_path, fail):
    """gcc quotes names in UTF-8 and, on an AVX2-only CPU, warns while building the kernels;
    the Triton stub runs Python in an ASCII locale, where decoding that text failed the
    verifier's load. Built in such a process (C locale, no UTF-8 mode) by a compiler that
    prints curly quotes and a byte that is no UTF-8 at all, the kernels load; a failed build
    says what the compiler printed."""
    compiler = tmp_path / "cc"
    compiler.write_text(_NOISY_COMPILER)
    compiler.chmod(0o755)
    ask = "from backends.runtime import cpu_kernels; print(ascii(cpu_kernels.unavailable_reason(64, 9, 3)))"
    env = {"CC": str(compiler), "TRITONSPEC_CACHE": str(tmp_path / "cache"), "FAIL": "1" if fail else ""}
    done = run_as_stub(ask, env=env)
    said = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    if fail:
        assert "building cpu_kernels.c failed" in said and r"\u2018hsum16\u2019: warning \ufffd" in said, said
    else:
        assert said.strip() == "None", said


# Attention over fixed random inputs, saved to argv[1]: queries alone and in runs sharing a key
# list (a row's verification tokens), key counts around the 16-key tiles, head dims that take
# the AVX2 loops' 64- and 16-wide parts.
_ATTENTION_OUTPUTS = """
import sys, torch
from backends.runtime import cpu_kernels
gen = torch.Generator().manual_seed(3)
outs = []
for dtype in (torch.float32, torch.bfloat16):
    for heads, kv_heads, d in ((9, 3, 64), (4, 2, 16), (4, 4, 128), (2, 1, 96)):
        kv = torch.randn(400, 2, kv_heads, d, generator=gen).to(dtype)
        q = (3 * torch.randn(12, heads * d, generator=gen)).to(dtype)
        lists = [torch.randperm(400, generator=gen)[:n] for n in (1, 15, 16, 17, 201, 399)]
        shared = torch.randperm(400, generator=gen)[:300]
        slots = torch.cat([*lists, shared])
        start = [0, *torch.tensor([len(k) for k in lists]).cumsum(0).tolist()]
        length = [len(k) for k in lists] + [295 + t for t in range(6)]
        start += [start[-1]] * 5
        keys = cpu_kernels.KeyLists(slots, torch.tensor(start), torch.tensor(length))
        outs.append(cpu_kernels.attend(q, kv, keys, heads))
torch.save(outs, sys.argv[1])
"""


@needs_avx2
def test_the_avx2_attention_gives_the_generic_kernels_bits(tmp_path):
    """Attention's inner loops have 8-wide AVX2 versions of the 16-wide vector code: built
    as this CPU allows (AVX-512 where it has it), without AVX-512 (the AVX2 loops) and without
    AVX2 either (the vector code, its FMAs one lane at a time), the kernel gives the same bits,
    in float32 and bf16; except bf16 on AVX-512 BF16's dot products, other arithmetic (its
    values checked against float64 elsewhere), which only comes close."""
    outputs = []
    for name, flags in (("native", ""), ("avx2", "-mno-avx512f"), ("generic", "-mno-avx512f -mno-avx2")):
        path = tmp_path / f"{name}.pt"
        done = _with_kernel_flags(flags, "-c", _ATTENTION_OUTPUTS, str(path))
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(torch.load(path))
    assert [len(o) for o in outputs] == [8, 8, 8]
    for native, avx2, generic in zip(*outputs):
        assert avx2.isfinite().all() and torch.equal(avx2, generic)
        if native.dtype == torch.bfloat16 and cpu_kernels.bf16_attention_on_dots():
            torch.testing.assert_close(native.float(), avx2.float(), atol=3e-2, rtol=0)
        else:
            assert torch.equal(native, avx2)


def _float64_attention(q: torch.Tensor, kv: torch.Tensor, key_slots: torch.Tensor) -> torch.Tensor:
    """One query token's attention ``[heads * head_dim]`` over the pool slots given, in float64."""
    _, _, kv_heads, head_dim = kv.shape
    heads = q.shape[0] // head_dim
    kvh = torch.arange(heads) % kv_heads  # query heads group-major
    k, v = (kv[key_slots, i].double()[:, kvh].transpose(0, 1) for i in (0, 1))
    return F.scaled_dot_product_attention(q.double().view(heads, 1, head_dim), k, v).reshape(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(4, 2, 16), (9, 3, 64), (4, 4, 128), (8, 1, 32), (6, 2, 48), (2, 1, 256)]
)
def test_kernel_matches_float64_attention_and_is_invariant(dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(0)
    slots = 400
    kv = torch.randn(slots, 2, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(6, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)  # strided q rows
    # six queries over shuffled slot lists of lengths 1 .. 300 (masks skip keys anywhere)
    lists = [torch.randperm(slots, generator=gen)[:n] for n in (1, 2, 17, 64, 150, 300)]
    keys = cpu_kernels.KeyLists(
        torch.cat(lists),
        torch.tensor([0, *torch.tensor([len(k) for k in lists]).cumsum(0)[:-1].tolist()]),
        torch.tensor([len(k) for k in lists]),
    )
    out = cpu_kernels.attend(q[:, : heads * head_dim], kv, keys, heads)
    for t, key_slots in enumerate(lists):
        ref = _float64_attention(q[t, : heads * head_dim], kv, key_slots)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[t].double(), ref, atol=tol, rtol=0)
        alone = cpu_kernels.KeyLists(key_slots, torch.tensor([0]), torch.tensor([len(key_slots)]))
        assert torch.equal(cpu_kernels.attend(q[t : t + 1, : heads * head_dim], kv, alone, heads)[0], out[t])


@pytest.mark.parametrize("last", [300, 200])  # keys in two chunks; in one (the run split in two on 2 threads)
def test_kernel_result_does_not_depend_on_threads_or_runs(last):
    """A verification's 5 queries over one key list: the same bits on 1 or 2 threads, and
    each query's bits alone."""
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(300, 2, 3, 64, generator=gen).bfloat16()
    q = torch.randn(5, 9 * 64, generator=gen).bfloat16()
    keys = cpu_kernels.KeyLists(torch.arange(300), torch.zeros(5, dtype=torch.long), torch.arange(last - 4, last + 1))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.attend(q, kv, keys, 9)
        torch.set_num_threads(2)
        two = cpu_kernels.attend(q, kv, keys, 9)
        for t in range(5):
            alone = cpu_kernels.KeyLists(torch.arange(300), torch.tensor([0]), torch.tensor([last - 4 + t]))
            assert torch.equal(cpu_kernels.attend(q[t : t + 1], kv, alone, 9)[0], two[t])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def _tree_mask(n: int, gen: torch.Generator) -> torch.Tensor:
    """The verifier's [n, n] mask for a pending token and a random tree of n - 1 nodes under it."""
    parents = tuple(int(torch.randint(-1, k, (1,), generator=gen)) for k in range(n - 1))
    return DraftTree(tuple(range(n - 1)), parents).attention_mask(1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_nodes_sharing_a_key_list_get_their_own_lists_bits(dtype):
    """Tree nodes verified in one row share one key list with a mask (cpu_kernels.c's key_mask):
    each gets the bits it gets over its own list (the cached tokens and its ancestors), beside
    chains and other trees, at cached lengths inside one chunk and past several, and a
    drafter's tree level hiding cached nodes of earlier levels. Where the hidden keys would
    cross a chunk boundary, each node keeps its own list."""
    gen = torch.Generator().manual_seed(5)
    pool = KVCachePool(1, 3, 64, capacity_tokens=8192, dtype=dtype)
    cached = {"a": 5, "b": 300, "c": 700, "d": 250, "chain": 40, "level": 120, "far": 300}
    nodes = {"a": 9, "b": 17, "c": 40, "d": 13, "chain": 5, "level": 4, "far": 4}
    for seq, c in cached.items():
        pool.admit(seq, c + nodes[seq])
    pool.layers[0].copy_(torch.randn(pool.layers[0].shape, generator=gen).to(dtype))
    rows = [Row(s, list(range(nodes[s])), None if s == "chain" else _tree_mask(nodes[s], gen)) for s in list(nodes)[:5]]
    # a drafter's tree level: 4 nodes that also see some of the cached nodes of earlier levels
    # (the last 8 cached tokens of "level"; "far" hides a key 100 back, in the chunk before)
    for seq, back in (("level", 8), ("far", 100)):
        mask = torch.cat([torch.ones(4, cached[seq]), torch.eye(4)], dim=1).bool()
        mask[:, cached[seq] - back : cached[seq]] = torch.rand(4, back, generator=gen) < 0.5
        rows.append(Row(seq, list(range(4)), mask))
    q = torch.randn(sum(nodes.values()), 9 * 64, generator=gen).to(dtype)
    shared = LeanDecoder._key_lists(pool, rows, list(cached.values()))
    own = LeanDecoder._key_lists(pool, rows, list(cached.values()), share_trees=False)
    assert own.mask is None and shared.mask is not None
    # one list for each of "a", "b", "c", the chain and "level"; "d" (250 + 13 crosses 256) and
    # "far" one per node
    assert shared.start.unique().numel() == 5 + 13 + 4
    assert torch.equal(cpu_kernels.attend(q, pool.layers[0], shared, 9), cpu_kernels.attend(q, pool.layers[0], own, 9))


def _check_each_list_alone(q, kv, order, starts, lengths, threads: int) -> None:
    """attend over the lists order[start : start + length] in one call on `threads` threads:
    each token gets the bits it gets alone, and the float64 attention's values."""
    keys = cpu_kernels.KeyLists(order, torch.tensor(starts), torch.tensor(lengths))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = cpu_kernels.attend(q, kv, keys, 9)
    finally:
        torch.set_num_threads(before)
    for t, (start, n) in enumerate(zip(starts, lengths)):
        key_slots = order[start : start + n]
        alone = cpu_kernels.KeyLists(key_slots, torch.tensor([0]), torch.tensor([n]))
        assert torch.equal(cpu_kernels.attend(q[t : t + 1], kv, alone, 9)[0], out[t]), n
        tol = 2e-2 if q.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[t].double(), _float64_attention(q[t], kv, key_slots), atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_key_lists_are_chunked_the_same_alone_or_in_a_run(dtype):
    """Past 256 keys a query attends in chunks of its own list, combined in order: a run of
    queries whose lists end on either side of a chunk boundary (a row verifying drafts there)
    gives each the bits it gets alone, and the float64 attention's values. Alone, each chunk is
    a task of its own; in this call of 3 runs on one thread, a task attends its run's chunks."""
    gen = torch.Generator().manual_seed(4)
    kv = torch.randn(1100, 2, 3, 64, generator=gen).to(dtype)
    q = torch.randn(10, 9 * 64, generator=gen).to(dtype)
    order = torch.randperm(1100, generator=gen)
    lengths = [254, 255, 256, 257, 258, 511, 512, 513, 514, 1025]
    starts = [0] * 5 + [300] * 4 + [0]  # two runs sharing their lists' starts, then one alone
    _check_each_list_alone(q, kv, order, starts, lengths, threads=1)


def test_a_long_list_beside_a_short_one():
    """Chunks as tasks of their own (a call of few runs), chunk-major, on two threads: a run of
    two tokens over 2099 and 2100 keys (9 chunks) beside a token over 40 keys (one task for
    the whole list)."""
    gen = torch.Generator().manual_seed(6)
    kv = torch.randn(2200, 2, 3, 64, generator=gen).bfloat16()
    q = torch.randn(3, 9 * 64, generator=gen).bfloat16()
    _check_each_list_alone(q, kv, torch.randperm(2200, generator=gen), [0, 0, 2150], [2099, 2100, 40], threads=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prefill_tile_gives_each_query_its_bits_alone(dtype):
    """A prompt chunk of 80 tokens after 230 cached ones (key lists of 231 .. 310 keys: odd and
    even, across 16-key tiles and the 256-key chunk boundary) in one call, its queries in runs
    of up to 32 sharing each key, on 1, 2 and 3 threads: each query gets the bits it gets
    alone (as a 1-token step) and the float64 attention's values."""
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(400, 2, 3, 64, generator=gen).to(dtype)
    q = torch.randn(80, 9 * 64, generator=gen).to(dtype)
    order = torch.randperm(400, generator=gen)
    for threads in (1, 2, 3):
        _check_each_list_alone(q, kv, order, [0] * 80, list(range(231, 311)), threads)


def test_kernel_refuses_what_it_cannot_take():
    assert "head dim 24" in cpu_kernels.unavailable_reason(24, 4, 2)
    assert "query heads" in cpu_kernels.unavailable_reason(64, 64, 1)
    kv = torch.zeros(4, 2, 1, 16, dtype=torch.float16)
    keys = cpu_kernels.KeyLists(torch.arange(1), torch.zeros(1), torch.ones(1))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        cpu_kernels.attend(torch.zeros(1, 16, dtype=torch.float16), kv, keys, 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_kernel_rounds_as_transformers(dtype):
    """The C RMSNorm gives transformers' LlamaRMSNorm bit for bit in bf16 (the normalized row is
    rounded before the weight), within float32 rounding in float32, for every row alone or
    among others, strided rows included."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(3)
    norm = LlamaRMSNorm(576, eps=1e-5)
    norm.weight.data = torch.randn(576, generator=gen)
    norm = norm.to(dtype)
    wide = (torch.randn(40, 2 * 576, generator=gen) * 4).to(dtype)
    x = wide[:, :576]  # rows with a stride of 2 * 576
    out = cpu_kernels.rms_norm(x, norm.weight.data, 1e-5)
    expected = norm(x)
    if dtype == torch.bfloat16:
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    for i in (0, 17, 39):
        assert torch.equal(cpu_kernels.rms_norm(x[i : i + 1], norm.weight.data, 1e-5)[0], out[i])


def test_layer_kernels_refuse_what_they_cannot_take():
    assert cpu_kernels.layer_kernels_available(576, 1536, 64)
    assert not cpu_kernels.layer_kernels_available(24, 1536, 64)  # rows of whole vectors of 16
    assert not cpu_kernels.layer_kernels_available(576, 1536, 512)  # head dim past the stack buffers
    assert not cpu_kernels.layer_kernels_available(576, 1536, 40)  # RoPE in whole vectors of 16
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        cpu_kernels.rms_norm(torch.zeros(1, 16, dtype=torch.float16), torch.ones(16, dtype=torch.float16), 1e-5)
    with pytest.raises(cpu_kernels.KernelUnavailable, match="multiple of 16"):
        cpu_kernels.rms_norm(torch.zeros(1, 24), torch.ones(24), 1e-5)
    with pytest.raises(cpu_kernels.KernelUnavailable, match="multiple of 16"):
        cpu_kernels.silu_mul(torch.zeros(1, 48))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_is_the_tensor_ops(dtype):
    """RoPE in place on the q and k heads, then k and v into each token's slot: what lean_lm's
    tensor ops compute (bit for bit in bf16, float32 rounding apart in float32)."""
    gen = torch.Generator().manual_seed(4)
    tokens, heads, kv_heads, d = 7, 6, 2, 64
    rope = (torch.randn(tokens, d, generator=gen)).to(dtype), torch.randn(tokens, d, generator=gen).to(dtype)
    wide = torch.randn(tokens, (heads + 2 * kv_heads) * d + 32, generator=gen).to(dtype)
    qkv = wide[:, : (heads + 2 * kv_heads) * d]  # strided rows, as a K-split matmul may leave them
    slots = torch.tensor([9, 3, 0, 11, 5, 6, 2])
    expected_qkv, expected_kv = qkv.clone(), torch.zeros(12, 2, kv_heads, d, dtype=dtype)
    qk = expected_qkv[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d)
    swapped = qk.view(tokens, heads + kv_heads, 2, d // 2).flip(2).view(tokens, heads + kv_heads, d)
    qk.mul_(rope[0].unsqueeze(1)).addcmul_(swapped, rope[1].unsqueeze(1))
    expected_kv.index_copy_(0, slots, expected_qkv[:, heads * d :].view(tokens, 2, kv_heads, d))
    kv = torch.zeros_like(expected_kv)
    cpu_kernels.rope_store(qkv, *rope, kv, slots, heads)
    if dtype == torch.bfloat16:
        assert torch.equal(qkv, expected_qkv) and torch.equal(kv, expected_kv)
    else:
        torch.testing.assert_close(qkv, expected_qkv, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(kv, expected_kv, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_the_tensor_ops(dtype):
    """silu(gate) * up, rows alone or together: the tensor ops' values up to one bf16 rounding
    step (its exp is its own), and the same bits for a row whatever the other rows."""
    gen = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(9, 2 * 1536, generator=gen) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])  # the sigmoid's ends and its middle
    out = cpu_kernels.silu_mul(gate_up)
    expected = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    tolerance = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(out, expected, **tolerance)
    if dtype == torch.bfloat16:
        assert (out != expected).float().mean() < 0.01  # rare ties of the last bit only
    for i in (0, 4, 8):
        assert torch.equal(cpu_kernels.silu_mul(gate_up[i : i + 1])[0], out[i])


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_kernel_is_torch_argmax(dtype):
    """Greedy verification's argmax: torch's index on random rows, ties (the first, also among
    rows of few values), rows of -inf, -0 beside +0, widths that are no multiple of the kernel's
    vectors and strided rows; a row with a NaN is the kernel's -1, and argmax_rows then answers
    as torch does (the NaN's index)."""
    gen = torch.Generator().manual_seed(6)
    rows = torch.randn(6, 49152 + 7, generator=gen).to(dtype)
    rows[1, 100] = rows[1, 9000] = 50.0  # a tie: the first wins
    rows[2] = -float("inf")
    rows[3, :] = -1.0
    rows[3, 30], rows[3, 20] = 0.0, -0.0  # equal values: the first
    strided = torch.randn(4, 2, 4096, generator=gen).to(dtype)[:, 1]
    # Many ties in every lane and way of the kernel's one pass: the first index still wins,
    # also where the largest is only in the tail past the whole vectors, or both in and past them.
    ties = torch.randint(0, 4, (8, 1000 + 37), generator=gen).to(dtype)
    ties[5, -3] = ties[6, -1] = ties[6, 500] = 9.0

    def kernel(x: torch.Tensor) -> list[int]:  # the C function itself, no torch fallback
        out = torch.empty(x.shape[0], dtype=torch.int64)
        bf16 = int(x.dtype == torch.bfloat16)
        kernel_library.library().argmax_rows(x.data_ptr(), x.stride(0), *x.shape, bf16, out.data_ptr())
        return out.tolist()

    for x in (rows, strided, rows[:, :16], rows[:, :5], ties, ties[:, :64], ties[:, :65], ties[:, :63], ties[:, :1]):
        expected = x.float().argmax(dim=-1).tolist()
        assert kernel(x) == expected
        assert cpu_kernels.argmax_rows(x) == expected
    rows[4, 77] = float("nan")
    assert kernel(rows)[4] == -1
    assert cpu_kernels.argmax_rows(rows) == rows.float().argmax(dim=-1).tolist()


needs_packed = pytest.mark.skipif(
    not linear_kernels.packed_linear_available(),
    reason="this CPU has neither AVX-512 BF16 nor AVX2 + FMA (the packed bf16 linear kernel)",
)


@needs_packed
@pytest.mark.parametrize("n", [64, 200, 3])  # whole groups of 64 outputs, a partial last group, less than one
def test_packed_linear_is_the_matmul_and_row_invariant(n):
    """x W^T + bias + residual to bf16 rounding of a float64 reference; every row the same bits
    alone, among 52 rows (two blocks of row tiles, K in four and a half chunks) or strided, at
    any thread count."""
    gen = torch.Generator().manual_seed(6)
    k = 576
    weight = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    wide = torch.randn(52, k + 8, generator=gen).bfloat16()
    x = wide[:, :k]  # strided rows
    residual = torch.randn(52, n, generator=gen).bfloat16()
    packed = linear_kernels.pack_linear(weight)
    out = linear_kernels.packed_linear(x, packed, n, bias, residual)
    reference = x.double() @ weight.double().T + bias.double() + residual.double()
    torch.testing.assert_close(out.double(), reference, rtol=1e-2, atol=2e-2)
    plain = linear_kernels.packed_linear(x, packed, n)
    torch.testing.assert_close(plain.double(), x.double() @ weight.double().T, rtol=1e-2, atol=2e-2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for i in (0, 5, 39, 51):
            alone = linear_kernels.packed_linear(x[i : i + 1].clone(), packed, n, bias, residual[i : i + 1])
            assert torch.equal(alone[0], out[i])
    finally:
        torch.set_num_threads(before)
    for m in (1, 6, 7, 13, 48, 49):  # one tile, tiles split evenly (4 + 3, 5 + 4 + 4), one and two blocks
        assert torch.equal(linear_kernels.packed_linear(x[:m], packed, n, bias, residual[:m]), out[:m])


@needs_packed
@pytest.mark.parametrize("threads", [1, 2])
def test_a_prefill_batch_gives_each_row_of_the_packed_linear_its_bits_alone(threads):
    """A 2048-row prefill (blocks of row tiles, shared with the groups of outputs among the
    threads) gives every row the bits it gets alone in a decode step, wherever it sits."""
    gen = torch.Generator().manual_seed(7)
    n, k = 200, 1536  # a partial last group; K in 12 chunks
    weight = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(2048, k, generator=gen).bfloat16()
    residual = torch.randn(2048, n, generator=gen).bfloat16()
    packed = linear_kernels.pack_linear(weight)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        batch = linear_kernels.packed_linear(x, packed, n, bias, residual)
        for i in (0, 1, 5, 6, 47, 48, 1000, 2046, 2047):
            alone = linear_kernels.packed_linear(x[i : i + 1], packed, n, bias, residual[i : i + 1])
            assert torch.equal(alone[0], batch[i]), f"row {i}"
        for m0, m1 in ((0, 129), (1, 2048), (700, 755)):  # other batches the row sits in
            part = linear_kernels.packed_linear(x[m0:m1], packed, n, bias, residual[m0:m1])
            assert torch.equal(part, batch[m0:m1])
    finally:
        torch.set_num_threads(before)
    reference = x.double() @ weight.double().T + bias.double() + residual.double()
    torch.testing.assert_close(batch.double(), reference, rtol=1e-2, atol=3e-2)


@needs_packed
def test_packed_linear_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="even K"):
        linear_kernels.pack_linear(torch.zeros(4, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16 weights"):
        linear_kernels.pack_linear(torch.zeros(4, 8))
    packed = linear_kernels.pack_linear(torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16 rows"):
        linear_kernels.packed_linear(torch.zeros(2, 8), packed, 4)
    with pytest.raises(ValueError, match="residual must be"):
        linear_kernels.packed_linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, 4, residual=torch.zeros(2, 5))


@needs_packed
def test_a_heads_linears_run_in_the_packed_kernel():
    """kernel_linears turns a module's bf16 nn.Linear layers (odd K stays) into KernelLinear:
    the packed kernel's bits for any leading shape, the same bits for a row alone or batched,
    repacked after the weight changes; float32 and gradient-taking calls keep nn.Linear's."""
    torch.manual_seed(3)
    head = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 5, bias=False), torch.nn.Linear(5, 7))
    head = head.bfloat16()
    assert kernel_linears(head) == 2
    assert [type(m) for m in head] == [KernelLinear, KernelLinear, torch.nn.Linear]
    first = head[0]
    x = torch.randn(3, 4, 64).bfloat16()
    with torch.inference_mode():
        out = first(x)
        packed = linear_kernels.pack_linear(first.weight.detach())
        assert out.shape == (3, 4, 96)
        assert torch.equal(out.view(12, 96), linear_kernels.packed_linear(x.view(12, 64), packed, 96, first.bias))
        torch.testing.assert_close(
            out.double(), F.linear(x.double(), first.weight.double(), first.bias.double()), rtol=1e-2, atol=2e-2
        )
        assert torch.equal(first(x[1, 2:3]), out[1, 2:3])
        first.weight.mul_(2)
        torch.testing.assert_close(
            first(x).float(), F.linear(x, first.weight, first.bias).float(), rtol=2e-2, atol=5e-2
        )
    x.requires_grad_(True)
    first(x.detach()).sum().backward()  # training: ATen's forward, so gradients flow
    assert first.weight.grad is not None
    assert torch.equal(head.float()[0](x.detach().float()), F.linear(x.detach().float(), first.weight, first.bias))


@needs_packed
@pytest.mark.skipif(not linear_kernels.int8_linear_available(), reason="this CPU has no int8 linear kernel")
def test_a_heads_linears_on_the_int8_kernel():
    """kernel_linears(int8=True): the int8 kernel's output for a K that is a multiple of 4
    (the others stay bf16 packed), near the matmul, the same bits alone or batched; turned
    back to bf16 by a second call."""
    torch.manual_seed(4)
    head = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8, bias=False), torch.nn.Linear(6, 8))
    head = head.bfloat16()
    assert kernel_linears(head, int8=True) == 2
    assert [m.int8 for m in head] == [True, True, False] and type(head[2]) is KernelLinear
    first, x = head[0], torch.randn(5, 64).bfloat16()
    with torch.inference_mode():
        out = first(x)
        expected = linear_kernels.int8_linear(x, linear_kernels.pack_linear_int8(first.weight), first.bias)
        assert torch.equal(out, expected)
        reference = F.linear(x.double(), first.weight.double(), first.bias.double())
        assert (out.double() - reference).abs().max() < 0.05 * reference.abs().max()
        assert torch.equal(first(x[3:4]), out[3:4])
        assert kernel_linears(head) == 3 and not first.int8
        assert torch.equal(
            first(x), linear_kernels.packed_linear(x, linear_kernels.pack_linear(first.weight), 96, first.bias)
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_matmul_is_row_invariant_and_close_to_unsplit(dtype):
    """K split in chunks accumulates chunk by chunk: rows keep their bits at any row count, and
    the value stays the unsplit matmul's up to rounding."""
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(96, 1536, generator=gen) * 0.05).to(dtype)
    x = torch.randn(40, 1536, generator=gen).to(dtype)
    split = _Linear(weight, None, k_chunk=K_CHUNKS[1], slab=16)
    assert len(split.bounds) == 2 and split.row_invariant(adds=True)
    together = split(x)  # 40 rows: three slabs of at most 16
    assert torch.equal(together, torch.cat([split(x[i : i + 1]) for i in range(40)]))
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(together.float(), (x.float() @ weight.float().T), atol=tol, rtol=0)


def test_onednn_matmuls_run_at_few_row_counts():
    """Each row count a oneDNN matmul runs at costs a cached primitive: up to 16 rows as given,
    then 8 counts an octave, never under the rows asked, at most 12.5% over, within a slab."""
    counts = [onednn_rows(m) for m in range(1, 4097)]
    assert counts[:16] == list(range(1, 17))
    assert all(m <= c <= m * 1.125 for m, c in zip(range(1, 4097), counts))
    assert len(set(counts[:256])) == 48 and max(counts[:256]) == 256 and max(counts[:64]) == 64


@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_rows_change_no_row(dtype):
    """A oneDNN linear pads its rows to onednn_rows: every row is the unpadded matmul's (bit for
    bit where it is row invariant), and the output has the rows asked for."""
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(64, 256, generator=gen) * 0.05).to(dtype)
    x = torch.randn(37, 256, generator=gen).to(dtype)
    residual = torch.randn(37, 64, generator=gen).to(dtype)
    linear = _Linear.invariant(weight, slab=64)
    for m in (1, 17, 19, 37):
        assert linear(x[:m]).shape == (m, 64)
        assert torch.equal(linear(x[:m]), torch.cat([linear(x[i : i + 1]) for i in range(m)]))
        assert torch.equal(linear.add(x[:m], residual[:m])[-1], linear.add(x[m - 1 : m], residual[m - 1 : m])[0])
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(_Linear(weight)(x).float(), x.float() @ weight.float().T, atol=tol, rtol=0)


@pytest.mark.parametrize("slab", [None, 64])
def test_every_onednn_linear_pads_to_onednn_rows(monkeypatch, slab):
    """Invariant (a slab) or not (none), the matmul runs at onednn_rows' count, not the rows given."""
    import backends.runtime.lean_lm as lean_lm

    padded_to = []
    pad = lean_lm._padded_rows
    monkeypatch.setattr(lean_lm, "_padded_rows", lambda x, rows: padded_to.append(rows) or pad(x, rows))
    linear = _Linear(torch.randn(32, 64), None, None, slab)
    assert linear(torch.randn(37, 64)).shape == (37, 32)
    assert padded_to == [onednn_rows(37)] == [40]


def test_probe_splits_until_rows_are_invariant(monkeypatch):
    """The least split that passes the probe is kept; none passing refuses the model."""
    weight = torch.randn(32, 2048).bfloat16()
    passes_at = {2048: False, 1024: False, 512: True}
    monkeypatch.setattr(_Linear, "row_invariant", lambda self, adds: passes_at[self.bounds[0][1]])
    assert _Linear.invariant(weight).k_chunk == 512
    monkeypatch.setattr(_Linear, "row_invariant", lambda self, adds: False)
    with pytest.raises(ValueError, match="no row-invariant matmul"):
        _Linear.invariant(weight)


def test_onednn_splits_are_probed_once_per_process_shape_and_thread_count(monkeypatch):
    """A model built again in the same process (a reload, a drafter beside the target of the
    same shapes) takes the K chunks probed for the first; at another thread count, or for
    another dtype, they are probed again."""
    from backends.runtime import lean_lm

    monkeypatch.setattr(lean_lm, "_PROBED_K_CHUNKS", {})
    monkeypatch.setattr(lean_lm._PackedLinear, "runs", staticmethod(lambda weight: False))  # oneDNN's path
    probed = []
    invariant = _Linear.invariant.__func__
    monkeypatch.setattr(
        _Linear, "invariant", classmethod(lambda cls, *a: probed.append(a[0].shape) or invariant(cls, *a))
    )
    model = build("qwen2")

    def probes(dtype: torch.dtype) -> int:
        probed.clear()
        LeanCausalLM.from_hf(model.to(dtype), batch_invariant=True)
        return len(probed)

    first = probes(torch.float32)
    assert first > 0 and probes(torch.float32) == 0
    assert probes(torch.bfloat16) == first
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if before > 1 else 2)
        assert probes(torch.float32) == first
    finally:
        torch.set_num_threads(before)


@needs_packed
def test_the_packed_probe_runs_once_per_build_and_shape(monkeypatch, tmp_path):
    """A shape whose row invariance held is remembered beside the kernels' build and not probed
    again (9 s for Qwen2.5-1.5B's LM head); one that failed is not remembered; another shape,
    or the same at another thread count, is probed."""
    from backends.runtime.lean_lm import _PackedLinear

    monkeypatch.setattr(kernel_library, "_record", lambda: tmp_path / "kernels.row-invariant")
    calls = []
    run = _PackedLinear._run
    monkeypatch.setattr(_PackedLinear, "_run", lambda self, *args: calls.append(1) or run(self, *args))
    weight = (torch.randn(48, 128, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16()

    def probed(linear: _PackedLinear) -> bool:
        calls.clear()
        assert linear.row_invariant(adds=True, max_rows=8)
        return bool(calls)

    assert probed(_PackedLinear(weight)) and not probed(_PackedLinear(weight))
    assert probed(_PackedLinear(weight[:32]))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if before == 1 else 1)  # another count than the one probed above
        assert probed(_PackedLinear(weight))
    finally:
        torch.set_num_threads(before)
    assert len(cpu_kernels.row_invariant_shapes()) == 3
    monkeypatch.setattr(_Linear, "row_invariant", lambda self, adds, max_rows=None: False)  # the probe fails
    assert not _PackedLinear(weight[:16]).row_invariant(adds=True, max_rows=8)
    assert len(cpu_kernels.row_invariant_shapes()) == 3
    monkeypatch.undo()  # the real probe again, and a record that cannot be written: still loads
    monkeypatch.setattr(kernel_library, "_record", lambda: tmp_path / "no such directory" / "kernels.row-invariant")
    assert _PackedLinear(weight).row_invariant(adds=True, max_rows=8)


@needs_packed
@pytest.mark.parametrize("family", ["llama-tied-biased", "qwen2", "qwen3"])
def test_a_layer_in_one_c_call_is_the_calls_one_by_one(family):
    """bf16 layers whose every part has a C kernel run as one run_layers call: the bits of
    the kernels called one by one, hidden states included (Qwen3's q/k norms keep the calls)."""
    lm = LeanCausalLM.from_hf(build(family).to(torch.bfloat16), batch_invariant=True)
    assert (lm.layer_steps is None) == (family == "qwen3")
    seq, chunks = tokens(40, seed=4), [12] + [5] * 4 + [1] * 8
    fused = decode(lm, seq, chunks, traffic=3)
    lm.layer_steps = None
    assert_same(decode(lm, seq, chunks, traffic=3), fused)


@needs_packed
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_the_layers_run_in_one_call_or_one_at_a_time_alike_and_never_past_the_stack(quantization):
    """A drafter head calls its layers one at a time (`layer`), a step the whole stack at once
    (bf16, or a quantized drafter's): the same bits; a run past the layers (or past the pool's)
    is refused before any C runs."""
    if quantization and not linear_kernels.int8_linear_available():
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2 (the int8 and int4 linear kernels)")
    hf = build("llama-tied-biased").to(torch.bfloat16)
    lm = LeanCausalLM.from_hf(hf, batch_invariant=True, quantization=quantization)
    assert lm.layer_steps is not None
    pool = lm.new_pool(capacity_tokens=256)
    ids = tokens(12, seed=1)
    streams = []
    for seq in ("whole", "one at a time"):
        pool.admit(seq, 64)
        step = lm.plan(pool, [Row(seq, ids)], [12])
        h = F.embedding(step.ids, lm.embed)
        if seq == "whole":
            lm.run_layers(0, lm.num_layers, h, pool, step)
        else:
            for i in range(lm.num_layers):
                h = lm.layer(i, h, pool, step)
        streams.append(h)
    assert torch.equal(*streams)
    for first, end in ((0, lm.num_layers + 1), (1, 1), (-1, 1)):
        with pytest.raises(ValueError, match=f"layers {first} to {end} of {lm.num_layers}"):
            lm.run_layers(first, end, h, pool, step)


@needs_packed
@pytest.mark.parametrize(
    ("family", "quantization"), [("llama-tied-biased", None), ("qwen2", "int8"), ("qwen2", "int4")]
)
def test_a_thread_invariant_engine_decodes_the_same_bits_on_one_thread(family, quantization):
    """What lets a server shrink its OpenMP team while a core is busy elsewhere (threads.governed):
    an engine that says it is thread invariant decodes the same bits on 1 thread as on 2."""
    if quantization and not linear_kernels.int8_linear_available():
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2 (the int8 and int4 linear kernels)")
    lm = LeanCausalLM.from_hf(build(family).to(torch.bfloat16), batch_invariant=True, quantization=quantization)
    assert lm.thread_invariant
    seq, chunks = tokens(40, seed=5), [12] + [5] * 4 + [1] * 8
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = decode(lm, seq, chunks, traffic=3)
        torch.set_num_threads(1)
        assert_same(decode(lm, seq, chunks, traffic=3), two)
    finally:
        torch.set_num_threads(before)


def test_engines_whose_bits_could_follow_the_thread_count_are_not_thread_invariant():
    assert not LeanCausalLM.from_hf(build("llama-tied-biased").to(torch.bfloat16)).thread_invariant  # oneDNN linears
    # Qwen3's q/k norms keep a layer out of one C call: torch ops between the kernels
    assert not LeanCausalLM.from_hf(build("qwen3").to(torch.bfloat16), batch_invariant=True).thread_invariant
