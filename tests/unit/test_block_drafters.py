"""DFlash and DSpark block drafters: the published checkpoint layouts (tiny synthetic ones,
written independently of the loader), refusals naming the field/key/size, drafts equal to
a plain re-implementation of the published algorithms, incremental context and rollback,
batching, draft probabilities and the writer (served: tests/e2e/test_block_drafters_server.py)."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from backends.config import SpeculativeConfig
from backends.methods.block_checkpoint import BlockCheckpointError, default_config, load_head, save_head
from backends.methods.dflash import DFlashHead, DFlashProposer, load_dflash
from backends.methods.dspark import DSparkHead, DSparkProposer
from backends.methods.dspark import default_config as dspark_default_config
from backends.runtime import lean_lm, linear_kernels
from backends.serving.proposer import DraftRequest, build_proposer
from tests.fixtures.helpers import check_ragged_batches, request, target_hidden
from tests.fixtures.synthetic_blocks import write_dflash, write_dspark
from tests.fixtures.synthetic_checkpoints import edit_state, refusal_test, save_checkpoint, write_eagle1

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The", "for i in range(10):\n    print(i"]
MASK, V, H = 383, 384, 64
# name -> (writer, options, expected verifier layer ids)
VARIANTS = {
    "dflash": (write_dflash, {}, (1, 2)),
    "dflash-midlayer-default-ids-bin": (
        write_dflash,
        {"num_layers": 1, "target_layer_ids": None, "first_layer": "midlayer.", "fmt": "bin"},
        (2,),
    ),
    "dflash-causal-sliding": (write_dflash, {"causal": True, "sliding_window": 3, "block_size": 5}, (1, 2)),
    "dflash-draft-vocab": (write_dflash, {"draft_vocab_size": 200, "target_layer_ids": (1, -1)}, (2, 0)),
    "dspark-vanilla": (write_dspark, {}, (1, 2)),
    "dspark-gated": (write_dspark, {"markov_head_type": "gated", "confidence_with_markov": False}, (1, 2)),
    "dspark-rnn": (write_dspark, {"markov_head_type": "rnn", "block_size": 3}, (1, 2)),
    "dspark-no-markov": (write_dspark, {"markov_rank": 0, "confidence": False}, (1, 2)),
    "dspark-speculators": (write_dspark, {"style": "speculators", "target_layer_ids": (1,)}, (2,)),
    "dspark-hybrid-anchor": (
        write_dspark,
        {"style": "hybrid", "sample_from_anchor": True, "markov_head_type": "gated"},
        (1, 2),
    ),
}


def _head_class(name: str):
    return DSparkHead if name.startswith("dspark") else DFlashHead


def _proposer_class(name: str):
    return DSparkProposer if name.startswith("dspark") else DFlashProposer


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model_dir):
    """name -> (directory, the state dict written)."""
    root = tmp_path_factory.mktemp("block-checkpoints")
    return {
        name: (root / name, writer(root / name, tiny_model_dir, **opts)) for name, (writer, opts, _) in VARIANTS.items()
    }


@pytest.fixture(scope="module")
def heads(checkpoints, target):
    return {name: load_head(_head_class(name), path, target, "float32") for name, (path, _) in checkpoints.items()}


# ---------------------------------------------------------------------------- the reference


def _rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, positions, theta):
    """Neox-style rotary embedding of x [T, heads, d] at positions [T]."""
    d = x.shape[-1]
    freqs = positions[:, None].double() / theta ** (torch.arange(0, d, 2).double() / d)
    cos, sin = (f(torch.cat([freqs, freqs], -1)).float()[:, None] for f in (torch.cos, torch.sin))
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def reference_block(cfg: dict, s: dict, hidden: torch.Tensor, anchor: int) -> torch.Tensor:
    """The published DFlash backbone, from config.json and the written tensors: the normed
    outputs [B, H] of the block [anchor, MASK...] at positions p.., p = len(hidden)."""
    s = {k.replace("midlayer.", "layers.0."): v for k, v in s.items()}
    nested = cfg.get("dflash_config") or {}
    block = cfg.get("block_size") or nested["block_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    c = len(hidden)
    ctx = _rms(F.linear(hidden.flatten(1), s["fc.weight"]), s["hidden_norm.weight"])
    x = s["embed_tokens.weight"][torch.tensor([anchor] + [MASK] * (block - 1))]
    qpos = torch.arange(c, c + block)
    kpos = torch.cat([torch.arange(c), qpos])
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"layers.{i}."
        h = _rms(x, s[p + "input_layernorm.weight"])
        q = _rope(
            _rms(F.linear(h, s[p + "self_attn.q_proj.weight"]).view(block, nh, hd), s[p + "self_attn.q_norm.weight"]),
            qpos,
            cfg["rope_theta"],
        )
        kin = torch.cat([ctx, h])  # the context is projected without input_layernorm
        k = _rope(
            _rms(F.linear(kin, s[p + "self_attn.k_proj.weight"]).view(-1, nkv, hd), s[p + "self_attn.k_norm.weight"]),
            kpos,
            cfg["rope_theta"],
        )
        v = F.linear(kin, s[p + "self_attn.v_proj.weight"]).view(-1, nkv, hd)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
        visible = torch.ones(block, c + block, dtype=torch.bool)
        if nested.get("causal") or kind == "sliding_attention":
            visible &= kpos[None] <= qpos[:, None]
        if kind == "sliding_attention":
            visible &= qpos[:, None] - kpos[None] < cfg["sliding_window"]
        attn = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        x = x + F.linear(
            torch.einsum("hqk,khd->qhd", attn, v).reshape(block, nh * hd), s[p + "self_attn.o_proj.weight"]
        )
        h = _rms(x, s[p + "post_attention_layernorm.weight"])
        x = x + F.linear(
            F.silu(F.linear(h, s[p + "mlp.gate_proj.weight"])) * F.linear(h, s[p + "mlp.up_proj.weight"]),
            s[p + "mlp.down_proj.weight"],
        )
    return _rms(x, s["norm.weight"])


def reference_drafts(name: str, cfg: dict, s: dict, hidden: torch.Tensor, anchor: int, k: int) -> list[int]:
    """Greedy drafts of the published algorithms. DFlash: argmax of slots 1..B-1. DSpark:
    base logits of the convention's slots plus the Markov bias of the previous token."""
    out = reference_block(cfg, s, hidden, anchor)
    if "d2t" in s:
        to_target = torch.arange(len(s["d2t"])) + s["d2t"]
    else:
        to_target = torch.arange(V)
    if name.startswith("dflash"):
        return to_target[F.linear(out[1:], s["lm_head.weight"]).argmax(-1)][:k].tolist()
    nested = cfg.get("dflash_config") or {}
    anchor_slots = cfg.get("sample_from_anchor", nested.get("sample_from_anchor", True))
    kind = cfg.get("markov_head_type") or nested.get("markov_head_type")
    rank = cfg.get("markov_rank", nested.get("markov_rank", 0))
    prev, state, drafts = anchor, torch.zeros(rank), []
    for slot in range(0 if anchor_slots else 1, len(out)):
        logits = F.linear(out[slot], s["lm_head.weight"])
        if rank:
            e = s["markov_head.markov_w1.weight"][prev]
            w2 = s["markov_head.markov_w2.weight"]
            if kind == "vanilla":
                logits = logits + w2 @ e
            elif kind == "gated":
                gate = torch.sigmoid(
                    F.linear(
                        torch.cat([out[slot], e]), s["markov_head.gate_proj.weight"], s["markov_head.gate_proj.bias"]
                    )
                )
                logits = logits + w2 @ (gate * e)
            else:
                z = F.linear(
                    torch.cat([state, e, out[slot]]),
                    s["markov_head.joint_proj.weight"],
                    s["markov_head.joint_proj.bias"],
                )
                g, cand, o = torch.sigmoid(z[:rank]), torch.tanh(z[rank : 2 * rank]), z[2 * rank :]
                state = g * state + (1 - g) * cand
                logits = logits + w2 @ torch.tanh(o)
        prev = int(logits.argmax())
        drafts.append(prev)
    return drafts[:k]


def _reference_inputs(name, checkpoints, target_weights):
    from backends.methods.head_checkpoint import read_config

    path, written = checkpoints[name]
    cfg = read_config(path)  # speculators flattened as vLLM does (what the format means)
    s = {
        "embed_tokens.weight": target_weights["model.embed_tokens.weight"],
        "lm_head.weight": target_weights["lm_head.weight"],
        **written,
    }
    return cfg, s


# ---------------------------------------------------------------------------- loading


@pytest.mark.parametrize("name", VARIANTS)
def test_published_layouts_load(name, checkpoints, heads, target_weights):
    path, written = checkpoints[name]
    head = heads[name]
    assert head.layout == name.split("-")[0]
    assert head.hidden_layer_ids == VARIANTS[name][2]
    loaded = head.state_dict()
    for key, value in written.items():
        if key != "t2d":
            own = loaded[key.replace("midlayer.", "layers.0.")]
            torch.testing.assert_close(own, value.to(own.dtype))
    torch.testing.assert_close(head.embed_tokens.weight, target_weights["model.embed_tokens.weight"])
    if "lm_head.weight" not in written:
        torch.testing.assert_close(head.lm_head.weight, target_weights["lm_head.weight"])
    drafts_per_pass = {"dflash": head.block_size - 1, "dspark": head.block_size}[head.layout]
    if name == "dspark-speculators":
        drafts_per_pass -= 1  # the fill-in convention: slot 0 is not a draft
    assert len(head.draft_slots) == drafts_per_pass


@pytest.mark.parametrize("name", ["dflash", "dflash-draft-vocab", "dspark-rnn"])
def test_saved_head_is_the_published_layout(name, heads, target, tmp_path, checkpoints):
    head = heads[name]
    out = save_head(head, tmp_path / name, dtype="float32")
    from safetensors.torch import load_file

    saved = load_file(out / "model.safetensors")
    written = {k.replace("midlayer.", "layers.0."): v for k, v in checkpoints[name][1].items() if k != "t2d"}
    assert set(saved) == set(written)  # DFlash without embedding / LM head, DSpark with them
    again = load_head(_head_class(name), out, target, "float32")
    for key, value in head.state_dict().items():
        torch.testing.assert_close(again.state_dict()[key], value)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_new_head_from_a_config_dict(kind, target, tmp_path):
    """What a trainer does: a config for the target, a head built from it, the target's
    embedding (and LM head) copied in, the head written and loaded back by the server's loader."""
    make = default_config if kind == "dflash" else dspark_default_config
    cfg = make(target, mask_token_id=MASK, block_size=4, num_hidden_layers=2)
    head = (DFlashHead if kind == "dflash" else DSparkHead)(cfg, target)
    head.take_target_weights(target)
    assert head.hidden_layer_ids == (2, 0)  # DFlash's default over 1..L-3 on a 2-layer target
    loaded = load_head(type(head), save_head(head, tmp_path / kind, dtype="float32"), target, "float32")
    assert loaded.layout == kind and loaded.block_size == 4
    torch.testing.assert_close(loaded.embed_tokens.weight, target.weight("embed"))


def test_layout_comes_from_the_config_not_the_name(tmp_path, tiny_model_dir, target):
    write_dflash(tmp_path / "org-dspark-b4", tiny_model_dir)
    write_dspark(tmp_path / "org-dflash-b4", tiny_model_dir)
    assert load_dflash(tmp_path / "org-dspark-b4", target).layout == "dflash"
    assert load_head(DSparkHead, tmp_path / "org-dflash-b4", target).layout == "dspark"
    with pytest.raises(
        BlockCheckpointError,
        match="method 'dflash' needs a DFlash checkpoint, but config.json describes a DSpark drafter",
    ):
        load_dflash(tmp_path / "org-dflash-b4", target)
    write_eagle1(tmp_path / "eagle", tiny_model_dir)
    with pytest.raises(BlockCheckpointError, match="has neither dflash_config nor a DFlash/DSpark architecture"):
        load_head(DSparkHead, tmp_path / "eagle", target)
    # An explicit method wins over the name; the proposer then loads by the config.
    config = SpeculativeConfig.from_json(
        {"method": "dflash", "model": str(tmp_path / "org-dspark-b4"), "num_speculative_tokens": 3},
        target_model=str(tiny_model_dir),
    )
    proposer = build_proposer(config, max_model_len=512, dtype="float32", target_model=tiny_model_dir)
    assert isinstance(proposer, DFlashProposer) and proposer.hidden_layer_ids == (1, 2)


REFUSALS = {
    "missing key": (
        "dflash",
        lambda s: edit_state(s, drop=["layers.1.self_attn.k_norm.weight"]),
        None,
        r"missing key 'layers\.1\.self_attn\.k_norm\.weight' \(expected shape \[16\]\)",
    ),
    "laguna output gate": (
        "dflash",
        lambda s: {**s, "layers.0.self_attn.g_proj.weight": torch.zeros(4, H)},
        None,
        r"unexpected key 'layers\.0\.self_attn\.g_proj\.weight' \(shape \[4, 64\]\)",
    ),
    "fc width": (
        "dflash",
        lambda s: {**s, "fc.weight": torch.zeros(H, 3 * H)},
        None,
        r"'fc\.weight' has shape \[64, 192\], expected \[64, 128\]",
    ),
    "markov vocabulary": (
        "dspark-vanilla",
        lambda s: {**s, "markov_head.markov_w1.weight": torch.zeros(V + 8, 8)},
        None,
        r"'markov_head\.markov_w1\.weight' has shape \[392, 8\], expected \[384, 8\]",
    ),
    "confidence width": (
        "dspark-vanilla",
        lambda s: {**s, "confidence_head.proj.weight": torch.zeros(1, H)},
        None,
        r"'confidence_head\.proj\.weight' has shape \[1, 64\], expected \[1, 72\]",
    ),
    "config vocab": (
        "dflash",
        None,
        {"vocab_size": 500},
        r"vocab_size 500 in config\.json, but the target's "
        r"vocabulary has 384 ids",
    ),
    "target layers": (
        "dflash",
        None,
        {"num_target_layers": 36},
        r"num_target_layers 36 in config\.json, but the target has 2 decoder layers",
    ),
    "layer id range": (
        "dflash",
        None,
        {"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [0, 2]}},
        r"target layer ids \[0, 2\] \(dflash_config\.target_layer_ids\) must be distinct layers of "
        r"the target, in \[-1, 1\]",
    ),
    "mask token": (
        "dflash",
        None,
        {"dflash_config": {"mask_token_id": 384, "target_layer_ids": [0, 1]}},
        r"mask_token_id=384 \(dflash_config\.mask_token_id\) must be a row of the target's embedding",
    ),
    "block size": ("dflash", None, {"block_size": 1}, r"block_size=1 in config\.json"),
    "anchor slots": (
        "dflash",
        None,
        {"sample_from_anchor": True},
        r"sample_from_anchor=true is DSpark's slot "
        r"convention",
    ),
    "swa flag": (
        "dflash",
        None,
        {"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [0, 1], "use_swa": True}},
        r"dflash_config\.use_swa=True is not supported",
    ),
    "domino": (
        "dflash",
        None,
        {"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [0, 1], "projector_type": "domino"}},
        r"dflash_config\.projector_type='domino' is not supported",
    ),
    "layer types": (
        "dflash",
        None,
        {"layer_types": ["full_attention"]},
        r"layer_types \['full_attention'\] must give one of .* for each of the 2 layers",
    ),
    "hidden size": ("dflash", None, {"hidden_size": 32}, r"hidden size is 64"),
    "markov kind": (
        "dspark-vanilla",
        None,
        {"markov_head_type": "fir"},
        r"markov_head_type='fir' is not one of \('vanilla', 'gated', 'rnn'\)",
    ),
    "ambiguous slots": (
        "dspark-hybrid-anchor",
        None,
        {
            "dflash_config": {
                "mask_token_id": MASK,
                "target_layer_ids": [0, 1],
                "projector_type": "dspark",
                "markov_rank": 8,
                "markov_head_type": "gated",
                "use_confidence_head": True,
                "confidence_head_with_markov": True,
                "shift_label": True,
            }
        },
        r"cannot tell which slot convention this DSpark checkpoint was trained with .* set hf_overrides "
        r"\{\"sample_from_anchor\": true\}",
    ),
    "conflicting slots": (
        "dspark-vanilla",
        None,
        {"sample_from_anchor": False, "dflash_config": {"sample_from_anchor": True}},
        r"sample_from_anchor is both true and false",
    ),
    "deepseek v4": (
        "dspark-vanilla",
        None,
        {"dspark_block_size": 5},
        r"config\.json has dspark_block_size: a DeepSeek-V4 drafter bundled in the target checkpoint",
    ),
}


test_checkpoints_that_do_not_fit_are_refused = refusal_test(
    REFUSALS, BlockCheckpointError, lambda path, target, name: load_head(_head_class(name), path, target)
)


def test_hf_overrides_settle_the_slot_convention(checkpoints, tiny_model_dir, target, tmp_path):
    path, written = checkpoints["dspark-hybrid-anchor"]
    config = json.loads((path / "config.json").read_text())
    del config["dflash_config"]["sample_from_anchor"]
    save_checkpoint(tmp_path / "hybrid", config, written, "safetensors")
    spec = {
        "method": "dspark",
        "model": str(tmp_path / "hybrid"),
        "num_speculative_tokens": 4,
        "hf_overrides": {"sample_from_anchor": False},
    }
    proposer = build_proposer(
        SpeculativeConfig.from_json(spec, target_model=str(tiny_model_dir)),
        max_model_len=512,
        target_model=tiny_model_dir,
    )
    assert not proposer.head.sample_from_anchor and list(proposer.head.draft_slots) == [1, 2, 3]


def test_k_and_block_size(checkpoints, tiny_model_dir, runner, prompt_ids):
    """vLLM's rule k >= dspark_block_size belongs to the DeepSeek-V4 drafter's config key
    (backends/config/speculative.py); a Qwen3DSparkModel checkpoint takes any k, capped by its slots."""
    from backends.config import SpeculativeConfigError

    target = str(tiny_model_dir)
    with pytest.raises(SpeculativeConfigError, match=r"num_speculative_tokens >= dspark_block_size \(5\); got 3"):
        SpeculativeConfig.from_json(
            {
                "method": "dspark",
                "model": target,
                "num_speculative_tokens": 3,
                "hf_overrides": {"dspark_block_size": 5},
            },
            target_model=target,
        )
    path = str(checkpoints["dspark-vanilla"][0])
    for k, expected in ((2, 2), (9, 4)):
        config = SpeculativeConfig.from_json({"model": path, "num_speculative_tokens": k}, target_model=target)
        assert config.method == "dspark" and config.parallel_drafting
        proposer = build_proposer(config, max_model_len=512, dtype="float32", target_model=tiny_model_dir)
        draft = proposer.propose([request(runner, proposer.head, 1, prompt_ids[0], k)])[0]
        assert len(draft.token_ids) == expected


# ---------------------------------------------------------------------------- drafting


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_drafts_follow_the_published_algorithm(name, heads, checkpoints, target_weights, runner, prompt_ids):
    head = heads[name]
    cfg, s = _reference_inputs(name, checkpoints, target_weights)
    proposer = _proposer_class(name)(head, 512)
    for seq_id, ids in enumerate(prompt_ids):
        req = request(runner, head, seq_id, ids, 8)
        draft = proposer.propose([req])[0]
        assert draft.probs is None
        assert draft.token_ids == reference_drafts(name, cfg, s, req.hidden_states, ids[-1], 8)
        assert len(draft.token_ids) == len(head.draft_slots)
        # fewer drafts asked: the block still runs whole, only fewer slots get logits
        fewer = proposer.propose([request(runner, head, seq_id + 10, ids, 2)])[0]
        assert fewer.token_ids == draft.token_ids[:2]
        # The context holds one entry per target position, 0 .. n-2.
        assert proposer.pool.length(seq_id) == len(ids) - 1  # the context: positions 0 .. n-2


@pytest.mark.parametrize(
    "name,path", [("dflash-causal-sliding", "sdpa"), ("dspark-rnn", "sdpa"), ("dflash-causal-sliding", "triton")]
)
def test_the_other_paths_draft_the_same(
    name, path, heads, checkpoints, target_weights, runner, prompt_ids, monkeypatch
):
    """The head's layers on the runtime's other paths: SDPA (where the batch-invariant CPU
    kernels do not build) and the OpenAI Triton kernels (a GPU's; here in Triton's
    interpreter): the published algorithm's drafts in one ragged batch, each layer kind (full,
    causal, sliding) masked as its own."""
    if path == "sdpa":
        monkeypatch.setattr(lean_lm.cpu_kernels, "unavailable_reason", lambda *_: "not on this CPU (test)")
    else:
        monkeypatch.setattr(lean_lm, "_kernels_for", lambda *_: True)
    head = heads[name]
    cfg, s = _reference_inputs(name, checkpoints, target_weights)
    proposer = _proposer_class(name)(head, 512)
    assert proposer.decoder.batch_invariant == proposer.decoder.triton_kernels == (path == "triton")
    requests = [request(runner, head, seq_id, ids, 8) for seq_id, ids in enumerate(prompt_ids)]
    for req, draft in zip(requests, proposer.propose(requests)):
        assert draft.token_ids == reference_drafts(name, cfg, s, req.hidden_states, req.token_ids[-1], 8)


@pytest.mark.parametrize("name", ["dflash-causal-sliding", "dspark-rnn"])
@pytest.mark.parametrize("accepted", [0, 2])
def test_rollback_and_incremental_context(name, accepted, heads, checkpoints, target_weights, runner, prompt_ids):
    head = heads[name]
    cfg, s = _reference_inputs(name, checkpoints, target_weights)
    proposer = _proposer_class(name)(head, 512)
    ids = prompt_ids[1]
    drafts = proposer.propose([request(runner, head, 7, ids, 4)])[0].token_ids
    # The target accepted `accepted` drafts and emitted one more token.
    context = ids + drafts[:accepted] + [(drafts[accepted] + 1) % V]
    again = proposer.propose([request(runner, head, 7, context, 4, delivered=len(ids) - 1)])[0].token_ids
    full = target_hidden(runner, context[:-1], head.hidden_layer_ids)
    assert again == reference_drafts(name, cfg, s, full, context[-1], 4)
    longer = context + [11, 12, 13]  # two verify steps without a draft call: rows concatenated
    later = proposer.propose([request(runner, head, 7, longer, 4, delivered=len(context) - 1)])[0].token_ids
    full = target_hidden(runner, longer[:-1], head.hidden_layer_ids)
    assert later == reference_drafts(name, cfg, s, full, longer[-1], 4)
    with pytest.raises(ValueError, match="hidden states start at position"):  # a gap
        proposer.propose([request(runner, head, 7, longer + [14, 15], 3, delivered=len(longer))])
    with pytest.raises(ValueError, match=r"hidden_states has shape \[\d+, 1, 64\]; expected \[rows, \d, 64\]"):
        proposer.propose([DraftRequest(8, ids, 3, target_hidden(runner, ids[:-1], (0,)))])


@pytest.mark.parametrize("name", ["dflash-causal-sliding", "dspark-rnn"])
def test_batched_equals_one_at_a_time(name, heads, runner, prompt_ids):
    head = heads[name]
    batched, alone = _proposer_class(name)(head, 512), _proposer_class(name)(head, 512)
    contexts = check_ragged_batches(
        batched, alone, prompt_ids, partial(request, runner, head), steps=3, first_k=1, vocab_size=V
    )
    assert batched.num_sequences == 3
    for seq in contexts:
        batched.release(seq)
    assert batched.num_sequences == 0


@pytest.mark.skipif(not linear_kernels.packed_linear_available(), reason="the packed bf16 kernel does not run here")
@pytest.mark.parametrize("draft_vocab", [None, 200])
def test_the_greedy_markov_chain_in_one_call_drafts_the_step_by_step_bits(
    draft_vocab, checkpoints, target, runner, prompt_ids, tmp_path
):
    """A bf16 vanilla Markov head drafts greedily in one C call (linear_kernels.markov_greedy):
    batched, those drafts are what the step-by-step chain drafts alone, over a draft vocabulary
    mapped to target ids too; a NaN in the logits hands the step back to torch."""
    path = checkpoints["dspark-vanilla"][0]
    if draft_vocab:
        cfg = dspark_default_config(target, mask_token_id=5, block_size=4, target_layer_ids=[0, 1], markov_rank=8)
        head = DSparkHead({**cfg, "draft_vocab_size": draft_vocab}, target)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            head.d2t.copy_(torch.randperm(V, generator=gen)[:draft_vocab].sort().values - torch.arange(draft_vocab))
            head.markov_head.markov_w2.weight.normal_(0, 2, generator=gen)  # a bias that moves drafts
        path = save_head(head, tmp_path / "dspark-draft-vocab")
    head = load_head(DSparkHead, path, target, "bfloat16")
    fast, stepwise = DSparkProposer(head, 512), DSparkProposer(head, 512)
    stepwise._markov_weights = None  # the step-by-step chain
    assert fast._markov_weights is not None and (head.draft_to_target is not None) == bool(draft_vocab)
    check_ragged_batches(fast, stepwise, prompt_ids, partial(request, runner, head), steps=3, first_k=1, vocab_size=V)
    base = torch.zeros(1, 2, head.spec.draft_vocab_size)
    base[0, 1, 3] = float("nan")
    assert linear_kernels.markov_greedy(base, *fast._markov_weights, head.draft_to_target, torch.tensor([7])) is None


@pytest.mark.parametrize("name", ["dflash-draft-vocab", "dspark-gated"])
def test_probabilistic_drafts_come_with_their_probabilities(
    name, heads, checkpoints, target_weights, runner, prompt_ids
):
    head = heads[name]
    cfg, s = _reference_inputs(name, checkpoints, target_weights)
    proposer = _proposer_class(name)(head, 512, "probabilistic", seed=0)
    requests = [request(runner, head, seq, ids, 3) for seq, ids in enumerate(prompt_ids)]
    for req, draft in zip(requests, proposer.propose(requests)):
        assert draft.probs.shape == (3, V) and draft.probs.dtype == torch.float32
        torch.testing.assert_close(draft.probs.sum(-1), torch.ones(3))
        assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.token_ids))
        out = reference_block(cfg, s, req.hidden_states, req.token_ids[-1])
        if name.startswith("dflash"):  # slot 1's softmax, scattered through d2t
            first = torch.zeros(V).index_copy_(
                0, torch.arange(200) + s["d2t"], F.linear(out[1], s["lm_head.weight"]).softmax(-1)
            )
        else:  # slot 0 (anchor convention) with the gated Markov bias of the anchor
            e = s["markov_head.markov_w1.weight"][req.token_ids[-1]]
            gate = torch.sigmoid(
                F.linear(torch.cat([out[0], e]), s["markov_head.gate_proj.weight"], s["markov_head.gate_proj.bias"])
            )
            first = (F.linear(out[0], s["lm_head.weight"]) + s["markov_head.markov_w2.weight"] @ (gate * e)).softmax(-1)
        torch.testing.assert_close(draft.probs[0], first, rtol=1e-4, atol=1e-6)
    one, two = (_proposer_class(name)(head, 512, "probabilistic", seed=5).propose(requests) for _ in range(2))
    assert [d.token_ids for d in one] == [d.token_ids for d in two]
