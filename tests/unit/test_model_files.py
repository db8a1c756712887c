"""A model directory's config and tokenizer read without transformers' config classes
(model_store.model_config / load_tokenizer): the same values as transformers reads, the
fallback to transformers wherever that is not certain, and a server start that never imports
them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from backends.runtime.lean_lm import unsupported_reason
from backends.runtime.model_store import PLAIN_CONFIG_FIELDS, PlainConfig, load_tokenizer, model_config, plain_config
from tests.fixtures.lean_models import TINY

# What the runtime and the server read beside PLAIN_CONFIG_FIELDS (with getattr defaults).
ALSO_READ = ("model_type", "head_dim", "sliding_window", "layer_types", "use_sliding_window")
MISSING = object()


def _saved(tmp_path: Path, config) -> Path:
    config.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(**TINY),
        LlamaConfig(**TINY, head_dim=32, tie_word_embeddings=True, rope_theta=1e5, eos_token_id=[1, 2]),
        Qwen2Config(**TINY),
        Qwen2Config(**TINY, use_sliding_window=True, sliding_window=64, max_window_layers=1),
        Qwen3Config(**TINY),
        MistralConfig(**TINY),
        MistralConfig(**TINY, sliding_window=None),
    ],
    ids=["llama", "llama-tied", "qwen2", "qwen2-sliding", "qwen3", "mistral", "mistral-full"],
)
def test_config_json_reads_as_transformers_reads_it(tmp_path, config):
    where = _saved(tmp_path, config)
    plain, auto = plain_config(where), AutoConfig.from_pretrained(where)
    assert isinstance(plain, PlainConfig)
    for name in (*PLAIN_CONFIG_FIELDS, *ALSO_READ):
        assert getattr(plain, name, MISSING) == getattr(auto, name, MISSING), name
    assert unsupported_reason(plain) == unsupported_reason(auto)
    assert plain.get_text_config() is plain


def _edited(tmp_path: Path, **changes) -> Path:
    where = _saved(tmp_path, LlamaConfig(**TINY))
    cfg = json.loads((where / "config.json").read_text())
    cfg.update(changes)
    (where / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not MISSING}))
    return where


@pytest.mark.parametrize(
    "changes",
    [
        {"transformers_version": "4.46.0"},  # older configs leave fields to the class's defaults
        {"head_dim": MISSING},
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
        {"model_type": "gpt2"},
    ],
    ids=["transformers-4", "no-head_dim", "linear-rope", "gpt2"],
)
def test_configs_it_cannot_be_sure_of_go_to_transformers(tmp_path, changes):
    where = _edited(tmp_path, **changes)
    assert plain_config(where) is None
    if changes.get("model_type") != "gpt2":  # a gpt2 config.json of llama's fields does not load
        assert not isinstance(model_config(where), PlainConfig)


def test_a_gguf_file_goes_to_transformers(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert plain_config(tmp_path / "model.gguf") is None


def test_a_llama_tokenizer_loads_as_autotokenizer_loads_it(tiny_model_dir):
    ours, auto = load_tokenizer(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(ours) is type(auto)
    text = "def add(a, b):\n    return a + b  # café 東京"
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    assert ours.decode(auto(text)["input_ids"]) == auto.decode(auto(text)["input_ids"]) == text
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (auto.eos_token_id, auto.bos_token_id, len(auto))


def test_a_qwen2_tokenizer_is_left_to_autotokenizer(tiny_model_dir, tmp_path, monkeypatch):
    """AutoTokenizer loads Qwen2's own class for a qwen2 model whatever tokenizer_config.json
    names: only a llama model's generic tokenizer is loaded directly."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    _saved(tmp_path, Qwen2Config(**TINY))
    import transformers

    asked = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: asked.append(a) or "auto")
    assert load_tokenizer(tmp_path) == "auto" and asked


def test_serving_a_lean_model_imports_no_transformers_config_class(tiny_model_dir):
    """What a server's `speculative` process does at start on a lean-runtime target (read the
    config and tokenizer, build the target's engine, import the serving code): transformers'
    config classes import torch.distributed, ~1.5 s of every server process's start."""
    script = f"""
import sys
from pathlib import Path
import backends.serving.session, backends.structured.grammar, backends.triton_models.topology
from backends.runtime.model_store import load_tokenizer, model_config
from backends.serving.target import TargetRunner
path = Path({str(tiny_model_dir)!r})
model_config(path), load_tokenizer(path), TargetRunner(path, dtype="float32", kv_cache_memory_gb=0.01)
print(sorted(m for m in sys.modules if m.startswith("transformers.") and "configuration" in m))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
