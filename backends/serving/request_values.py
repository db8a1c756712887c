"""How each key a client sends is read: one converter per kind of value (each names the key
in the RequestError it raises), and the rest of vLLM's SamplingParams, accepted at the
values that change nothing and refused by name otherwise (request.py's key table uses both)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from backends.serving.request_errors import RequestError
from backends.serving.request_errors import shown as _shown

# Every number is bounded here, before it reaches a tensor: the verifier and drafter get
# them as INT32 / FP32 (top_k = 1e19 used to overflow in the sampler and fail the batch).
MAX_INT32 = 2**31 - 1
MAX_FLOAT32 = 3.4028234663852886e38
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
MAX_ALLOWED_TOKEN_IDS = 2**18  # allowed_token_ids: up to a whole vocabulary (the largest are ~256k)


def to_bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0"):
        return v.lower() in ("true", "1")
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    raise RequestError(f"{name} must be a boolean, got {_shown(v)}")


def to_int(name: str, v: Any) -> int:
    if isinstance(v, bool):
        raise RequestError(f"{name} must be an integer, got {_shown(v)}")
    if isinstance(v, int):  # exact: a float round trip would turn 2**63 - 1 into 2**63
        return v
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            pass
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise RequestError(f"{name} must be an integer, got {_shown(v)}") from None
    if not f.is_integer():
        raise RequestError(f"{name} must be an integer, got {_shown(v)}")
    return int(f)


def to_float(name: str, v: Any) -> float:
    if isinstance(v, bool):
        raise RequestError(f"{name} must be a number, got {_shown(v)}")
    try:
        value = float(v)
    except (TypeError, ValueError):
        raise RequestError(f"{name} must be a number, got {_shown(v)}") from None
    # NaN would pass every range check below; beyond float32 it turns into inf on its way
    # to the verifier (which receives it as FP32).
    if not math.isfinite(value) or abs(value) > MAX_FLOAT32:
        raise RequestError(f"{name} must be a finite number, got {_shown(v)}")
    return value


def to_str_list(name: str, v: Any) -> list[str]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) for s in v):
        raise RequestError(f"{name} must be a string or a list of strings, got {_shown(v)}")
    stops = [s for s in v if s]
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"{name}: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    longest = max(stops, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise RequestError(
            f"{name}: a stop string may have at most {MAX_STOP_CHARS} characters, got one of {len(longest)}"
        )
    return stops


def to_stop(name: str, v: Any) -> list[str]:
    """vLLM's `stop`: an empty string would match everywhere (TRT-LLM's `stop_words` keeps
    reading "" as none, as its examples send it)."""
    if v == "" or isinstance(v, (list, tuple)) and "" in v:
        raise RequestError(f"{name} cannot contain an empty string")  # vLLM's words
    return to_str_list(name, v)


def to_allowed_ids(name: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not v:
        raise RequestError(f"{name} must be a non-empty list of token ids, got {_shown(v)}")
    if len(v) > MAX_ALLOWED_TOKEN_IDS:
        raise RequestError(f"{name}: at most {MAX_ALLOWED_TOKEN_IDS} token ids, got {len(v)}")
    return tuple(sorted({to_int(name, t) for t in v}))


MAX_LOGPROBS = 20  # vLLM's default max_logprobs (OpenAI's top_logprobs limit too)
MAX_TOKEN_IDS = 1024  # entries in stop_token_ids / logit_bias


def to_list(v: Any) -> list | tuple:
    return v if isinstance(v, (list, tuple)) else [v]


def to_int_list(name: str, v: Any) -> list[int]:
    ids = [to_int(name, x) for x in to_list(v)]
    if len(ids) > MAX_TOKEN_IDS:
        raise RequestError(f"{name}: at most {MAX_TOKEN_IDS} token ids, got {len(ids)}")
    return ids


def to_logit_bias(name: str, v: Any) -> tuple[tuple[int, float], ...]:
    if not isinstance(v, dict):
        raise RequestError(f"{name} must be an object mapping token ids to biases, got {_shown(v)}")
    if len(v) > MAX_TOKEN_IDS:
        raise RequestError(f"{name}: at most {MAX_TOKEN_IDS} token ids, got {len(v)}")
    pairs = tuple((to_int(f"{name} key", k), to_float(f"{name}[{k}]", bias)) for k, bias in v.items())
    for token, bias in pairs:
        if not -100 <= bias <= 100:  # OpenAI's range
            raise RequestError(f"{name}[{token}] must be in [-100, 100], got {bias}")
    return pairs


def to_logprobs(name: str, v: Any) -> int | None:
    if v is None:
        return None
    n = to_int(name, v)
    if not 0 <= n <= MAX_LOGPROBS:
        raise RequestError(f"{name} must be in [0, {MAX_LOGPROBS}] (alternatives per token), got {n}")
    return n


def to_prompt_logprobs(name: str, v: Any) -> int:
    """vLLM's prompt_logprobs: alternatives per prompt token, -1 for the whole vocabulary
    (which counts against MAX_LOGPROBS once the vocabulary is known: bind_token_ids)."""
    n = to_int(name, v)
    if n != -1 and not 0 <= n <= MAX_LOGPROBS:
        raise RequestError(
            f"{name} must be -1 (the whole vocabulary) or in [0, {MAX_LOGPROBS}] (alternatives per prompt token), got {n}"
        )
    return n


def to_salt(name: str, v: Any) -> str:
    if not isinstance(v, str) or not v:  # vLLM's rule
        raise RequestError(f"{name} must be a non-empty string, got {_shown(v)}")
    return v


def only(convert: Callable[[str, Any], Any], neutral: Any, hint: str) -> Callable[[str, Any], None]:
    """A vLLM sampling key accepted at the value that changes nothing, refused otherwise with
    what to do instead."""

    def check(name: str, v: Any) -> None:
        if convert(name, v) != neutral:
            raise RequestError(
                f"{name} is only supported at its default {json.dumps(neutral)}, got {_shown(v)}: {hint}"
            )

    return check


def refused(hint: str) -> Callable[[str, Any], None]:
    """A vLLM key whose only neutral value is null (skipped before this runs)."""

    def check(name: str, v: Any) -> None:
        raise RequestError(f"{name} is not supported, got {_shown(v)}: {hint}")

    return check


def accepted(convert: Callable[[str, Any], Any]) -> Callable[[str, Any], None]:
    """A key vLLM derives itself or that changes nothing here, at any well-typed value."""

    def check(name: str, v: Any) -> None:
        convert(name, v)

    return check


def to_output_kind(name: str, v: Any) -> int:
    """vLLM's RequestOutputKind, by value or name; here `stream` decides what each response
    carries (the vLLM backend sets output_kind from it too), so all three are neutral."""
    kinds = {"CUMULATIVE": 0, "DELTA": 1, "FINAL_ONLY": 2}
    kind = kinds.get(v.rpartition(".")[2].upper()) if isinstance(v, str) else v
    if kind not in kinds.values() or isinstance(kind, bool):
        raise RequestError(f"{name} must be one of {', '.join(kinds)} (or 0, 1, 2), got {_shown(v)}")
    return kind


SEPARATE = "send separate requests (the OpenAI front end's `n` does so)"
# The rest of vLLM's SamplingParams, so that its complete default dict is accepted: the
# fields of vllm/sampling_params.py at vLLM commits db573835 (the v0.6 line) and 00388f65
# (2026), and the vLLM backend's lora_name. Each is accepted at the values that change nothing
# here ("" = no field to set) and refused by name otherwise, saying what to do instead.
VLLM_NEUTRAL_KEYS: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "n": ("", only(to_int, 1, SEPARATE)),
    "best_of": ("", only(to_int, 1, SEPARATE + " and pick the best")),
    "use_beam_search": ("", only(to_bool, False, "beam search is not served; decode greedily (temperature 0)")),
    "length_penalty": ("", only(to_float, 1.0, "it weighs beam search, which is not served")),
    "early_stopping": ("", only(to_bool, False, "it stops beam search, which is not served")),
    "prompt_logprob_token_ids": ("", refused("ask `prompt_logprobs: N` for the N most likely tokens")),
    "prompt_logprob_start": ("", refused("prompt logprobs start at the prompt's second token")),
    "logprob_token_ids": ("", refused("ask `logprobs: N` for the N most likely tokens")),
    "flat_logprobs": ("", only(to_bool, False, "logprobs come in the vLLM backend's shape")),
    "truncate_prompt_tokens": ("", refused("shorten the prompt before sending it")),
    "logits_processors": ("", only(lambda name, v: v, [], "custom logits processors do not travel in a request")),
    "extra_args": ("", only(lambda name, v: v, {}, "no sampling plugin reads them here")),
    "thinking_token_budget": ("", only(to_int, -1, "no reasoning budget is enforced here")),
    "repetition_detection": ("", refused("no repetition detection runs here; use stop strings or max_tokens")),
    "trace_decode_token_ids": ("", refused("forced decoding is not served")),
    "routed_experts_prompt_start": ("", only(to_int, 0, "routed-expert traces are not returned")),
    "lora_name": ("", refused("LoRA adapters are not served; serve the merged model")),
    "skip_special_tokens": ("", only(to_bool, True, "special tokens are always left out of the text")),
    "spaces_between_special_tokens": ("", only(to_bool, True, "special tokens are left out of the text")),
    "include_stop_str_in_output": ("", only(to_bool, False, "the text ends before the stop string")),
    "detokenize": ("", only(to_bool, True, "the output is always text (with output_ids)")),
    "output_kind": ("", to_output_kind),
    "skip_clone": ("", accepted(to_bool)),
    "skip_reading_prefix_cache": ("", accepted(to_bool)),
    # Derived by vLLM itself (from stop, stop_token_ids, bad_words and the model) and set again there.
    "output_text_buffer_length": ("", accepted(to_int)),
    "_all_stop_token_ids": ("", accepted(to_int_list)),
    "_eos_token_id": ("", accepted(to_int)),
    "_bad_words_token_ids": ("", accepted(lambda name, v: [to_int_list(name, w) for w in to_list(v)])),
}
