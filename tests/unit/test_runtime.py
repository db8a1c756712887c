"""The lean runtime (backends/runtime: KV cache pool + LeanCausalLM) against transformers.

Tiny random models of each family run in float32; every expectation comes from transformers'
own forward on the same weights (a full forward over the tokens so far), never from constants.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
)

from backends.runtime import lean_lm
from backends.runtime.kv_cache import KVCacheFullError, KVCachePool, SequenceError
from backends.runtime.lean_lm import LeanCausalLM, Row, UnsupportedArchitecture, unsupported_reason
from tests.fixtures.lean_models import FAMILIES, TINY, VOCAB, build, randomize, tokens

ROPE_THETA = 10000.0

ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    # dynamic and longrope change frequencies past 16 / 20 positions: the prompts below go past
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.3 * i for i in range(8)],
        "original_max_position_embeddings": 20,
    },
}


def rope_model(kind: str) -> torch.nn.Module:
    params = {"rope_theta": ROPE_THETA, **ROPES[kind]}
    tiny = {**TINY, "max_position_embeddings": 16 if kind == "dynamic" else 64}
    torch.manual_seed(0)
    return randomize(LlamaForCausalLM(LlamaConfig(**tiny, head_dim=16, rope_parameters=params)))


def reference(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """transformers' logits [len(tokens), vocab] from a full forward (no cache)."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.fixture(
    scope="module",
    params=[(f, inv) for f in FAMILIES for inv in (False, True)],
    ids=lambda p: f"{p[0]}-{'invariant' if p[1] else 'sdpa'}",
)
def family(request):
    """Each family on both attention paths: SDPA and the batch-invariant kernel."""
    name, invariant = request.param
    hf = build(name)
    return hf, LeanCausalLM.from_hf(hf, batch_invariant=invariant)


def test_prefill_decode_verify_match_transformers(family):
    hf, lm = family
    pool = lm.new_pool(capacity_tokens=256)
    pool.admit("s", 64)
    seq = tokens(13, seed=1)
    out = lm.forward(pool, [Row("s", seq)], logits_rows=13)
    assert_close(out.logits[0], reference(hf, seq))
    for step in range(3):  # plain decode steps
        seq.append(tokens(1, seed=10 + step)[0])
        out = lm.forward(pool, [Row("s", seq[-1:])])
        assert_close(out.logits[0], reference(hf, seq)[-1:])
    for step in range(2):  # verify steps: k + 1 = 5 tokens, all their logits
        seq += tokens(5, seed=20 + step)
        out = lm.forward(pool, [Row("s", seq[-5:])], logits_rows=5)
        assert_close(out.logits[0], reference(hf, seq)[-5:])
    assert pool.length("s") == len(seq)


def test_greedy_tokens_match_generate(family):
    hf, lm = family
    prompt = tokens(9, seed=3)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        expected = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    pool = lm.new_pool(capacity_tokens=64)
    pool.admit(0, 32)
    got, new = [], prompt
    for _ in range(10):
        new = [int(lm.forward(pool, [Row(0, new)]).logits[0][-1].argmax())]
        got += new
    assert got == expected


def test_ragged_batch_equals_one_row_at_a_time(family):
    hf, lm = family
    prompts = {s: tokens(5 + 3 * s, seed=40 + s) for s in range(4)}
    follow = {0: tokens(1, 50), 1: tokens(4, 51), 2: tokens(1, 52), 3: tokens(3, 53)}
    batched, alone = lm.new_pool(capacity_tokens=256), lm.new_pool(capacity_tokens=256)
    for s in prompts:
        batched.admit(s, 32)
        alone.admit(s, 32)
    rows = [Row(s, p) for s, p in prompts.items()]
    first = lm.forward(batched, rows, logits_rows=[len(p) for p in prompts.values()])
    second = lm.forward(batched, [Row(s, f) for s, f in follow.items()], logits_rows=[1, 4, 1, 3])
    for s in prompts:
        one = lm.forward(alone, [Row(s, prompts[s])], logits_rows=len(prompts[s])).logits[0]
        two = lm.forward(alone, [Row(s, follow[s])], logits_rows=len(follow[s])).logits[0]
        torch.testing.assert_close(first.logits[s], one, atol=1e-5, rtol=0)
        torch.testing.assert_close(second.logits[s], two, atol=1e-5, rtol=0)
        assert_close(second.logits[s], reference(hf, prompts[s] + follow[s])[-len(follow[s]) :])
        assert batched.length(s) == len(prompts[s]) + len(follow[s])


def test_scattered_blocks_are_gathered():
    hf = build("llama")
    lm = LeanCausalLM.from_hf(hf)
    pool = lm.new_pool(capacity_tokens=8 * 4, block_size=4)
    for s, size in enumerate([8, 4, 8, 4, 8]):  # blocks 0-1, 2, 3-4, 5, 6-7
        pool.admit(s, size)
    pool.release(1)
    pool.release(3)
    pool.admit("x", 8)  # the only free blocks are 2 and 5: no run of two
    assert pool.contiguous_start("x") is None and pool.contiguous_start(0) == 0
    seq, other = tokens(6, 60), tokens(5, 61)
    out = lm.forward(pool, [Row("x", seq), Row(0, other)], logits_rows=[6, 5])
    assert_close(out.logits[0], reference(hf, seq))
    assert_close(out.logits[1], reference(hf, other))
    seq.append(7)
    out = lm.forward(pool, [Row("x", seq[-1:])])
    assert_close(out.logits[0], reference(hf, seq)[-1:])


def test_rollback_then_continue_equals_fresh_run(family):
    hf, lm = family
    pool = lm.new_pool(capacity_tokens=128)
    pool.admit("s", 40)
    prompt, drafts = tokens(10, 70), tokens(4, 71)
    lm.forward(pool, [Row("s", prompt)])
    lm.forward(pool, [Row("s", drafts)], logits_rows=4)
    pool.truncate("s", len(prompt) + 2)  # two drafts accepted, the rest rolled back
    kept = prompt + drafts[:2]
    out = lm.forward(pool, [Row("s", [5, 9])], logits_rows=2)
    assert_close(out.logits[0], reference(hf, kept + [5, 9])[-2:])


def test_tree_mask_and_positions():
    hf = build("qwen3")
    lm = LeanCausalLM.from_hf(hf)
    pool = lm.new_pool(capacity_tokens=64)
    pool.admit("t", 32)
    prefix = tokens(8, 80)
    lm.forward(pool, [Row("t", prefix)])
    # a root with two children: [a, b1, b2], b1 and b2 both follow a
    a, b1, b2 = 11, 22, 33
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    at = len(prefix)
    out = lm.forward(pool, [Row("t", [a, b1, b2], mask, torch.tensor([at, at + 1, at + 1]))], logits_rows=3)
    assert_close(out.logits[0][:2], reference(hf, prefix + [a, b1])[-2:])
    assert_close(out.logits[0][2:], reference(hf, prefix + [a, b2])[-1:])


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_tree_fed_a_level_at_a_time_masks_cached_nodes(batch_invariant):
    """A mask over the cached tokens too ([n, cached + n]): a node of a later level sees its
    ancestor among the cached nodes and not the ancestor's sibling (a drafter's tree)."""
    hf = build("llama")
    lm = LeanCausalLM.from_hf(hf, batch_invariant=batch_invariant)
    pool = lm.new_pool(capacity_tokens=64)
    pool.admit("t", 32)
    prefix = tokens(8, 81)
    at = len(prefix)
    lm.forward(pool, [Row("t", prefix)])
    a, x, b = 11, 44, 22  # level 1: siblings a and x; level 2: b, a's child
    lm.forward(pool, [Row("t", [a, x], torch.eye(2, dtype=torch.bool), torch.tensor([at, at]))], logits_rows=2)
    seen = torch.tensor([[1] * at + [1, 0, 1]], dtype=torch.bool)
    out = lm.forward(pool, [Row("t", [b], seen, torch.tensor([at + 1]))])
    assert_close(out.logits[0], reference(hf, prefix + [a, b])[-1:])
    with pytest.raises(SequenceError, match=r"mask \(1, 5\) for 1 new tokens after 11 cached"):
        lm.forward(pool, [Row("t", [b], torch.ones(1, 5, dtype=torch.bool))])


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_scaling_matches_transformers(kind):
    hf = rope_model(kind)
    lm = LeanCausalLM.from_hf(hf)
    pool = lm.new_pool(capacity_tokens=64)
    pool.admit(0, 40)
    seq = tokens(30, 90)  # past 16 / 20 positions: dynamic and longrope switch frequencies
    out = lm.forward(pool, [Row(0, seq)], logits_rows=30)
    assert_close(out.logits[0], reference(hf, seq))
    if kind not in ("dynamic", "longrope"):  # their frequencies depend on the length of the call
        seq += [3, 4]
        out = lm.forward(pool, [Row(0, seq[-2:])], logits_rows=2)
        assert_close(out.logits[0], reference(hf, seq)[-2:])


def test_hidden_state_numbering_matches_transformers(family):
    hf, lm = family
    seq = tokens(7, 100)
    with torch.no_grad():
        ref = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
    pool = lm.new_pool(capacity_tokens=32)
    pool.admit(0, 16)
    ids = list(range(lm.num_layers + 1)) + [-1]
    out = lm.forward(pool, [Row(0, seq)], hidden_layers=ids)
    for i in ids:
        torch.testing.assert_close(out.hidden[0][i], ref[i][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.hidden[0][-1], out.hidden[0][lm.num_layers])


@pytest.mark.parametrize("matmul", ["native", "float32"])
def test_bfloat16_runs_close_to_transformers(matmul, monkeypatch):
    """bf16 weights, on this CPU's matmul and on the float32 one of CPUs without oneDNN bf16."""
    if matmul == "float32":  # as on an AVX2 CPU: no packed bf16 kernel, no oneDNN bf16
        monkeypatch.setattr(lean_lm.linear_kernels, "packed_linear_available", lambda: False)
        monkeypatch.setattr(lean_lm, "bf16_matmul_dtype", lambda: torch.float32)
    hf = build("llama").to(torch.bfloat16)
    lm = LeanCausalLM.from_hf(hf)
    pool = lm.new_pool(capacity_tokens=64)
    pool.admit(0, 32)
    seq = tokens(12, 110)
    ours = lm.forward(pool, [Row(0, seq)], logits_rows=12).logits[0]
    assert ours.dtype == torch.bfloat16
    ref = reference(hf, seq)
    assert torch.nn.functional.cosine_similarity(ours.float(), ref.float(), dim=-1).min() > 0.99


# -- the pool -------------------------------------------------------------------------------


def test_pool_admission_release_and_refusal():
    pool = KVCachePool(2, 2, 8, capacity_tokens=64, block_size=16, dtype=torch.float32)
    assert pool.capacity_tokens == 64 and pool.reserved_tokens == 0
    pool.admit("a", 40)  # three blocks
    assert pool.has("a") and pool.reserved("a") == 48 and pool.reserved_tokens == 48
    with pytest.raises(KVCacheFullError) as err:
        pool.admit("b", 20)
    message = str(err.value)
    assert "20 tokens" in message and "48 of 64" in message
    assert "max_tokens" in message and "kv_cache_memory_gb" in message
    assert isinstance(err.value, SequenceError) and isinstance(err.value, ValueError)
    assert not pool.has("b") and pool.num_sequences == 1
    pool.admit("c", 16)  # exactly the last block: what is free is usable
    pool.release("a")
    pool.release("a")  # idempotent
    assert pool.reserved_tokens == 16 and pool.num_sequences == 1
    pool.admit("b", 48)
    assert pool.contiguous_start("b") == 0  # the released run is handed out whole
    pool.release("b")
    pool.release("c")
    assert pool.reserved_tokens == 0 and pool.num_sequences == 0 and pool.free_tokens == 64


def test_pool_sized_by_memory():
    pool = KVCachePool(4, 2, 8, memory_gb=1 / 1024, block_size=16, dtype=torch.bfloat16)
    per_token = 2 * 4 * 2 * 8 * 2
    assert pool.bytes_per_token == per_token
    assert pool.capacity_tokens == (2**20 // per_token) // 16 * 16
    assert pool.kv.numel() * 2 == pool.capacity_tokens * per_token


def test_pool_truncate_and_errors():
    pool = KVCachePool(1, 1, 4, capacity_tokens=32, block_size=8, dtype=torch.float32)
    pool.admit(1, 10)
    assert pool.extend(1, 6) == 0 and pool.length(1) == 6
    pool.truncate(1, 2)
    assert pool.length(1) == 2
    with pytest.raises(SequenceError):
        pool.truncate(1, 3)  # cannot grow by truncating
    with pytest.raises(SequenceError):
        pool.extend(1, 15)  # 2 + 15 > 16 reserved
    with pytest.raises(SequenceError):
        pool.admit(1, 4)  # already admitted
    with pytest.raises(SequenceError):
        pool.length("unknown")


def test_blocks_that_span_a_run_out_of_order_are_not_taken_for_one():
    """Blocks [0, 2] then grown by [3, 1] (the block after its last first) cover slots 0..15,
    but not in token order."""
    pool = KVCachePool(1, 1, 4, capacity_tokens=16, block_size=4, dtype=torch.float32)
    for seq_id in "wxyz":
        pool.admit(seq_id, 4)
    pool.release("w")
    pool.release("y")
    pool.admit("a", 8)
    assert pool.blocks("a") == [0, 2]
    pool.release("x")
    pool.release("z")
    pool.grow("a", 16)
    assert pool.blocks("a") == [0, 2, 3, 1] and pool.contiguous_start("a") is None
    assert pool.slots("a").tolist() == [*range(0, 4), *range(8, 12), *range(12, 16), *range(4, 8)]


def test_pool_grow_keeps_the_cached_tokens_and_refuses_past_capacity():
    """A drafter's reservation grows as its sequence does; the tokens already cached keep their
    slots, and the row reads the same keys whether its blocks stay one run or not."""
    hf = build("llama")
    lm = LeanCausalLM.from_hf(hf)
    pool = lm.new_pool(capacity_tokens=64, block_size=8)
    pool.admit("a", 8)
    pool.admit("b", 8)  # takes the blocks right after a's: a's next blocks cannot follow on
    seq = tokens(20, seed=120)
    lm.forward(pool, [Row("a", seq[:8])])
    before = pool.slots("a")[:8].clone()
    pool.grow("a", 20)
    assert pool.reserved("a") == 24 and torch.equal(pool.slots("a")[:8], before)
    assert pool.contiguous_start("a") is None
    out = lm.forward(pool, [Row("a", seq[8:])], logits_rows=12)
    assert_close(out.logits[0], reference(hf, seq)[8:])
    pool.grow("a", 10)  # already holds more: nothing to do
    assert pool.reserved("a") == 24
    with pytest.raises(KVCacheFullError):
        pool.grow("b", 65)


def test_step_over_reservation_is_refused_and_leaves_pool_unchanged(family):
    _, lm = family
    pool = lm.new_pool(capacity_tokens=64, block_size=16)
    pool.admit("a", 16)
    pool.admit("b", 16)
    lm.forward(pool, [Row("a", tokens(10, 120))])
    with pytest.raises(SequenceError, match="reservation"):
        lm.forward(pool, [Row("b", [1, 2]), Row("a", tokens(7, 121))])
    assert pool.length("a") == 10 and pool.length("b") == 0


# -- what the runtime refuses ---------------------------------------------------------------


def test_unsupported_architectures_are_refused():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB))
    with pytest.raises(UnsupportedArchitecture, match="gpt2"):
        LeanCausalLM.from_hf(gpt2)
    sliding = MistralForCausalLM(MistralConfig(**TINY, sliding_window=32))
    with pytest.raises(UnsupportedArchitecture, match="sliding"):
        LeanCausalLM.from_hf(sliding)
    qwen_sliding = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=32, max_window_layers=0)
    assert "sliding" in unsupported_reason(qwen_sliding)
    assert "hidden_act" in unsupported_reason(LlamaConfig(**TINY, hidden_act="gelu"))
    assert unsupported_reason(LlamaConfig(**TINY)) is None
    assert unsupported_reason(Qwen2Config(**TINY)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_checkpoint_read_directly_gives_the_weights_transformers_loads(name, dtype, tmp_path):
    """checkpoint_modules (the lean runtime reading safetensors itself) makes the runtime of
    the weights transformers' from_pretrained loads, bit for bit, from a sharded checkpoint
    with a tensor past its layers (an MTP module's: ignored, as transformers ignores it) and
    a stray safetensors beside it (not the model's)."""
    from safetensors.torch import save_file

    from backends.runtime.lean_lm import checkpoint_modules
    from backends.runtime.model_store import load_causal_lm, load_config

    build(name).save_pretrained(tmp_path, max_shard_size="40KB")
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    assert len(set(index["weight_map"].values())) > 1
    save_file({"model.layers.2.mlp.up_proj.weight": torch.ones(96, 64)}, tmp_path / "extra-layer.safetensors")
    index["weight_map"]["model.layers.2.mlp.up_proj.weight"] = "extra-layer.safetensors"
    index_file.write_text(json.dumps(index))
    save_file({"model.norm.weight": torch.zeros(64)}, tmp_path / "stray.safetensors")
    want = LeanCausalLM.from_hf(load_causal_lm(tmp_path, str(dtype).removeprefix("torch.")))
    got = LeanCausalLM.from_hf(checkpoint_modules(tmp_path, load_config(tmp_path), dtype))
    assert got.num_layers == want.num_layers == TINY["num_hidden_layers"]
    assert len(got.tensors()) == len(want.tensors())
    for a, b in zip(got.tensors(), want.tensors()):
        a, b = (t.to_dense() if t.is_mkldnn else t for t in (a, b))  # oneDNN's prepacked float32 weights
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_checkpoint_the_runtime_cannot_read_is_refused_by_name(tmp_path):
    """The caller (TargetRunner, draft_model) then loads it through transformers."""
    from safetensors.torch import load_file, save_file

    from backends.runtime.lean_lm import checkpoint_modules
    from backends.runtime.model_store import load_config

    build("llama").save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in state.items()}, tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedArchitecture, match="missing model.embed_tokens.weight"):
        checkpoint_modules(tmp_path, load_config(tmp_path), torch.float32)
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB)).save_pretrained(gpt2)
    with pytest.raises(UnsupportedArchitecture, match="gpt2"):
        checkpoint_modules(gpt2, load_config(gpt2), torch.float32)


def test_long_blocks_use_unfolded_attention(monkeypatch):
    """Rows with more new tokens than FOLD_MAX_TOKENS take SDPA's own GQA path."""
    from backends.runtime import lean_lm

    monkeypatch.setattr(lean_lm, "FOLD_MAX_TOKENS", 2)
    hf = build("qwen2")
    lm = LeanCausalLM.from_hf(hf)
    pool = lm.new_pool(capacity_tokens=128)
    prompts = {s: tokens(6 + s, seed=130 + s) for s in range(3)}
    for s in prompts:
        pool.admit(s, 32)
    out = lm.forward(pool, [Row(0, prompts[0])], logits_rows=6)  # from position 0: causal flag
    assert_close(out.logits[0], reference(hf, prompts[0]))
    out = lm.forward(pool, [Row(s, prompts[s]) for s in (1, 2)], logits_rows=[7, 8])
    follow = tokens(5, seed=140)
    out = lm.forward(pool, [Row(s, follow) for s in prompts], logits_rows=5)  # cached, ragged lengths
    for s in prompts:
        assert_close(out.logits[s], reference(hf, prompts[s] + follow)[-5:])


def test_smollm2_matches_transformers(smollm2_dir):
    """The real SmolLM2-135M weights (slow: loads them), float32: prefill, decode, verify, and a
    ragged batch of two sequences, against transformers' full forward."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    lm = LeanCausalLM.from_hf(hf)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, hf.config.vocab_size, (40,), generator=gen).tolist() for _ in range(2)]
    refs = [reference(hf, s) for s in seqs]
    pool = lm.new_pool(capacity_tokens=256)
    for s in range(2):
        pool.admit(s, 64)

    def check(ours: torch.Tensor, ref: torch.Tensor) -> None:
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-5)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))

    out = lm.forward(pool, [Row(0, seqs[0][:30]), Row(1, seqs[1][:27])], logits_rows=[30, 27])
    check(out.logits[0], refs[0][:30])
    check(out.logits[1], refs[1][:27])
    # row 0 decodes one token a step while row 1 verifies 5, then 3 tokens
    for i, (a, b) in zip((30, 31), ((27, 32), (32, 35))):
        out = lm.forward(pool, [Row(0, seqs[0][i : i + 1]), Row(1, seqs[1][a:b])], logits_rows=[1, b - a])
        check(out.logits[0], refs[0][i : i + 1])
        check(out.logits[1], refs[1][a:b])


def test_pool_hands_out_the_smallest_fitting_run():
    pool = KVCachePool(1, 1, 4, capacity_tokens=10 * 4, block_size=4, dtype=torch.float32)
    for s, blocks in enumerate([3, 1, 2, 1, 3]):  # blocks 0-2, 3, 4-5, 6, 7-9
        pool.admit(s, blocks * 4)
    pool.release(0)  # a hole of 3 blocks at 0
    pool.release(2)  # a hole of 2 blocks at 4
    pool.admit("x", 8)
    assert pool.blocks("x") == [4, 5] and pool.contiguous_start("x") == 16
    pool.admit("y", 12)
    assert pool.blocks("y") == [0, 1, 2]


def _walk_free_list(free: list[int], need: int) -> list[int]:
    """The allocation rule spelled out over a sorted list of free blocks: the first ``need`` of
    the smallest run that holds them (the lowest on a tie), else the lowest ``need``."""
    runs, first = [], 0
    for i in range(1, len(free) + 1):
        if i == len(free) or free[i] != free[i - 1] + 1:
            runs.append(free[first:i])
            first = i
    fitting = [run for run in runs if len(run) >= need]
    return min(fitting, key=len)[:need] if fitting else free[:need]


def test_pool_allocation_follows_the_free_list_rule_under_churn():
    """The pool keeps its free blocks as runs (time per admission in runs, not blocks): over
    random admissions, growths and releases it hands out what the rule over a plain sorted list
    of free blocks would, block for block (a growth first takes the free blocks right after the
    sequence's last)."""
    import itertools
    import random

    rng = random.Random(0)
    pool = KVCachePool(1, 1, 4, capacity_tokens=200 * 4, block_size=4, dtype=torch.float32)
    free, held = list(range(200)), {}
    for step in range(3000):
        if held and (rng.random() < 0.45 or len(free) < 12):
            seq_id = rng.choice(sorted(held))
            pool.release(seq_id)
            free = sorted(free + held.pop(seq_id))
            continue
        need = rng.randint(1, 12)
        if held and rng.random() < 0.2:  # grow a running sequence instead
            seq_id = rng.choice(sorted(held))
            after = range(held[seq_id][-1] + 1, held[seq_id][-1] + 1 + need)
            follow = list(itertools.takewhile(set(free).__contains__, after))
            rest = [b for b in free if b not in follow]
            expected = follow + (_walk_free_list(rest, need - len(follow)) if need > len(follow) else [])
            pool.grow(seq_id, (len(held[seq_id]) + need) * 4)
            held[seq_id] += expected
        else:
            expected = _walk_free_list(free, need)
            pool.admit(step, need * 4)
            held[step] = expected
            seq_id = step
        taken = set(expected)
        free = [b for b in free if b not in taken]
        assert pool.blocks(seq_id) == held[seq_id], step
        assert pool.free_tokens == len(free) * 4
