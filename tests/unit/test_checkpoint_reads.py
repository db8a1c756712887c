"""A served head's config.json is read once: by the speculative config resolution, which
hands the dict on (DrafterConfig.checkpoint_config), so neither `describe_drafter` (the
layers a drafter takes) nor the head loaders behind `build_proposer` read the file again."""

from __future__ import annotations

import builtins
import io
import os
from collections import Counter
from pathlib import Path

import pytest

from backends.config import DrafterConfig, SpeculativeConfig
from backends.serving.proposer import build_proposer, describe_drafter
from tests.fixtures.synthetic_blocks import write_dflash, write_dspark
from tests.fixtures.synthetic_checkpoints import write_eagle1, write_eagle3
from tests.fixtures.synthetic_heads import write_medusa, write_mlp_speculator, write_mtp

# method -> (writer, its options, k)
HEADS = {
    "eagle": (write_eagle1, {}, 3),
    "eagle3": (write_eagle3, {}, 3),
    "eagle3-speculators": (write_eagle3, {"speculators": True, "spelling": "layers.0."}, 3),
    "mtp": (write_mtp, {}, 1),
    "medusa": (write_medusa, {}, 3),
    "mlp_speculator": (write_mlp_speculator, {}, 3),
    "dflash": (write_dflash, {}, 3),
    "dspark": (write_dspark, {}, 3),
}


@pytest.fixture
def config_reads(monkeypatch) -> Counter:
    """How often each config.json (resolved path) is opened for reading while the test runs:
    open() and pathlib's io.open both count; writing a checkpoint does not."""
    reads: Counter = Counter()
    real_open = io.open

    def counting_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.path.basename(file) == "config.json" and "r" in mode:
            reads[Path(file).resolve()] += 1
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)
    return reads


@pytest.mark.parametrize("name", HEADS)
def test_config_json_is_read_once_per_load(name, tiny3_model_dir, tmp_path, config_reads):
    target = tiny3_model_dir  # three layers: eagle3's default aux layers exist
    writer, opts, k = HEADS[name]
    draft = tmp_path / name
    writer(draft, target, **opts)
    method = name.split("-")[0]
    spec = {"method": method, "model": str(draft), "num_speculative_tokens": k}
    config = SpeculativeConfig.from_json(spec, target_model=str(target))
    assert config.checkpoint_config is not None
    info = describe_drafter(config, target)
    proposer = build_proposer(config, max_model_len=512, dtype="float32", target_model=target)
    assert tuple(proposer.hidden_layer_ids) == info.hidden_layer_ids
    assert config_reads[(draft / "config.json").resolve()] == 1


def test_a_config_without_the_dict_reads_the_file(tiny_model_dir, tmp_path, config_reads):
    """A DrafterConfig built by hand (no checkpoint_config) still loads: the loader reads."""
    write_medusa(tmp_path / "medusa", tiny_model_dir)
    config = DrafterConfig("medusa", str(tmp_path / "medusa"), 3, draft_hf_config={})
    proposer = build_proposer(config, max_model_len=512, dtype="float32", target_model=tiny_model_dir)
    assert proposer.head.num_heads == 3
    assert config_reads[(tmp_path / "medusa" / "config.json").resolve()] == 1
