"""The head trainer (`tritonspec train`) on a tiny target: training-time test sees what
serving sees, heads learn, runs resume exactly, and the output loads through the same
loaders as published checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from backends.methods.eagle import EagleProposer
from backends.methods.eagle_head import load_eagle
from backends.methods.head_checkpoint import TargetInfo
from backends.serving.proposer import DraftRequest
from backends.training.corpus import OPENINGS, check_held_out, overlaps_held_out, training_prompts
from backends.training.data import prepare, self_written_prompts
from backends.training.eagle import unroll
from backends.training.trainer import head_trainer, make_batch, train, windows
from tests.fixtures.training import EAGLE_METHODS as METHODS
from tests.fixtures.training import EAGLE_SMALL as SMALL


@pytest.fixture(scope="module")
def target_dir(training_target_dir):
    return training_target_dir


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("train-data")


def _data(target_dir, data_dir, method):
    trainer, info = head_trainer(method), TargetInfo.load(target_dir)
    return trainer, info, prepare(target_dir, data_dir, trainer.layer_ids(info), 24, 24)


def test_training_prompts_are_separate_from_the_benchmark():
    prompts = training_prompts()
    assert len(prompts) > 1000 and len(set(prompts)) > 0.9 * len(prompts)
    with pytest.raises(ValueError, match="held-out"):
        check_held_out(prompts[:3] + ["<|im_start|>user\nExplain what a hash table is to a ten-year-old."])


@pytest.mark.parametrize("method", METHODS)
def test_training_time_test_attends_like_serving(method, target_dir, data_dir):
    """Step s of the unroll at anchor t equals running the head causally over the pairs
    (x_1, h_0) .. (x_{t+1}, h_t) followed by the chain's own pairs: what the proposer does."""
    trainer, info, data = _data(target_dir, data_dir, method)
    torch.manual_seed(0)
    head = trainer.build(info, data, {}).eval()
    layer_ids = trainer.layer_ids(info)
    batch = make_batch(data, windows(data, [0, 1], 64)[:2], layer_ids)
    with torch.no_grad():
        steps = unroll(head, batch, 3)
        feats = head.features(batch.hidden[0])
        for t in (2, 5, 9):
            ids = batch.token_ids[0, 1 : t + 2].tolist()
            chain = feats[: t + 1]
            for s in range(1, 4):
                inputs = torch.tensor([ids])
                n = len(ids)
                mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
                out = head(inputs, chain[None], torch.arange(n)[None], mask, DynamicCache(config=head.config))[0, -1]
                torch.testing.assert_close(steps[s - 1][0][0, t], out, atol=1e-4, rtol=1e-4)
                ids.append(int(batch.token_ids[0, t + s + 1]))
                chain = torch.cat([chain, out[None]])


@pytest.fixture(scope="module")
def trained(trained_eagle_heads):
    """method -> (head directory, validation before training, after): tests/conftest.py."""
    return trained_eagle_heads


@pytest.mark.parametrize("method", METHODS)
def test_heads_learn_and_load_through_the_published_loader(method, trained, target_dir, data_dir):
    head_dir, data, before, after = trained[method]
    assert after["step_accuracy"][0] > before["step_accuracy"][0] + 0.1, (before, after)
    assert after["estimated_acceptance_length"] > before["estimated_acceptance_length"]

    # Published layout: the keys the official repositories use, nothing borrowed written out.
    from safetensors import safe_open

    config = json.loads((head_dir / "config.json").read_text())
    with safe_open(head_dir / "model.safetensors", "pt") as st:
        keys = set(st.keys())
        if method == "eagle":
            assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight"} <= keys
            assert not any("input_layernorm" in k or k.startswith(("embed", "lm_head")) for k in keys)
        else:
            assert {"fc.weight", "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= keys
            assert st.get_slice("d2t").get_shape() == [config["draft_vocab_size"]]
            assert config["architectures"] == ["LlamaForCausalLMEagle3"]

    trainer, info = head_trainer(method), TargetInfo.load(target_dir)
    layer_ids = trainer.layer_ids(info)
    proposer = EagleProposer(load_eagle(head_dir, info, "float32", method), max_model_len=512)
    _, val = data.split()
    seq = data.token_ids[data.sequence(val[0])].tolist()
    hidden = torch.stack([data.hidden[i][data.sequence(val[0])][: len(seq) - 1] for i in layer_ids], dim=1).float()
    drafts = proposer.propose([DraftRequest(1, seq, 3, hidden)])[0].token_ids
    assert len(drafts) == 3 and all(0 <= d < info.vocab_size for d in drafts)


def test_an_interrupted_run_resumes_exactly(target_dir, data_dir, tmp_path, monkeypatch):
    whole = train("eagle3", target_dir, tmp_path / "whole", data_dir=data_dir, **SMALL, save_every=2)
    calls = {"n": 0}
    real_step = torch.optim.AdamW.step

    def interrupted_step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        train("eagle3", target_dir, tmp_path / "resumed", data_dir=data_dir, **SMALL, save_every=2)
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    assert torch.load(tmp_path / "resumed" / "train_state.pt", weights_only=False)["step"] == 4
    resumed = train("eagle3", target_dir, tmp_path / "resumed", data_dir=data_dir, **SMALL, save_every=2)
    assert resumed["history"] == whole["history"]
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # A state saved by another run is refused, not silently continued with other settings.
    with pytest.raises(ValueError, match=r"other settings \(lr\)"):
        train("eagle3", target_dir, tmp_path / "resumed", data_dir=data_dir, **{**SMALL, "lr": 3e-4})


def test_the_target_writes_its_own_training_requests(smollm2_dir, tmp_path):
    prompts = self_written_prompts(smollm2_dir, tmp_path, 6, batch_size=8)
    assert len(prompts) == 6 and len(set(prompts)) == 6
    for prompt in prompts:
        request = prompt.removeprefix("<|im_start|>user\n").removesuffix("<|im_end|>\n<|im_start|>assistant\n")
        assert request != prompt and any(request.startswith(o) for o in OPENINGS)
        assert "<|im_end|>" not in request and not overlaps_held_out(prompt)
    # Cached: a smaller count is a prefix of the same list, made without sampling again.
    assert self_written_prompts(smollm2_dir, tmp_path, 4) == prompts[:4]


def test_self_written_prompts_need_a_chat_target(target_dir, tmp_path):
    with pytest.raises(ValueError, match="ChatML"):
        self_written_prompts(target_dir, tmp_path, 4)
    with pytest.raises(ValueError, match="self_prompts must be >= 0"):
        prepare(target_dir, tmp_path, (0,), 4, 8, self_prompts=-1)


def test_cli_train_writes_a_servable_head(target_dir, data_dir, tmp_path, capsys, monkeypatch):
    """The head and, beside it, a token map of its training answers' most frequent tokens, which
    the trained-head lookup (serve, bench) serves it with."""
    from backends.methods.draft_vocab import read_token_map
    from backends.training import head_dir
    from client.cli.common import draft_with_trained_head
    from client.cli.main import main

    monkeypatch.setenv("TRITONSPEC_CACHE", str(tmp_path / "cache"))
    head = head_dir(str(target_dir), "eagle")
    args = ["--data-dir", str(data_dir), "--prompts", "24", "--max-new-tokens", "24", "--epochs", "1"]
    code = main(["train", "eagle", "--target", str(target_dir), "--draft-vocab-size", "64", *args])
    assert code == 0
    out = capsys.readouterr().out
    assert "estimated mean acceptance length" in out and "eagle draft vocabulary: 64 tokens cover" in out
    target = TargetInfo.load(target_dir)
    assert load_eagle(head, target, "float32", "eagle").layout == "eagle"
    assert len(read_token_map(head / "token_map.json", target.vocab_size)) == 64
    config = {"method": "eagle", "num_speculative_tokens": 3}
    draft_with_trained_head(config, str(target_dir), "eagle")
    assert config == {**config, "model": str(head), "speculative_token_map": str(head / "token_map.json")}
    config = {"method": "eagle", "speculative_token_map": "/elsewhere.json"}
    draft_with_trained_head(config, str(target_dir), "eagle")
    assert config["speculative_token_map"] == "/elsewhere.json"  # the config's own map wins
    assert main(["train", "eagle", "--target", str(tmp_path / "missing")]) == 1
    (tmp_path / "empty.json").write_text("[]")
    capsys.readouterr()
    assert main(["train", "eagle", "--target", str(target_dir), "--prompt-file", str(tmp_path / "empty.json")]) == 1
    assert "empty.json: expected a JSON list of non-empty prompts" in capsys.readouterr().err


def test_validation_prompts_feed_the_bench(target_dir, data_dir, tmp_path):
    """The head directory names its never-trained-on prompts, and the bench reads them."""
    from client.cli.bench import load_prompts

    train("eagle", target_dir, tmp_path / "h", data_dir=data_dir, **SMALL)
    written = tmp_path / "h" / "validation_prompts.json"
    data = prepare(target_dir, data_dir, (-1,), SMALL["num_prompts"], SMALL["max_new_tokens"])
    prompts = json.loads((data_dir / "prompts.json").read_text())
    _, validation = data.split()
    assert json.loads(written.read_text()) == [prompts[i] for i in validation] != []
    assert load_prompts(path=written) == (f"file {written.name}", {"custom": [prompts[i] for i in validation]})
    (tmp_path / "bad.json").write_text('{"code": []}')
    with pytest.raises(ValueError, match="bad.json: expected a JSON list"):
        load_prompts(path=tmp_path / "bad.json")
    # A versioned set's own file reads as the set does (vLLM's peer script takes it too).
    from client.cli.bench import PROMPT_SETS

    assert load_prompts(path=PROMPT_SETS["short"])[1] == load_prompts(prompt_set="short")[1]
    # One reader for bench and train --prompt-file: a file not named *.json has a prompt per line.
    (tmp_path / "lines.txt").write_text("first prompt\n\nsecond prompt\n")
    assert load_prompts(path=tmp_path / "lines.txt")[1] == {"custom": ["first prompt", "second prompt"]}
