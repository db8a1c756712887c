"""Medusa heads: both published layouts (tiny synthetic checkpoints through the loader real
ones use), refusals, drafts against the published formula, batching, draft probabilities,
the writer the trainer uses, and speculative decoding through the real server."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from backends.config import SpeculativeConfig
from backends.methods.medusa import MedusaCheckpointError, MedusaProposer, load_medusa, save_medusa
from backends.runtime.lean_lm import kernel_linears
from backends.runtime.linear_kernels import packed_linear_available
from backends.serving.proposer import DraftRequest, build_proposer
from tests.fixtures.head_server import CONTEXTS, assert_batched_equals_one_at_a_time
from tests.fixtures.helpers import target_hidden
from tests.fixtures.synthetic_checkpoints import refusal_test
from tests.fixtures.synthetic_heads import write_medusa

H, V = 64, 384
VARIANTS = {
    # The old config says 2 heads; the tensors hold 4 (trust the tensors).
    "faster-pt": {"layout": "medusa", "config_heads": 2},
    "faster-2layers-prefixed": {"layout": "medusa", "num_layers": 2, "fmt": "safetensors", "prefix": "medusa_head."},
    "vllm": {"layout": "vllm", "fmt": "safetensors"},
    "vllm-shared-truncated-nobias": {
        "layout": "vllm",
        "shared_lm_head": True,
        "draft_vocab_size": 200,
        "bias": False,
        "fmt": "bin",
    },
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("medusa")
    return {name: (root / name, write_medusa(root / name, tiny_model_dir, **opts)) for name, opts in VARIANTS.items()}


@pytest.fixture(scope="module")
def hidden(runner):
    """The delivered rows for each context (positions 0..n-2, layer -1)."""
    return [target_hidden(runner, ids[:-1], (-1,)) for ids in CONTEXTS]


def written_heads(name: str, written: dict) -> list[tuple[list, torch.Tensor]]:
    """Per head: its blocks (W, b) and its LM head, read from the written keys as the
    published formats name them."""
    opts = VARIANTS[name]
    layers = opts.get("num_layers", 1)
    heads = []
    for h in range(4):
        if opts["layout"] == "medusa":
            p = opts.get("prefix", "")
            blocks = [(written[f"{p}{h}.{l}.linear.weight"], written[f"{p}{h}.{l}.linear.bias"]) for l in range(layers)]
            lm = written[f"{p}{h}.{layers}.weight"]
        else:
            blocks = [
                (written[f"blocks.{h}.layers.{l}.weight"], written.get(f"blocks.{h}.layers.{l}.bias"))
                for l in range(layers)
            ]
            lm = written["lm_heads.0.weight" if opts.get("shared_lm_head") else f"lm_heads.{h}.weight"]
        heads.append((blocks, lm))
    return heads


def reference_logits(name: str, written: dict, f: torch.Tensor) -> list[torch.Tensor]:
    """The published formula: z = f; z = z + SiLU(W z + b) per block; logits = W_head z,
    scattered into the target vocabulary through token_map (-inf elsewhere)."""
    out = []
    for blocks, lm in written_heads(name, written):
        z = f
        for w, b in blocks:
            z = z + F.silu(F.linear(z, w, b))
        logits = F.linear(z, lm)
        if "token_map" in written:
            logits = torch.full((V,), -torch.inf).index_copy_(0, written["token_map"], logits)
        out.append(logits)
    return out


# ---------------------------------------------------------------------------- loading


@pytest.mark.parametrize("name", VARIANTS)
def test_published_layouts_load(name, checkpoints, target):
    path, written = checkpoints[name]
    head = load_medusa(path, target, "float32")
    assert head.num_heads == 4 and head.num_layers == VARIANTS[name].get("num_layers", 1)
    for (blocks, lm), own_blocks, i in zip(written_heads(name, written), head.blocks, range(4)):
        for (w, b), linear in zip(blocks, own_blocks.layers):
            assert torch.equal(linear.weight, w) and (b is None) == (linear.bias is None)
            assert b is None or torch.equal(linear.bias, b)
        assert torch.equal(head.lm_heads[0 if head.shared_lm_head else i].weight, lm)
    assert head.shared_lm_head == bool(VARIANTS[name].get("shared_lm_head"))
    if "token_map" in written:
        assert torch.equal(head.draft_to_target, written["token_map"])


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_drafts_follow_the_published_formula(name, checkpoints, target, hidden):
    path, written = checkpoints[name]
    proposer = MedusaProposer(load_medusa(path, target, "float32", num_heads=3), 512)
    for ids, rows in zip(CONTEXTS, hidden):
        draft = proposer.propose([DraftRequest(0, ids, 3, rows)])[0]
        expected = [int(logits.argmax()) for logits in reference_logits(name, written, rows[-1, 0])[:3]]
        assert draft.token_ids == expected and draft.probs is None


def test_head_count_is_num_speculative_tokens(checkpoints, target, tiny_model_dir):
    path, _ = checkpoints["faster-pt"]
    assert load_medusa(path, target, "float32", num_heads=2).num_heads == 2  # later heads not loaded
    with pytest.raises(
        MedusaCheckpointError, match="num_speculative_tokens=5 needs 5 Medusa heads, but the checkpoint has 4"
    ):
        load_medusa(path, target, num_heads=5)
    # Through the config: the FasterDecoding config has no model_type; method medusa injects it.
    config = SpeculativeConfig.from_json(
        {"method": "medusa", "model": str(path), "num_speculative_tokens": 3}, target_model=str(tiny_model_dir)
    )
    proposer = build_proposer(config, max_model_len=512, dtype="float32", target_model=tiny_model_dir)
    assert isinstance(proposer, MedusaProposer) and proposer.head.num_heads == 3
    assert proposer.hidden_layer_ids == (-1,)


def _deeper_head_1(state: dict) -> dict:
    state = dict(state)
    state["1.2.weight"] = state.pop("1.1.weight")
    state.update({"1.1.linear.weight": torch.zeros(H, H), "1.1.linear.bias": torch.zeros(H)})
    return state


REFUSALS = {
    "missing bias": (
        "faster-pt",
        lambda s: {k: v for k, v in s.items() if k != "2.0.linear.bias"},
        None,
        r"missing key '2\.0\.linear\.bias' \(expected shape \[64\]\)",
    ),
    "missing lm head": (
        "vllm",
        lambda s: {k: v for k, v in s.items() if k != "lm_heads.1.weight"},
        None,
        r"missing key 'lm_heads\.1\.weight' \(expected shape \[384, 64\]\)",
    ),
    "block width": (
        "faster-pt",
        lambda s: {**s, "1.0.linear.weight": torch.zeros(32, 32)},
        None,
        r"'1\.0\.linear\.weight' has shape \[32, 32\], expected \[64, 64\]",
    ),
    "vocabulary": (
        "faster-pt",
        lambda s: {**s, "3.1.weight": torch.zeros(V + 16, H)},
        None,
        r"'3\.1\.weight' has shape \[400, 64\], expected \[384, 64\]",
    ),
    "unexpected": (
        "vllm",
        lambda s: {**s, "blocks.0.norm.weight": torch.ones(H)},
        None,
        r"unexpected key 'blocks\.0\.norm\.weight' \(shape \[64\]\)",
    ),
    "ragged heads": (
        "faster-pt",
        _deeper_head_1,
        None,
        r"different numbers of blocks \(head 0: '0\.1\.weight', head 1: '1\.2\.weight'",
    ),
    "config hidden": (
        "vllm",
        None,
        {"hidden_size": 32},
        r"hidden_size 32 in config\.json, but the target's hidden size is 64",
    ),
    "fc bias": (
        "vllm-shared-truncated-nobias",
        None,
        {"medusa_fc_bias": True},
        r"missing key 'blocks\.0\.layers\.0\.bias'",
    ),
    "token map": (
        "vllm-shared-truncated-nobias",
        lambda s: {**s, "token_map": s["token_map"] * 0},
        None,
        r"token_map maps draft ids outside \[0, 384\) or two draft ids to one target id",
    ),
    "no heads": ("vllm", lambda s: {"medusa.w": torch.zeros(2)}, None, r"no Medusa heads"),
}


test_checkpoints_that_do_not_fit_are_refused = refusal_test(
    REFUSALS, MedusaCheckpointError, lambda path, target, _: load_medusa(path, target)
)


# ---------------------------------------------------------------------------- drafting


def test_batched_equals_one_at_a_time(checkpoints, target, hidden):
    proposer = MedusaProposer(load_medusa(checkpoints["vllm"][0], target, "float32"), 512)
    together = assert_batched_equals_one_at_a_time(proposer, hidden, (4, 1, 3))
    # No drafts past the context window.
    near_end = MedusaProposer(proposer.head, max_model_len=len(CONTEXTS[0]) + 2)
    assert near_end.propose([DraftRequest(0, CONTEXTS[0], 4, hidden[0])])[0].token_ids == together[0].token_ids[:2]


@pytest.mark.skipif(not packed_linear_available(), reason="the packed bf16 kernel does not run on this CPU")
@pytest.mark.parametrize("name", VARIANTS)
def test_stacked_heads_give_each_heads_own_bits(name, checkpoints, target, hidden):
    """bf16 heads on the packed kernel draft through StackedHeads (every head at once: the
    first blocks in one call, later blocks and LM heads in one pass at few rows, head by head
    at more; a 200-id draft vocabulary pads each head's part): the bits of each head's own
    forward at every batch size, and drafts that are its argmax, batched as alone."""
    head = load_medusa(checkpoints[name][0], target, "bfloat16", num_heads=3)
    proposer = MedusaProposer(head, 512)
    assert proposer.stacked is not None
    gen = torch.Generator().manual_seed(1)
    states = torch.cat([torch.stack([rows[-1, 0] for rows in hidden]), torch.randn(2, H, generator=gen)]).bfloat16()
    for rows in (1, 2, 3, 5):  # 3 heads: 3 and 6 rows in one pass, 9 and 15 head by head
        assert torch.equal(proposer.heads_logits(states[:rows]), head(states[:rows]))
    expected = head(states[:3]).float().argmax(-1)
    if head.token_map is not None:
        expected = head.token_map[expected]
    bf16_hidden = [rows.bfloat16() for rows in hidden]
    together = assert_batched_equals_one_at_a_time(proposer, bf16_hidden, (3, 1, 3))
    assert [d.token_ids for d in together[:3]] == [expected[0].tolist(), expected[1, :1].tolist(), expected[2].tolist()]
    int8 = MedusaProposer(head, 512)
    kernel_linears(head, int8=True)  # as from_config quantizes: after construction
    assert int8.stacked is None  # int8 heads keep their own layers


@pytest.mark.parametrize("name", ["vllm", "vllm-shared-truncated-nobias"])
def test_probabilistic_drafts_come_with_their_probabilities(name, checkpoints, target, hidden):
    path, written = checkpoints[name]
    head = load_medusa(path, target, "float32")
    requests = [DraftRequest(i, ids, 4, rows) for i, (ids, rows) in enumerate(zip(CONTEXTS, hidden))]
    drafts = MedusaProposer(head, 512, "probabilistic", seed=3).propose(requests)
    for req, draft in zip(requests, drafts):
        expected = torch.stack(reference_logits(name, written, req.hidden_states[-1, 0])).softmax(-1)
        torch.testing.assert_close(draft.probs, expected, rtol=1e-4, atol=1e-6)
        assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.token_ids))
    again = MedusaProposer(head, 512, "probabilistic", seed=3).propose(requests)
    assert [d.token_ids for d in again] == [d.token_ids for d in drafts]


TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))


@pytest.mark.parametrize("name", ["vllm", "vllm-shared-truncated-nobias"])
def test_a_static_tree_drafts_each_heads_ranked_tokens(name, checkpoints, target, hidden):
    path, written = checkpoints[name]
    proposer = MedusaProposer(load_medusa(path, target, "float32"), 512)
    proposer.token_tree = TREE
    requests = [DraftRequest(i, ids, 3, rows, num_nodes=6) for i, (ids, rows) in enumerate(zip(CONTEXTS, hidden))]
    drafts = proposer.propose(requests)
    for req, draft in zip(requests, drafts):
        probs = [logits.softmax(-1) for logits in reference_logits(name, written, req.hidden_states[-1, 0])]
        ranked = [p.argsort(descending=True) for p in probs]
        # num_nodes keeps the paths most probable under the heads (each node: its head's
        # probability of its rank's token, times its parent's), by depth, then probability
        score = {path: math.prod(float(probs[d][ranked[d][r]]) for d, r in enumerate(path)) for path in TREE}
        kept = sorted(sorted(TREE, key=lambda p: (-score[p], len(p)))[:6], key=len)
        assert draft.token_ids == [int(ranked[len(p) - 1][p[-1]]) for p in kept]
        assert draft.parents == [kept.index(p[:-1]) if len(p) > 1 else -1 for p in kept] and draft.probs is None
        assert draft.scores == pytest.approx([score[p] for p in kept], rel=1e-4)  # what the loop's cut weighs
    # Depth follows the step's k; without num_nodes the drafts are the chain.
    shallow = proposer.propose([DraftRequest(0, CONTEXTS[0], 1, hidden[0], num_nodes=10)])[0]
    assert shallow.parents == [-1, -1, -1]
    chain = proposer.propose([DraftRequest(0, CONTEXTS[0], 3, hidden[0])])[0]
    assert chain.parents is None and len(chain.token_ids) == 3
    # Trees and chains in one batch, each as alone.
    mixed = proposer.propose([requests[0], DraftRequest(9, CONTEXTS[1], 3, hidden[1]), requests[2]])
    assert [mixed[0].token_ids, mixed[2].token_ids] == [drafts[0].token_ids, drafts[2].token_ids]
    assert mixed[1].token_ids == proposer.propose([DraftRequest(9, CONTEXTS[1], 3, hidden[1])])[0].token_ids


def test_hidden_state_contract(checkpoints, target, runner):
    proposer = MedusaProposer(load_medusa(checkpoints["vllm"][0], target, "float32"), 512)
    wrong = target_hidden(runner, CONTEXTS[0][:-1], (0, -1))
    with pytest.raises(ValueError, match=r"hidden_states has shape \[6, 2, 64\]; expected \[rows >= 1, 1, 64\]"):
        proposer.propose([DraftRequest(0, CONTEXTS[0], 2, wrong)])


# ---------------------------------------------------------------------------- writing


@pytest.mark.parametrize("layout", ["medusa", "vllm"])
def test_the_writer_writes_the_published_layout(layout, checkpoints, target, tmp_path, tiny_model_dir):
    """save_medusa (what the trainer calls) writes the same files, config fields and keys as
    the published format, and they load back to the same head."""
    source = "faster-2layers-prefixed" if layout == "medusa" else "vllm"
    head = load_medusa(checkpoints[source][0], target, "float32")
    save_medusa(head, tmp_path / "out", layout, base_model=str(tiny_model_dir))
    reference = tmp_path / "reference"
    written = write_medusa(
        reference, tiny_model_dir, layout=layout, num_layers=head.num_layers, fmt="safetensors", bias=True
    )
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert files == {p.name for p in reference.iterdir()}
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "out" / next(f for f in files if f.endswith(".safetensors")))
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in written.items()}
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert set(config) >= set(json.loads((reference / "config.json").read_text())) - {"transformers_version"}
    again = load_medusa(tmp_path / "out", target, "float32")
    for (k, a), b in zip(head.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k
