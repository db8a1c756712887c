"""Parse and check what a client sends to the `speculative` model.

Accepts the union of the vLLM backend's and tensorrt_llm_bls's interfaces: sampling values
as tensors, inside the `sampling_parameters` JSON (numbers may be strings, as genai-perf
sends them), or as request parameters (HTTP `/generate` puts unknown keys there). Explicit
tensors win over `sampling_parameters`, which wins over request parameters.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable


class RequestError(ValueError):
    """A client mistake; the message names the input at fault."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> "SamplingParams":
        return cls(**json.loads(text))


@dataclass
class GenerationRequest:
    prompt: str
    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    exclude_input_in_output: bool = False
    num_draft_tokens: int | None = None  # None = the drafter's configured number
    ignore_eos: bool = False


def _to_bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0"):
        return v.lower() in ("true", "1")
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    raise RequestError(f"{name} must be a boolean, got {v!r}")


def _to_int(name: str, v: Any) -> int:
    if isinstance(v, bool):
        raise RequestError(f"{name} must be an integer, got {v!r}")
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise RequestError(f"{name} must be an integer, got {v!r}") from None
    if not f.is_integer():
        raise RequestError(f"{name} must be an integer, got {v!r}")
    return int(f)


def _to_float(name: str, v: Any) -> float:
    if isinstance(v, bool):
        raise RequestError(f"{name} must be a number, got {v!r}")
    try:
        value = float(v)
    except (TypeError, ValueError):
        raise RequestError(f"{name} must be a number, got {v!r}") from None
    if not math.isfinite(value):  # NaN would pass every range check below
        raise RequestError(f"{name} must be a finite number, got {v!r}")
    return value


def _to_str_list(name: str, v: Any) -> list[str]:
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v):
        return [s for s in v if s]
    raise RequestError(f"{name} must be a string or a list of strings, got {v!r}")


# key -> (field it sets, converter); `seed`/`stop` are vLLM's names, the others TRT-LLM's.
_KEYS: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "max_tokens": ("max_tokens", _to_int),
    "temperature": ("temperature", _to_float),
    "top_k": ("top_k", _to_int),
    "top_p": ("top_p", _to_float),
    "seed": ("seed", _to_int),
    "random_seed": ("seed", _to_int),
    "stop": ("stop", _to_str_list),
    "stop_words": ("stop", _to_str_list),
    "num_draft_tokens": ("num_draft_tokens", _to_int),
    "ignore_eos": ("ignore_eos", _to_bool),
    "stream": ("stream", _to_bool),
    "exclude_input_in_output": ("exclude_input_in_output", _to_bool),
}


def _collect(source: str, values: dict[str, Any], into: dict[str, Any]) -> None:
    for key, value in values.items():
        if key not in _KEYS:
            raise RequestError(
                f"unknown key {key!r} in {source}; supported: {', '.join(sorted(_KEYS))}"
            )
        name, convert = _KEYS[key]
        into[name] = convert(key, value)


def _parse_json_object(source: str, text: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"{source} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise RequestError(f"{source} must be a JSON object, got {type(value).__name__}")
    return value


def parse_request(
    tensors: dict[str, Any], parameters_json: str = "", sampling_json: str = ""
) -> GenerationRequest:
    """Build a GenerationRequest from decoded input tensors (python scalars/lists),
    the request's parameters JSON and the `sampling_parameters` JSON."""
    prompt = tensors.get("text_input")
    if prompt is None:
        raise RequestError("text_input is required")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("text_input is empty")

    values: dict[str, Any] = {}
    # HTTP /generate also sends the input tensors' own names as parameters: skip those.
    params = _parse_json_object("request parameters", parameters_json)
    _collect("request parameters", {k: v for k, v in params.items() if k not in tensors}, values)
    _collect("sampling_parameters", _parse_json_object("sampling_parameters", sampling_json), values)
    _collect("inputs", {k: v for k, v in tensors.items() if k in _KEYS}, values)

    max_tokens = values.get("max_tokens", 16)
    if max_tokens <= 0:
        raise RequestError(f"max_tokens must be at least 1, got {max_tokens}")
    temperature = values.get("temperature", 0.0)
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}")
    top_k = values.get("top_k")
    if top_k is not None and top_k < -1:
        raise RequestError(f"top_k must be -1, 0 (both: off) or a positive integer, got {top_k}")
    top_p = values.get("top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    seed = values.get("seed")
    if seed is not None and not 0 <= seed < 2**63:
        raise RequestError(f"seed must be a non-negative 63-bit integer, got {seed}")
    num_draft = values.get("num_draft_tokens")
    if num_draft is not None and num_draft < 0:
        raise RequestError(f"num_draft_tokens must be >= 0, got {num_draft}")
    stream = values.get("stream", False)
    exclude = values.get("exclude_input_in_output", stream)
    if stream and not exclude:
        raise RequestError("exclude_input_in_output=false is not supported with stream=true")

    return GenerationRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=SamplingParams(
            temperature=temperature,
            top_k=top_k if top_k and top_k > 0 else None,
            top_p=top_p if top_p is not None and top_p < 1 else None,
            seed=seed,
        ),
        stop=values.get("stop", []),
        stream=stream,
        exclude_input_in_output=exclude,
        num_draft_tokens=num_draft,
        ignore_eos=values.get("ignore_eos", False),
    )
