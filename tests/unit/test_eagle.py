"""EAGLE-1/2 and EAGLE-3 drafters: loading the published checkpoint layouts (tiny synthetic
ones, through the loader real checkpoints use), refusing checkpoints that do not fit,
drafting against a cacheless reference, rollback, batching, draft probabilities, and
speculative decoding in process with hidden states passed from verifier to drafter."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from backends.config import SpeculativeConfig
from backends.methods.eagle import Eagle3Proposer, EagleProposer
from backends.methods.eagle_head import EagleCheckpointError, load_eagle
from backends.runtime import linear_kernels
from backends.serving.adaptive import DraftPolicy, Shape
from backends.serving.detokenize import TextStream
from backends.serving.drafting import DraftService
from backends.serving.local import LocalDrafter, LocalVerifier, generate_local
from backends.serving.orchestrator import Generation, ServingContext, generate
from backends.serving.proposer import DraftRequest, build_proposer
from backends.serving.request import GenerationRequest
from tests.fixtures.helpers import (
    assert_same_caches,
    check_ragged_batches,
    hf_greedy,
    request,
    target_hidden,
    three_layer_target_dir,
)
from tests.fixtures.synthetic_checkpoints import edit_state, refusal_test, write_eagle1, write_eagle3

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The", "for i in range(10):\n    print(i"]
# Checkpoint variants: (writer, options).
VARIANTS = {
    "eagle1-bin": (write_eagle1, {}),
    "eagle1-nobias-safetensors": (write_eagle1, {"bias": False, "fmt": "safetensors"}),
    "eagle3-midlayer": (write_eagle3, {}),
    "eagle3-layers0-bin": (write_eagle3, {"spelling": "layers.0.", "fmt": "bin"}),
    "eagle3-speculators": (write_eagle3, {"speculators": True, "spelling": "layers.0.", "with_embedding": True}),
}
HEADS = {"eagle": "eagle1-bin", "eagle3": "eagle3-midlayer"}


target_dir = three_layer_target_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, target_dir):
    """name -> (directory, the state dict written)."""
    root = tmp_path_factory.mktemp("eagle-checkpoints")
    return {name: (root / name, writer(root / name, target_dir, **opts)) for name, (writer, opts) in VARIANTS.items()}


@pytest.fixture(scope="module")
def heads(checkpoints, target):
    return {method: load_eagle(checkpoints[name][0], target, "float32") for method, name in HEADS.items()}


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@torch.inference_mode()
def cacheless_drafts(head, context: list[int], hidden: torch.Tensor, k: int) -> tuple[list[int], list[torch.Tensor]]:
    """The reference: every draft step is a fresh causal forward over all pairs so far."""
    ids, feats = list(context[1:]), head.features(hidden)
    drafts, logits = [], []
    for _ in range(k):
        n = len(ids)
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        out = head(torch.tensor([ids]), feats[None], torch.arange(n)[None], mask, DynamicCache(config=head.config))
        row = head.logits(out[0, -1]).float()
        token = int(row.argmax())
        if head.draft_to_target is not None:
            token = int(head.draft_to_target[token])
        drafts.append(token)
        logits.append(row)
        ids.append(token)
        feats = torch.cat([feats, out[0, -1:]])
    return drafts, logits


# ---------------------------------------------------------------------------- loading


@pytest.mark.parametrize("name", VARIANTS)
def test_published_layouts_load(name, checkpoints, target, target_dir):
    path, written = checkpoints[name]
    head = load_eagle(path, target, "float32")
    assert head.layout == ("eagle3" if name.startswith("eagle3") else "eagle")
    assert head.hidden_layer_ids == ((0, 1, 2) if head.layout == "eagle3" else (-1,))
    loaded = head.state_dict()
    for key, value in written.items():
        if key != "t2d":
            own = loaded[key.replace("midlayer.", "layers.0.")]
            torch.testing.assert_close(own, value.to(own.dtype))
    from safetensors.torch import load_file

    target_weights = load_file(target_dir / "model.safetensors")
    if "embed_tokens.weight" not in written:  # borrowed from the target
        torch.testing.assert_close(head.embed_tokens.weight, target_weights["model.embed_tokens.weight"])
    if head.layout == "eagle":
        torch.testing.assert_close(head.lm_head.weight, target_weights["lm_head.weight"])
        assert (head.fc.bias is not None) == ("fc.bias" in written)
    else:
        mapped = torch.arange(len(written["d2t"])) + written["d2t"]
        assert torch.equal(head.draft_to_target, mapped) and written["t2d"][mapped].all()
        assert head.norm_before_residual == name.endswith("speculators")


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("name", ["eagle1-bin", "eagle3-midlayer", "eagle3-speculators"])
def test_a_lone_pair_follows_the_published_formulas(name, checkpoints, target, target_dir, runner):
    """Written from the reference's formulas over the written tensors: with a single
    position, attention returns o_proj(v_proj(input)) (softmax over one key, no rotary)."""
    from safetensors.torch import load_file

    path, s = checkpoints[name]
    s = {k.replace("midlayer.", "layers.0."): v for k, v in s.items()}
    head = load_eagle(path, target, "float32")
    cfg = json.loads((target_dir / "config.json").read_text())
    eps, groups = cfg["rms_norm_eps"], cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    weights = load_file(target_dir / "model.safetensors")
    embed = s.get("embed_tokens.weight", weights["model.embed_tokens.weight"])
    x0, x1 = 17, 42
    hidden = target_hidden(runner, [x0], head.hidden_layer_ids)  # [1, layers, H]

    def attention(a):
        v = F.linear(a, s["layers.0.self_attn.v_proj.weight"]).view(cfg["num_key_value_heads"], -1)
        return F.linear(v.repeat_interleave(groups, 0).flatten(), s["layers.0.self_attn.o_proj.weight"])

    def mlp(x):
        x = _rms(x, s["layers.0.post_attention_layernorm.weight"], eps)
        up = F.silu(F.linear(x, s["layers.0.mlp.gate_proj.weight"])) * F.linear(x, s["layers.0.mlp.up_proj.weight"])
        return F.linear(up, s["layers.0.mlp.down_proj.weight"])

    if head.layout == "eagle":
        x = F.linear(torch.cat([embed[x1], hidden[0, 0]]), s["fc.weight"], s["fc.bias"])  # embedding first
        y = x + attention(x)  # layer 0 has no input norm
        y = y + mlp(y)
        expected = F.linear(y, weights["lm_head.weight"])  # no final norm, the target's head
    else:
        g = F.linear(hidden[0].flatten(), s["fc.weight"])  # low, mid, high
        normed = _rms(g, s["layers.0.hidden_norm.weight"], eps)
        y = (normed if head.norm_before_residual else g) + attention(
            torch.cat([_rms(embed[x1], s["layers.0.input_layernorm.weight"], eps), normed])
        )
        y = y + mlp(y)
        expected = F.linear(_rms(y, s["norm.weight"], eps), s["lm_head.weight"])
    with torch.inference_mode():
        out = head(
            torch.tensor([[x1]]),
            head.features(hidden)[None],
            torch.zeros(1, 1, dtype=torch.long),
            torch.ones(1, 1, 1, 1, dtype=torch.bool),
            DynamicCache(config=head.config),
        )
        torch.testing.assert_close(head.logits(out[0, 0]), expected, rtol=1e-4, atol=1e-4)


def test_layout_comes_from_the_checkpoint_not_the_name(tmp_path, target_dir, target):
    write_eagle3(tmp_path / "EAGLE-llama-misnamed", target_dir)
    write_eagle1(tmp_path / "eagle3-misnamed", target_dir)
    assert load_eagle(tmp_path / "EAGLE-llama-misnamed", target).layout == "eagle3"
    assert load_eagle(tmp_path / "eagle3-misnamed", target).layout == "eagle"
    with pytest.raises(EagleCheckpointError, match="method 'eagle3' needs an EAGLE-3 checkpoint"):
        load_eagle(tmp_path / "eagle3-misnamed", target, method="eagle3")
    with pytest.raises(EagleCheckpointError, match="method 'eagle' needs an EAGLE-1 checkpoint"):
        load_eagle(tmp_path / "EAGLE-llama-misnamed", target, method="eagle")


H, I, V = 64, 128, 384
REFUSALS = {
    "missing key": (
        "eagle3-midlayer",
        lambda s: edit_state(s, drop=["midlayer.hidden_norm.weight"]),
        None,
        r"missing key 'layers\.0\.hidden_norm\.weight' \(expected shape \[64\]\)",
    ),
    "missing fc bias": ("eagle1-bin", lambda s: edit_state(s, drop=["fc.bias"]), None, r"missing key 'fc\.bias'"),
    "unexpected key": (
        "eagle3-midlayer",
        lambda s: {**s, "midlayer.self_attn.q_norm.weight": torch.ones(16)},
        None,
        r"unexpected key 'midlayer\.self_attn\.q_norm\.weight' \(shape \[16\]\)",
    ),
    "fc shape": (
        "eagle3-midlayer",
        lambda s: {**s, "fc.weight": torch.zeros(H, 2 * H)},
        None,
        r"'fc\.weight' has shape \[64, 128\], expected \[64, 192\]",
    ),
    "layer shape": (
        "eagle1-bin",
        lambda s: {**s, "layers.0.mlp.down_proj.weight": torch.zeros(I, H)},
        None,
        r"'layers\.0\.mlp\.down_proj\.weight' has shape \[128, 64\], expected \[64, 128\]",
    ),
    "config vocab": (
        "eagle1-bin",
        None,
        {"vocab_size": 500},
        r"vocab_size 500 in config\.json, but the target's vocabulary has 384 ids",
    ),
    "embedding vocab": (
        "eagle3-midlayer",
        lambda s: {**s, "embed_tokens.weight": torch.zeros(V + 8, H)},
        None,
        r"'embed_tokens\.weight' has shape \[392, 64\], expected \[384, 64\]",
    ),
    "t2d vocab": (
        "eagle3-midlayer",
        lambda s: {**s, "t2d": torch.zeros(V + 16, dtype=torch.bool)},
        None,
        r"'t2d' has shape \[400\], expected \[384\]",
    ),
    "d2t range": (
        "eagle3-midlayer",
        lambda s: {**s, "d2t": s["d2t"] + V},
        None,
        r"d2t maps draft ids outside \[0, 384\)",
    ),
    "hidden size": (
        "eagle1-bin",
        None,
        {"hidden_size": 32},
        r"hidden_size 32 in config\.json, but the target's hidden size is 64",
    ),
}


test_checkpoints_that_do_not_fit_are_refused = refusal_test(
    REFUSALS, EagleCheckpointError, lambda path, target, _: load_eagle(path, target)
)


def test_from_config_and_aux_layer_ids(checkpoints, target_dir):
    def config(name, method, **extra):
        return SpeculativeConfig.from_json(
            {"method": method, "model": str(checkpoints[name][0]), "num_speculative_tokens": 3, **extra},
            target_model=str(target_dir),
        )

    eagle = build_proposer(config("eagle1-bin", "eagle"), max_model_len=512, dtype="float32", target_model=target_dir)
    assert isinstance(eagle, EagleProposer) and eagle.hidden_layer_ids == (-1,)
    eagle3 = build_proposer(
        config("eagle3-midlayer", "eagle3", eagle_aux_hidden_state_layer_ids=[2, 0, 1]),
        max_model_len=512,
        target_model=target_dir,
    )
    assert isinstance(eagle3, Eagle3Proposer) and eagle3.hidden_layer_ids == (0, 1, 2)  # ascending, as vLLM
    assert next(eagle3.head.parameters()).dtype == torch.bfloat16
    # quantization int8: a bf16 head whose own linears (fc, LM head) run on the int8 kernel
    # where this CPU has it, even when the target runs in float32; refused off the CPU
    int8 = build_proposer(
        config("eagle3-midlayer", "eagle3", quantization="int8"),
        max_model_len=512,
        dtype="float32",
        target_model=target_dir,
    )
    assert next(int8.head.parameters()).dtype == torch.bfloat16
    assert int8.head.lm_head.int8 == int8.head.fc.int8 == linear_kernels.int8_linear_available()
    with pytest.raises(ValueError, match="runs on the CPU only"):
        build_proposer(
            config("eagle3-midlayer", "eagle3", quantization="int8"),
            max_model_len=512,
            target_model=target_dir,
            device="cuda",
        )
    with pytest.raises(
        EagleCheckpointError,
        match=r"aux hidden-state layer ids \[0, 1, 3\] must be distinct "
        r"target layers in \[0, 2\]",
    ):
        build_proposer(
            config("eagle3-midlayer", "eagle3", eagle_aux_hidden_state_layer_ids=[0, 1, 3]),
            max_model_len=512,
            target_model=target_dir,
        )
    with pytest.raises(EagleCheckpointError, match="needs an EAGLE-3 checkpoint"):
        build_proposer(config("eagle1-bin", "eagle3"), max_model_len=512, target_model=target_dir)


# ---------------------------------------------------------------------------- drafting


@pytest.mark.parametrize("method", HEADS)
def test_greedy_drafts_match_a_cacheless_reference(method, heads, runner, prompt_ids):
    head = heads[method]
    proposer, again = EagleProposer(head, 512), EagleProposer(head, 512)
    for seq_id, ids in enumerate(prompt_ids):
        req = request(runner, head, seq_id, ids, 5)
        draft = proposer.propose([req])[0]
        assert draft.token_ids == cacheless_drafts(head, ids, req.hidden_states, 5)[0]
        assert draft.probs is None
        assert again.propose([req])[0].token_ids == draft.token_ids  # deterministic
        # The pool holds the n-1 target pairs and the k-1 fed drafts.
        assert proposer.pool.length(seq_id) == len(ids) - 1 + 4


@pytest.mark.parametrize("method", HEADS)
@pytest.mark.parametrize("accepted", [0, 2, 5])
def test_rollback_after_verification_equals_a_fresh_proposer(method, accepted, heads, runner, prompt_ids):
    head = heads[method]
    proposer = EagleProposer(head, 512)
    ids = prompt_ids[1]
    drafts = proposer.propose([request(runner, head, 7, ids, 5)])[0].token_ids
    # The target accepted `accepted` drafts and emitted one more token (correction or bonus).
    context = ids + drafts[:accepted] + [(drafts[accepted] + 1) % V if accepted < 5 else 42]
    fresh = EagleProposer(head, 512).propose([request(runner, head, 7, context, 4)])[0].token_ids
    # Only the positions the target processed since the last call are delivered.
    again = proposer.propose([request(runner, head, 7, context, 4, delivered=len(ids) - 1)])[0].token_ids
    full = target_hidden(runner, context[:-1], head.hidden_layer_ids)
    assert again == fresh == cacheless_drafts(head, context, full, 4)[0]
    # Two verify steps without a draft call between them: their rows arrive concatenated.
    longer = context + [11, 12, 13]
    later = proposer.propose([request(runner, head, 7, longer, 3, delivered=len(context) - 1)])[0].token_ids
    assert later == cacheless_drafts(head, longer, target_hidden(runner, longer[:-1], head.hidden_layer_ids), 3)[0]
    with pytest.raises(ValueError, match="hidden states start at position"):  # a gap: rows missing
        proposer.propose([request(runner, head, 7, longer + [14, 15], 3, delivered=len(longer))])


@pytest.mark.parametrize("method", HEADS)
def test_batched_equals_one_at_a_time(method, heads, runner, prompt_ids):
    """Fresh, running and rolled-back sequences with ragged lengths and draft counts in one
    batch: the drafts and every sequence's cache must match lone runs (float32)."""
    head = heads[method]
    batched, alone = EagleProposer(head, 512), EagleProposer(head, 512)
    contexts = check_ragged_batches(
        batched, alone, prompt_ids, partial(request, runner, head), steps=4, first_k=2, vocab_size=V
    )
    assert_same_caches(alone, batched, contexts, atol=1e-4)


@pytest.mark.parametrize("method", HEADS)
def test_probabilistic_drafts_come_with_target_vocabulary_probs(method, heads, runner, prompt_ids):
    head = heads[method]
    proposer = EagleProposer(head, 512, "probabilistic", seed=0)
    requests = [request(runner, head, seq, ids, 4) for seq, ids in enumerate(prompt_ids)]
    for req, draft in zip(requests, proposer.propose(requests)):
        assert draft.probs.shape == (4, V) and draft.probs.dtype == torch.float32
        torch.testing.assert_close(draft.probs.sum(-1), torch.ones(4))
        assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.token_ids))
        first = cacheless_drafts(head, req.token_ids, req.hidden_states, 1)[1][0].softmax(-1)
        if head.draft_to_target is not None:  # eagle3: zero outside the draft vocabulary
            assert draft.probs[:, head.draft_to_target].sum(-1).allclose(torch.ones(4))
            first = torch.zeros(V).index_copy_(0, head.draft_to_target, first)
        torch.testing.assert_close(draft.probs[0], first, rtol=1e-4, atol=1e-6)
    one, two = (EagleProposer(head, 512, "probabilistic", seed=5).propose(requests) for _ in range(2))
    assert [d.token_ids for d in one] == [d.token_ids for d in two]


def test_hidden_state_contract(heads, runner, prompt_ids):
    proposer = EagleProposer(heads["eagle3"], 512)
    assert proposer.propose([DraftRequest(1, prompt_ids[0], 3)])[0].token_ids == []  # target not run yet
    assert proposer.num_sequences == 0
    wrong_layers = target_hidden(runner, prompt_ids[0][:-1], (-1,))
    with pytest.raises(ValueError, match=r"hidden_states has shape \[\d+, 1, 64\]; expected \[rows, 3, 64\]"):
        proposer.propose([DraftRequest(1, prompt_ids[0], 3, wrong_layers)])
    proposer.propose([request(runner, heads["eagle3"], 1, prompt_ids[0], 3)])
    proposer.release(1)
    assert proposer.num_sequences == 0


# ---------------------------------------------------------------------------- in process, end to end


@pytest.mark.parametrize("method", HEADS)
def test_speculative_greedy_equals_target_greedy(method, heads, runner, tokenizer, target_dir):
    """The orchestrator's loop carries the verifier's hidden states to the next draft call."""
    from backends.config import SpeculativeConfig
    from backends.serving.drafting import DraftService

    proposer = EagleProposer(heads[method], 512)
    config = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 4})  # k only
    for prompt in PROMPTS[:2]:
        out, stats = generate_local(prompt, tokenizer, runner, DraftService(proposer, config), {0}, max_tokens=24)
        assert tuple(out) == hf_greedy(str(target_dir), prompt, 24)
        assert stats.acceptance.num_draft_tokens > 0
    assert proposer.num_sequences == 0 and not runner.sequences


class ScriptedShapes(DraftPolicy):
    """A draft-shape policy that pauses and resumes on a script: the draft lengths in turn
    (then 2s), and the ones it gave."""

    def __init__(self, depths: list[int]) -> None:
        super().__init__(max_k=4)
        self.depths, self.given = iter(depths), []

    def next_shape(self, limit: int) -> Shape:
        self.given.append(min(next(self.depths, 2), limit))
        return Shape(self.given[-1])


def test_a_paused_head_catches_up_in_one_call_when_drafting_resumes(heads, runner, tokenizer, target_dir):
    """While the policy pauses drafting, the head is never called: the tokens and the target's
    hidden rows of the plain steps wait, and the call that resumes drafting feeds them all at
    once (one ragged forward). Its drafts equal the cacheless reference over the whole context,
    and the output stays the target's greedy one."""
    head = heads["eagle3"]
    calls = []  # per propose call: context, new tokens, hidden rows, drafts

    class Recorded(Eagle3Proposer):
        def propose(self, batch):
            drafts = super().propose(batch)
            for r, d in zip(batch, drafts):
                rows = 0 if r.hidden_states is None else len(r.hidden_states)
                calls.append((list(r.token_ids), r.num_new, rows, d.token_ids))
            return drafts

    config = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 4})  # k only
    drafter = LocalDrafter(DraftService(Recorded(head, 512), config))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    req = GenerationRequest(prompt=PROMPTS[0], max_tokens=30)
    gen = Generation(req, ids, 5, LocalVerifier(runner), drafter, TextStream(tokenizer), ServingContext({0}, 512))
    gen.policy = ScriptedShapes([3, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 1])
    out = [token for step in generate(gen) for token in step.token_ids]
    runner.release(5)
    assert tuple(out) == hf_greedy(str(target_dir), PROMPTS[0], 30) and not gen.stats.fallback
    asked = [k for k in gen.policy.given if k]
    assert len(calls) == len(asked)  # one call a drafting step, none while paused
    assert max(num_new for _, num_new, _, _ in calls) >= 7  # the call after six plain steps
    for i, ((context, num_new, rows, drafts), k) in enumerate(zip(calls, asked)):
        if i == 0:  # the prompt, before the target ran: no rows, no drafts
            assert rows == 0 and drafts == []
            continue
        # every position not delivered yet, once (the second call: the prompt's too)
        assert rows == num_new + (len(ids) - 1 if i == 1 else 0) and len(drafts) == k
        full = target_hidden(runner, context[:-1], head.hidden_layer_ids)
        assert drafts == cacheless_drafts(head, context, full, k)[0]
