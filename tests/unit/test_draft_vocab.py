"""A reduced draft vocabulary (`speculative_token_map`, FR-Spec) for the heads that draft over
the target's whole vocabulary: the map file's formats and refusals, the config's checks, and
the cut heads' drafts against the whole heads' (EAGLE-1, MTP, tied and untied MLP speculators):
greedy chains equal where the map holds the whole head's drafts, the best token within the map
where it does not, and sampled drafts' probabilities over the map alone."""

from __future__ import annotations

import json

import pytest
import torch

from backends.config import SpeculativeConfig, SpeculativeConfigError
from backends.methods.draft_vocab import TokenMapError, read_token_map
from backends.serving.proposer import DraftRequest, build_proposer
from tests.fixtures.head_server import CONTEXTS
from tests.fixtures.helpers import target_hidden
from tests.fixtures.synthetic_checkpoints import write_eagle1
from tests.fixtures.synthetic_heads import write_medusa, write_mlp_speculator, write_mtp

V = 384
HEADS = {
    "eagle": lambda out, target_dir: write_eagle1(out, target_dir),
    "mtp": lambda out, target_dir: write_mtp(out, target_dir),
    "mlp_speculator": lambda out, target_dir: write_mlp_speculator(out, target_dir),
    "mlp_speculator-tied": lambda out, target_dir: write_mlp_speculator(out, target_dir, tie_weights=True),
    "medusa": lambda out, target_dir: write_medusa(out, target_dir),  # FasterDecoding's: whole-vocabulary LM heads
}


@pytest.fixture(scope="module")
def heads(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("token-map-heads")
    for name, write in HEADS.items():
        write(root / name, tiny_model_dir)
    return root


def proposer(heads, tiny_model_dir, name: str, token_map=None, sample_method: str = "greedy", dtype: str = "float32"):
    config = {
        "method": name.split("-")[0],
        "model": str(heads / name),
        "num_speculative_tokens": 3,
        "draft_sample_method": sample_method,
    }
    if token_map is not None:
        config["speculative_token_map"] = str(token_map)
    resolved = SpeculativeConfig.from_json(config, target_model=str(tiny_model_dir))
    return build_proposer(resolved, max_model_len=512, dtype=dtype, target_model=tiny_model_dir, seed=1)


def requests(runner, layer_ids) -> list[DraftRequest]:
    return [DraftRequest(i, ids, 3, target_hidden(runner, ids[:-1], layer_ids)) for i, ids in enumerate(CONTEXTS)]


def write_map(path, ids) -> str:
    path.write_text(json.dumps(sorted(set(ids))))
    return str(path)


# ---------------------------------------------------------------------------- the file


def test_a_map_reads_from_json_or_a_torch_file_sorted(tmp_path):
    (tmp_path / "map.json").write_text("[9, 3, 200]")
    torch.save(torch.tensor([200, 3, 9], dtype=torch.int32), tmp_path / "freq_3.pt")  # FR-Spec's published format
    for name in ("map.json", "freq_3.pt"):
        ids = read_token_map(tmp_path / name, V)
        assert ids.tolist() == [3, 9, 200] and ids.dtype == torch.int64


@pytest.mark.parametrize(
    "content,match",
    [
        ("[1, 2, 384]", r"token id 384 is outside the target's \[0, 384\)"),
        ("[-1, 2]", r"token id -1 is outside"),
        ("[1, 2, 2, 7]", r"1 token ids appear twice"),
        ("[]", r"non-empty 1-D list of integer token ids"),
        ("[[1, 2], [3, 4]]", r"got torch.int64 of shape \(2, 2\)"),
        ("[1.5, 2]", r"got torch.float32"),
        ("{not json", r"not readable as token ids"),
    ],
)
def test_a_bad_map_is_refused_by_name(tmp_path, content, match):
    path = tmp_path / "map.json"
    path.write_text(content)
    with pytest.raises(TokenMapError, match=match):
        read_token_map(path, V)


def test_the_config_takes_a_map_for_whole_vocabulary_heads_only(heads, tmp_path, tiny_model_dir):
    path = write_map(tmp_path / "map.json", range(10))
    with pytest.raises(SpeculativeConfigError, match=r"speculative_token_map applies to method eagle / mtp"):
        SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3, "speculative_token_map": path})
    eagle = {"method": "eagle", "model": str(heads / "eagle"), "num_speculative_tokens": 3}
    with pytest.raises(SpeculativeConfigError, match=r"speculative_token_map: no such file: .*absent\.json"):
        SpeculativeConfig.from_json(
            {**eagle, "speculative_token_map": str(tmp_path / "absent.json")}, target_model=str(tiny_model_dir)
        )
    with pytest.raises(SpeculativeConfigError, match="speculative_token_map"):
        SpeculativeConfig.from_json({**eagle, "speculative_token_map": 7}, target_model=str(tiny_model_dir))


# ---------------------------------------------------------------------------- the drafts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the cut LM heads on the packed kernel
@pytest.mark.parametrize("name", HEADS)
def test_a_map_holding_the_drafts_drafts_the_same_and_cuts_every_lm_head(
    name, dtype, heads, tiny_model_dir, runner, tmp_path
):
    whole = proposer(heads, tiny_model_dir, name, dtype=dtype)
    batch = requests(runner, whole.hidden_layer_ids)
    drafts = [d.token_ids for d in whole.propose(batch)]
    ids = {t for d in drafts for t in d} | set(range(0, V, 3))
    cut = proposer(heads, tiny_model_dir, name, write_map(tmp_path / "map.json", ids), dtype=dtype)
    assert [d.token_ids for d in cut.propose(requests(runner, cut.hidden_layer_ids))] == drafts
    lm_heads = [m for m in cut.head.modules() if isinstance(m, torch.nn.Linear) and m.out_features >= len(ids)]
    assert lm_heads and all(m.out_features == len(ids) for m in lm_heads), lm_heads
    assert cut.head.draft_to_target.tolist() == sorted(ids)


def test_a_draft_outside_the_map_gives_way_to_the_best_token_within_it(heads, tiny_model_dir, runner, tmp_path):
    """Each context's first draft is dropped from the map: the cut MLP speculator drafts the
    best of the map's tokens under the whole head's first-stage logits instead."""
    whole = proposer(heads, tiny_model_dir, "mlp_speculator")
    batch = requests(runner, whole.hidden_layer_ids)
    first = {d.token_ids[0] for d in whole.propose(batch)}
    ids = sorted(set(range(V)) - first)
    cut = proposer(heads, tiny_model_dir, "mlp_speculator", write_map(tmp_path / "map.json", ids))
    head = whole.head
    for req, draft in zip(batch, cut.propose(requests(runner, cut.hidden_layer_ids))):
        state = head.begin(req.hidden_states[-1:, 0])
        logits = head.step(0, state, torch.tensor([req.token_ids[-1]]))[0][0]
        assert draft.token_ids[0] not in first
        assert draft.token_ids[0] == ids[int(logits[ids].argmax())]


def test_sampled_drafts_come_with_probabilities_over_the_map_alone(heads, tiny_model_dir, runner, tmp_path):
    ids = list(range(0, V, 2))
    cut = proposer(heads, tiny_model_dir, "eagle", write_map(tmp_path / "map.json", ids), "probabilistic")
    batch = [DraftRequest(r.seq_id, r.token_ids, 3, r.hidden_states, temperature=0.8) for r in requests(runner, (-1,))]
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    for draft in cut.propose(batch):
        assert all(t in ids for t in draft.token_ids)
        assert draft.probs.shape == (3, V)
        torch.testing.assert_close(draft.probs.sum(-1), torch.ones(3))
        assert not draft.probs[:, outside].any()
        assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.token_ids))


def test_a_head_with_a_draft_vocabulary_of_its_own_is_refused_by_name(heads, tiny_model_dir, tmp_path):
    write_medusa(tmp_path / "truncated", tiny_model_dir, layout="vllm", draft_vocab_size=128)
    config = {"method": "medusa", "model": str(tmp_path / "truncated"), "num_speculative_tokens": 3}
    config["speculative_token_map"] = write_map(tmp_path / "map.json", range(10))
    resolved = SpeculativeConfig.from_json(config, target_model=str(tiny_model_dir))
    with pytest.raises(TokenMapError, match="has no LM head over the target's whole vocabulary"):
        build_proposer(resolved, max_model_len=512, dtype="float32", target_model=tiny_model_dir)
