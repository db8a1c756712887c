"""MTP layers: the DeepSeek-V3 and MiMo layouts and Step-3.5-style per-step layers (tiny
synthetic checkpoints through the loader real ones use, standalone or inside the target's
checkpoint), refusals, the published formulas, drafting against a cacheless reference,
rollback, batching, draft probabilities, the writer the trainer uses, and speculative
decoding through the real server."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from backends.config import SpeculativeConfig
from backends.methods.mtp import MTPCheckpointError, MTPHead, MTPProposer, load_mtp, save_mtp
from backends.serving.proposer import DraftRequest, build_proposer
from tests.fixtures.head_server import CONTEXTS
from tests.fixtures.helpers import assert_same_caches, check_ragged_batches, request, target_hidden
from tests.fixtures.synthetic_checkpoints import refusal_test
from tests.fixtures.synthetic_heads import write_mtp

H, I, V, L = 64, 128, 384, 2  # the tiny target
VARIANTS = {
    "deepseek": {},
    "deepseek-shared-bin": {"with_shared": True, "fmt": "bin"},
    "deepseek-2layers": {"num_layers": 2},  # vLLM runs layer 0 only
    "mimo": {"family": "mimo"},
    "step3p5": {"model_type": "step3p5", "num_layers": 2},
    "inside-target": {"inside_target": True},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("mtp")
    return {name: (root / name, write_mtp(root / name, tiny_model_dir, **opts)) for name, opts in VARIANTS.items()}


@pytest.fixture(scope="module")
def heads(checkpoints, target):
    return {name: load_mtp(path, target, "float32") for name, (path, _) in checkpoints.items()}


@pytest.fixture(scope="module")
def hidden(runner):
    return [target_hidden(runner, ids[:-1], (-1,)) for ids in CONTEXTS]


def layer_tensors(name: str, written: dict, target_weights: dict, j: int) -> dict[str, torch.Tensor]:
    """MTP layer j's tensors under DeepSeek's part names, read from the written keys as the
    published layouts name them; the embedding and LM head fall back to the target's."""
    if VARIANTS[name].get("family") == "mimo":
        p = f"model.mtp_layers.{j}."
        renames = {"token_layernorm": "enorm", "hidden_layernorm": "hnorm", "input_proj": "eh_proj"}
        out = {}
        for key, value in written.items():
            if key.startswith(p):
                part, _, rest = key.removeprefix(p).partition(".")
                out[f"{renames.get(part, part)}.{rest}"] = value
        out["head"] = target_weights["lm_head.weight"]
    else:
        p = f"model.layers.{L + j}."
        out = {k.removeprefix(p): v for k, v in written.items() if k.startswith(p) and "embed_tokens" not in k}
        out["head"] = out.pop("shared_head.head.weight", target_weights["lm_head.weight"])
    out["embed"] = written.get(f"model.layers.{L}.embed_tokens.weight", target_weights["model.embed_tokens.weight"])
    return out


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:  # the tiny target's eps
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def lone_pair(name: str, t: dict, token: int, h: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The published step for one pair alone (attention over one key returns o_proj(v), no
    rotary effect): the state fed back and the draft logits."""
    mimo = VARIANTS[name].get("family") == "mimo"
    e = torch.zeros(H) if position == 0 and name != "step3p5" else t["embed"][token]
    e, h = _rms(e, t["enorm.weight"]), _rms(h, t["hnorm.weight"])
    u = F.linear(torch.cat([h, e] if mimo else [e, h]), t["eh_proj.weight"])
    a = _rms(u, t["input_layernorm.weight"])
    v = F.linear(a, t["self_attn.v_proj.weight"], t.get("self_attn.v_proj.bias")).view(2, -1)
    x = u + F.linear(v.repeat_interleave(2, 0).flatten(), t["self_attn.o_proj.weight"])
    m = _rms(x, t["post_attention_layernorm.weight"])
    x = x + F.linear(
        F.silu(F.linear(m, t["mlp.gate_proj.weight"])) * F.linear(m, t["mlp.up_proj.weight"]), t["mlp.down_proj.weight"]
    )
    if mimo:
        fed = _rms(x, t["final_layernorm.weight"])
        return fed, F.linear(fed, t["head"])
    return x, F.linear(_rms(x, t["shared_head.norm.weight"]), t["head"])


@torch.inference_mode()
def cacheless_drafts(head: MTPHead, context: list[int], hidden: torch.Tensor, k: int) -> list[int]:
    """Every draft step a fresh causal forward over all pairs so far (step s reads its layer)."""
    ids, feats, drafts = list(context[1:]), head.features(hidden), []
    for step in range(k):
        n = len(ids)
        out = head(
            torch.tensor([ids]),
            feats[None],
            torch.arange(n)[None],
            torch.ones(n, n, dtype=torch.bool).tril()[None, None],
            None,
            step,
        )
        drafts.append(int(head.logits(out[0, -1], step).argmax()))
        ids.append(drafts[-1])
        feats = torch.cat([feats, out[0, -1:]])
    return drafts


# ---------------------------------------------------------------------------- loading


@pytest.mark.parametrize("name", VARIANTS)
def test_published_layouts_load(name, checkpoints, heads, target_weights):
    _, written = checkpoints[name]
    head = heads[name]
    assert head.family == VARIANTS[name].get("family", "deepseek")
    assert len(head.layers) == (2 if name == "step3p5" else 1) and head.hidden_layer_ids == (-1,)
    for j, layer in enumerate(head.layers):
        tensors = layer_tensors(name, written, target_weights, j)
        own = layer.state_dict()
        for part, value in tensors.items():
            if part == "head":
                mine = head.lm_head.weight if head.family == "mimo" else layer.shared_head.head.weight
            elif part == "embed":
                mine = head.embed_tokens.weight
            else:
                mine = own[part]
            assert torch.equal(mine, value), (name, j, part)
        assert len(tensors) - 2 == len([k for k in own if k != "shared_head.head.weight"])  # nothing left over


@pytest.mark.parametrize("name", ["deepseek", "deepseek-shared-bin", "mimo", "step3p5"])
@pytest.mark.parametrize("position", [0, 5])
def test_a_lone_pair_follows_the_published_formulas(name, position, checkpoints, heads, target_weights, runner):
    head = heads[name]
    h = target_hidden(runner, [17], (-1,))[0, 0]
    for step in range(len(head.layers)):
        fed, logits = lone_pair(name, layer_tensors(name, checkpoints[name][1], target_weights, step), 42, h, position)
        with torch.inference_mode():
            out = head(
                torch.tensor([[42]]),
                h[None, None],
                torch.tensor([[position]]),
                torch.ones(1, 1, 1, 1, dtype=torch.bool),
                None,
                step,
            )
            torch.testing.assert_close(out[0, 0], fed, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(head.logits(out[0, 0], step), logits, rtol=1e-4, atol=1e-4)


def _mla(state: dict) -> dict:
    p = f"model.layers.{L}.self_attn."
    state = {k: v for k, v in state.items() if not k.startswith(p + "q_proj")}
    return {**state, p + "q_a_proj.weight": torch.zeros(16, H)}


REFUSALS = {
    "missing": (
        "deepseek",
        lambda s: {k: v for k, v in s.items() if k != f"model.layers.{L}.hnorm.weight"},
        None,
        r"missing key 'model\.layers\.2\.hnorm\.weight' \(expected shape \[64\]\)",
    ),
    "missing mimo": (
        "mimo",
        lambda s: {k: v for k, v in s.items() if k != "model.mtp_layers.0.token_layernorm.weight"},
        None,
        r"missing key 'model\.mtp_layers\.0\.token_layernorm\.weight'",
    ),
    "unexpected": (
        "deepseek",
        lambda s: {**s, f"model.layers.{L}.self_attn.q_norm.weight": torch.ones(16)},
        None,
        r"unexpected key 'model\.layers\.2\.self_attn\.q_norm\.weight' \(shape \[16\]\)",
    ),
    "shape": (
        "mimo",
        lambda s: {**s, "model.mtp_layers.0.input_proj.weight": torch.zeros(H, H)},
        None,
        r"'model\.mtp_layers\.0\.input_proj\.weight' has shape \[64, 64\], expected \[64, 128\]",
    ),
    "shared head vocabulary": (
        "deepseek-shared-bin",
        lambda s: {**s, f"model.layers.{L}.shared_head.head.weight": torch.zeros(V + 8, H)},
        None,
        r"'model\.layers\.2\.shared_head\.head\.weight' has shape \[392, 64\]",
    ),
    "MLA attention": (
        "deepseek",
        _mla,
        None,
        r"not a Llama/Qwen2-style dense layer \(missing "
        r"'model\.layers\.2\.self_attn\.q_proj\.weight'; it has .*q_a_proj",
    ),
    "hidden size": ("deepseek", None, {"hidden_size": 32}, r"hidden_size 32 in config\.json, but the target's is 64"),
    "vocabulary": ("mimo", None, {"vocab_size": 500}, r"vocab_size 500 in config\.json, but the target's is 384"),
    "layer index": (
        "deepseek",
        None,
        {"num_hidden_layers": 1},
        r"the first MTP layer is 'model\.layers\.2\.', but config\.json has num_hidden_layers 1",
    ),
    "declared layers": (
        "deepseek",
        None,
        {"num_nextn_predict_layers": 2},
        r"num_nextn_predict_layers is 2, but only 1 MTP layer\(s\) found",
    ),
    "no MTP layers": ("deepseek", lambda s: {"mtp.fc.weight": torch.zeros(H, 2 * H)}, None, r"no MTP layers"),
}


test_checkpoints_that_do_not_fit_are_refused = refusal_test(
    REFUSALS, MTPCheckpointError, lambda path, target, _: load_mtp(path, target)
)


def test_from_config(checkpoints, tiny_model_dir):
    """An explicit mtp, a legacy MTP method name, or detection from the checkpoint's
    model_type (deepseek_v3 -> deepseek_mtp) all build the MTP proposer."""
    path = str(checkpoints["deepseek"][0])
    for spec in (
        {"method": "mtp", "model": path, "num_speculative_tokens": 2},
        {"method": "deepseek_mtp", "model": path, "num_speculative_tokens": 2},
        {"model": path},
    ):
        config = SpeculativeConfig.from_json(spec, target_model=str(tiny_model_dir))
        assert config.method == "mtp"
        proposer = build_proposer(config, max_model_len=512, dtype="float32", target_model=tiny_model_dir)
        assert isinstance(proposer, MTPProposer) and proposer.hidden_layer_ids == (-1,)
    config = SpeculativeConfig.from_json({"model": str(checkpoints["step3p5"][0])}, target_model=str(tiny_model_dir))
    assert config.num_speculative_tokens == 2  # n_predict = the MTP layers
    assert len(build_proposer(config, max_model_len=512, target_model=tiny_model_dir).head.layers) == 2


# ---------------------------------------------------------------------------- drafting


@pytest.mark.parametrize("name", ["deepseek", "mimo", "step3p5", "deepseek-2layers"])
def test_greedy_drafts_match_a_cacheless_reference(name, heads, hidden):
    head = heads[name]
    proposer = MTPProposer(head, 512)
    for seq_id, (ids, rows) in enumerate(zip(CONTEXTS, hidden)):
        draft = proposer.propose([DraftRequest(seq_id, ids, 4, rows)])[0]
        assert draft.token_ids == cacheless_drafts(head, ids, rows, 4) and draft.probs is None
        assert proposer.pool.length(seq_id) == len(ids) - 1 + 3


def test_layer_0_is_reused_unless_layers_are_per_step(heads, hidden):
    """deepseek-2layers drafts as its first layer alone; step3p5's second step reads layer 1."""
    single = MTPProposer(heads["deepseek"], 512)  # the same seed wrote the same first layer
    double = MTPProposer(heads["deepseek-2layers"], 512)
    ids, rows = CONTEXTS[2], hidden[2]
    assert (
        double.propose([DraftRequest(0, ids, 4, rows)])[0].token_ids
        == single.propose([DraftRequest(0, ids, 4, rows)])[0].token_ids
    )
    step3p5 = heads["step3p5"]
    with torch.inference_mode():
        n = len(ids) - 1
        args = (
            torch.tensor([ids[1:]]),
            rows[:, 0][None],
            torch.arange(n)[None],
            torch.ones(n, n, dtype=torch.bool).tril()[None, None],
            None,
        )
        assert not torch.allclose(step3p5(*args, 0), step3p5(*args, 1))


@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_rollback_after_verification_equals_a_fresh_proposer(accepted, heads, runner):
    head = heads["deepseek"]
    proposer = MTPProposer(head, 512)
    ids = CONTEXTS[2]
    drafts = proposer.propose([DraftRequest(7, ids, 4, target_hidden(runner, ids[:-1], (-1,)))])[0].token_ids
    context = ids + drafts[:accepted] + [(drafts[accepted] + 1) % V if accepted < 4 else 42]
    full = target_hidden(runner, context[:-1], (-1,))
    again = proposer.propose([DraftRequest(7, context, 3, full[len(ids) - 1 :], num_new=len(context) - len(ids))])[
        0
    ].token_ids  # only new rows
    assert again == MTPProposer(head, 512).propose([DraftRequest(7, context, 3, full)])[0].token_ids
    assert again == cacheless_drafts(head, context, full, 3)


@pytest.mark.parametrize("name", ["deepseek", "step3p5"])
def test_batched_equals_one_at_a_time(name, heads, runner):
    head = heads[name]
    batched, alone = MTPProposer(head, 512), MTPProposer(head, 512)

    def make_request(seq, ids, k, delivered):
        return request(runner, head, seq, ids, k, delivered)

    contexts = check_ragged_batches(batched, alone, CONTEXTS, make_request, steps=3, first_k=2, vocab_size=V)
    assert_same_caches(alone, batched, contexts, atol=1e-4)


def test_probabilistic_drafts_come_with_their_probabilities(heads, hidden):
    head = heads["mimo"]
    requests = [DraftRequest(i, ids, 3, rows) for i, (ids, rows) in enumerate(zip(CONTEXTS, hidden))]
    drafts = MTPProposer(head, 512, "probabilistic", seed=2).propose(requests)
    for req, draft in zip(requests, drafts):
        assert draft.probs.shape == (3, V)
        with torch.inference_mode():
            n = len(req.token_ids) - 1
            out = head(
                torch.tensor([req.token_ids[1:]]),
                req.hidden_states[:, 0][None],
                torch.arange(n)[None],
                torch.ones(n, n, dtype=torch.bool).tril()[None, None],
                None,
            )
            first = head.logits(out[0, -1]).softmax(-1)
        torch.testing.assert_close(draft.probs[0], first, rtol=1e-4, atol=1e-6)
        assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.token_ids))
    again = MTPProposer(head, 512, "probabilistic", seed=2).propose(requests)
    assert [d.token_ids for d in again] == [d.token_ids for d in drafts]


# ---------------------------------------------------------------------------- writing


@pytest.mark.parametrize("name", ["deepseek", "mimo", "step3p5"])
def test_the_writer_writes_the_published_layout(name, checkpoints, heads, target, tmp_path, tiny_model_dir):
    """save_mtp writes the published keys (the target's embedding and LM head left out, as
    exports that omit the duplicates do) and a config the method is detected from."""
    head = heads[name]
    save_mtp(head, tmp_path / "out")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "out" / "model.safetensors")
    written = checkpoints[name][1]
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in written.items()}
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == len(head.layers) and config["num_hidden_layers"] == L
    resolved = SpeculativeConfig.from_json({"model": str(tmp_path / "out")}, target_model=str(tiny_model_dir))
    assert resolved.method == "mtp"
    again = load_mtp(tmp_path / "out", target, "float32")
    for (k, a), b in zip(head.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k
