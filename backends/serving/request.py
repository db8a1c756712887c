"""Parse and check what a client sends to the `speculative` model.

Accepts the union of the vLLM backend's and tensorrt_llm_bls's interfaces: sampling values
as tensors, inside the `sampling_parameters` JSON (numbers may be strings, as genai-perf
sends them), or as request parameters (HTTP `/generate` puts unknown keys there). Explicit
tensors win over `sampling_parameters`, which wins over request parameters.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from backends.serving.request_errors import RequestError
from backends.serving.request_errors import shown as _shown
from backends.serving.structured_params import STRUCTURED_KEYS, parse_structured
from backends.structured.spec import StructuredOutputs

if TYPE_CHECKING:
    import torch


# Every number is bounded here, before it reaches a tensor: the verifier and drafter get
# them as INT32 / FP32 (top_k = 1e19 used to overflow in the sampler and fail the batch).
MAX_INT32 = 2**31 - 1
MAX_FLOAT32 = 3.4028234663852886e38
MAX_DRAFT_TOKENS = 128  # vLLM V1's limit on drafts per request (rejection.MAX_SPEC_LEN)
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
MAX_ALLOWED_TOKEN_IDS = 2**18  # allowed_token_ids: up to a whole vocabulary (the largest are ~256k)
# Below this temperature a request decodes greedily (vLLM's _SAMPLING_EPS, vllm/sampling_params.py):
# the verifier takes the argmax and the drafters draft it. Where the tokens are decided this was
# always the rule, and a temperature that small would overflow softmax(logits / t) anyway.
GREEDY_TEMPERATURE_EPS = 1e-5


def is_greedy(temperature: float | torch.Tensor) -> bool | torch.Tensor:
    """Whether a temperature decodes greedily (elementwise for a tensor of them): the one
    definition of greedy, in the loop, the verifier, the rejection sampler and the drafters."""
    return temperature < GREEDY_TEMPERATURE_EPS


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # greedy below GREEDY_TEMPERATURE_EPS (is_greedy)
    top_k: int | None = None
    top_p: float | None = None
    min_p: float = 0.0  # vLLM's: tokens below min_p x the most likely one's probability are dropped
    seed: int | None = None
    # Token controls, applied by the verifier to the target's logits at every position
    # (backends/serving/logits.py); the defaults change nothing.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()  # only these may be emitted; () = any
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # from GenerationRequest.bad_words (bind_token_ids)
    min_tokens_stop_ids: tuple[int, ...] = ()  # masked until min_tokens are out: EOS, stop_token_ids
    logprobs: int | None = None  # alternatives reported per emitted token; None: no logprobs
    # Set by the orchestrator from a `rejection_sample_method: "synthetic"` drafter config (never
    # by a client): drafts are accepted at these rates, for benchmarking (not lossless).
    synthetic_acceptance_rates: tuple[float, ...] = ()
    # vLLM's cache_salt: the request shares prefix-cache blocks only with requests of the same
    # salt (it goes into the first block's key), so other tenants cannot time its prompt.
    cache_salt: str = ""

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    @property
    def processes_logits(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.min_tokens > 0
            or bool(self.logit_bias)
            or bool(self.bad_words_ids)
            or bool(self.allowed_token_ids)
            or (self.min_p > 0 and not self.greedy)
        )

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> SamplingParams:
        """The orchestrator's parameters as the verifier receives them, checked again: the
        verifier must not trust what reaches it (RequestError names the bad field)."""
        try:
            params = cls(**_tuples(json.loads(text)))
        except (TypeError, ValueError, RecursionError) as e:
            raise RequestError(f"malformed sampling parameters: {str(e)[:200]}") from None
        for name, value, low, high in (
            ("temperature", params.temperature, 0, MAX_FLOAT32),
            ("top_k", params.top_k, 1, MAX_INT32),
            ("top_p", params.top_p, 0, 1),
            ("min_p", params.min_p, 0, 1),
            ("seed", params.seed, 0, 2**63 - 1),
        ):
            integral = name in ("top_k", "seed")
            if value is None and name not in ("temperature", "min_p"):
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, int if integral else (int, float))
                or not low <= value <= high
            ):
                raise RequestError(
                    f"sampling parameter {name} must be {'an integer' if integral else 'a number'} "
                    f"in [{low}, {high}], got {_shown(value)}"
                )
        _check_token_controls(params)
        if not isinstance(params.cache_salt, str):
            raise RequestError(f"sampling parameter cache_salt must be a string, got {_shown(params.cache_salt)}")
        return params


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
    stop_token_ids: list[int] = field(default_factory=list)  # end the output, like EOS
    bad_words: list[str] = field(default_factory=list)  # tokenized into sampling.bad_words_ids
    stream_interval: int | None = None  # tokens per streamed response; None: the server's setting
    # The vLLM backend's return_* flags that are set (without the prefix): these outputs go
    # on every response, with that backend's meaning.
    returns: frozenset[str] = frozenset()
    # What the output must follow (a JSON schema, regex, choice, grammar); None: free text.
    structured: StructuredOutputs | None = None


def _to_bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0"):
        return v.lower() in ("true", "1")
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    raise RequestError(f"{name} must be a boolean, got {_shown(v)}")


def _to_int(name: str, v: Any) -> int:
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


def _to_float(name: str, v: Any) -> float:
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


def _to_str_list(name: str, v: Any) -> list[str]:
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


def _to_stop(name: str, v: Any) -> list[str]:
    """vLLM's `stop`: an empty string would match everywhere (TRT-LLM's `stop_words` keeps
    reading "" as none, as its examples send it)."""
    if v == "" or isinstance(v, (list, tuple)) and "" in v:
        raise RequestError(f"{name} cannot contain an empty string")  # vLLM's words
    return _to_str_list(name, v)


def _to_allowed_ids(name: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not v:
        raise RequestError(f"{name} must be a non-empty list of token ids, got {_shown(v)}")
    if len(v) > MAX_ALLOWED_TOKEN_IDS:
        raise RequestError(f"{name}: at most {MAX_ALLOWED_TOKEN_IDS} token ids, got {len(v)}")
    return tuple(sorted({_to_int(name, t) for t in v}))


MAX_LOGPROBS = 20  # vLLM's default max_logprobs (OpenAI's top_logprobs limit too)
MAX_TOKEN_IDS = 1024  # entries in stop_token_ids / logit_bias
RETURN_OUTPUTS = ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens")


def _to_list(v: Any) -> list | tuple:
    return v if isinstance(v, (list, tuple)) else [v]


def _to_int_list(name: str, v: Any) -> list[int]:
    ids = [_to_int(name, x) for x in _to_list(v)]
    if len(ids) > MAX_TOKEN_IDS:
        raise RequestError(f"{name}: at most {MAX_TOKEN_IDS} token ids, got {len(ids)}")
    return ids


def _to_logit_bias(name: str, v: Any) -> tuple[tuple[int, float], ...]:
    if not isinstance(v, dict):
        raise RequestError(f"{name} must be an object mapping token ids to biases, got {_shown(v)}")
    if len(v) > MAX_TOKEN_IDS:
        raise RequestError(f"{name}: at most {MAX_TOKEN_IDS} token ids, got {len(v)}")
    pairs = tuple((_to_int(f"{name} key", k), _to_float(f"{name}[{k}]", bias)) for k, bias in v.items())
    for token, bias in pairs:
        if not -100 <= bias <= 100:  # OpenAI's range
            raise RequestError(f"{name}[{token}] must be in [-100, 100], got {bias}")
    return pairs


def _to_logprobs(name: str, v: Any) -> int | None:
    if v is None:
        return None
    n = _to_int(name, v)
    if not 0 <= n <= MAX_LOGPROBS:
        raise RequestError(f"{name} must be in [0, {MAX_LOGPROBS}] (alternatives per token), got {n}")
    return n


def _to_salt(name: str, v: Any) -> str:
    if not isinstance(v, str) or not v:  # vLLM's rule
        raise RequestError(f"{name} must be a non-empty string, got {_shown(v)}")
    return v


def _only(convert: Callable[[str, Any], Any], neutral: Any, hint: str) -> Callable[[str, Any], None]:
    """A vLLM sampling key accepted at the value that changes nothing, refused otherwise with
    what to do instead."""

    def check(name: str, v: Any) -> None:
        if convert(name, v) != neutral:
            raise RequestError(
                f"{name} is only supported at its default {json.dumps(neutral)}, got {_shown(v)}: {hint}"
            )

    return check


def _refused(hint: str) -> Callable[[str, Any], None]:
    """A vLLM key whose only neutral value is null (skipped before this runs)."""

    def check(name: str, v: Any) -> None:
        raise RequestError(f"{name} is not supported, got {_shown(v)}: {hint}")

    return check


def _accepted(convert: Callable[[str, Any], Any]) -> Callable[[str, Any], None]:
    """A key vLLM derives itself or that changes nothing here, at any well-typed value."""

    def check(name: str, v: Any) -> None:
        convert(name, v)

    return check


def _to_output_kind(name: str, v: Any) -> int:
    """vLLM's RequestOutputKind, by value or name; here `stream` decides what each response
    carries (the vLLM backend sets output_kind from it too), so all three are neutral."""
    kinds = {"CUMULATIVE": 0, "DELTA": 1, "FINAL_ONLY": 2}
    kind = kinds.get(v.rpartition(".")[2].upper()) if isinstance(v, str) else v
    if kind not in kinds.values() or isinstance(kind, bool):
        raise RequestError(f"{name} must be one of {', '.join(kinds)} (or 0, 1, 2), got {_shown(v)}")
    return kind


def _check_token_controls(params: SamplingParams) -> None:
    """The verifier's check of the token controls it received (see parse_request)."""
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RequestError(f"sampling parameter {name} must be a finite number, got {_shown(value)}")
    ids = [t for t, _ in params.logit_bias] + [t for word in params.bad_words_ids for t in word]
    ids += list(params.allowed_token_ids)
    ids += list(params.min_tokens_stop_ids) + [params.min_tokens] + [params.logprobs or 0]
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT32 for t in ids):
        raise RequestError("malformed sampling parameters: token ids and counts must be non-negative integers")


def _tuples(values: Any) -> Any:
    """SamplingParams' fields as JSON carried them: its tuples (of tuples) became lists."""
    if not isinstance(values, dict):
        return values
    for name, value in values.items():
        if isinstance(value, list):
            values[name] = tuple(tuple(item) if isinstance(item, list) else item for item in value)
    return values


_SEPARATE = "send separate requests (the OpenAI front end's `n` does so)"
# The rest of vLLM's SamplingParams, so that its complete default dict is accepted: the
# fields of vllm/sampling_params.py at vLLM commits db573835 (the v0.6 line) and 00388f65
# (2026), and the vLLM backend's lora_name. Each is accepted at the values that change nothing
# here ("" = no field to set) and refused by name otherwise, saying what to do instead.
VLLM_NEUTRAL_KEYS: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "n": ("", _only(_to_int, 1, _SEPARATE)),
    "best_of": ("", _only(_to_int, 1, _SEPARATE + " and pick the best")),
    "use_beam_search": ("", _only(_to_bool, False, "beam search is not served; decode greedily (temperature 0)")),
    "length_penalty": ("", _only(_to_float, 1.0, "it weighs beam search, which is not served")),
    "early_stopping": ("", _only(_to_bool, False, "it stops beam search, which is not served")),
    "prompt_logprobs": ("", _refused("logprobs of the prompt are not returned; ask `logprobs` for the output")),
    "prompt_logprob_token_ids": ("", _refused("logprobs of the prompt are not returned")),
    "prompt_logprob_start": ("", _refused("logprobs of the prompt are not returned")),
    "logprob_token_ids": ("", _refused("ask `logprobs: N` for the N most likely tokens")),
    "flat_logprobs": ("", _only(_to_bool, False, "logprobs come in the vLLM backend's shape")),
    "truncate_prompt_tokens": ("", _refused("shorten the prompt before sending it")),
    "logits_processors": ("", _only(lambda name, v: v, [], "custom logits processors do not travel in a request")),
    "extra_args": ("", _only(lambda name, v: v, {}, "no sampling plugin reads them here")),
    "thinking_token_budget": ("", _only(_to_int, -1, "no reasoning budget is enforced here")),
    "repetition_detection": ("", _refused("no repetition detection runs here; use stop strings or max_tokens")),
    "trace_decode_token_ids": ("", _refused("forced decoding is not served")),
    "routed_experts_prompt_start": ("", _only(_to_int, 0, "routed-expert traces are not returned")),
    "lora_name": ("", _refused("LoRA adapters are not served; serve the merged model")),
    "skip_special_tokens": ("", _only(_to_bool, True, "special tokens are always left out of the text")),
    "spaces_between_special_tokens": ("", _only(_to_bool, True, "special tokens are left out of the text")),
    "include_stop_str_in_output": ("", _only(_to_bool, False, "the text ends before the stop string")),
    "detokenize": ("", _only(_to_bool, True, "the output is always text (with output_ids)")),
    "output_kind": ("", _to_output_kind),
    "skip_clone": ("", _accepted(_to_bool)),
    "skip_reading_prefix_cache": ("", _accepted(_to_bool)),
    # Derived by vLLM itself (from stop, stop_token_ids, bad_words and the model) and set again there.
    "output_text_buffer_length": ("", _accepted(_to_int)),
    "_all_stop_token_ids": ("", _accepted(_to_int_list)),
    "_eos_token_id": ("", _accepted(_to_int)),
    "_bad_words_token_ids": ("", _accepted(lambda name, v: [_to_int_list(name, w) for w in _to_list(v)])),
}


# key -> (field it sets, converter); `seed`/`stop` are vLLM's names, the others TRT-LLM's. A
# key sent as null is left out, as the vLLM backend leaves it (its defaults apply).
_KEYS: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "max_tokens": ("max_tokens", _to_int),
    "temperature": ("temperature", _to_float),
    "top_k": ("top_k", _to_int),
    "top_p": ("top_p", _to_float),
    "min_p": ("min_p", _to_float),
    "seed": ("seed", _to_int),
    "random_seed": ("seed", _to_int),
    "stop": ("stop", _to_stop),
    "stop_words": ("stop", _to_str_list),
    "num_draft_tokens": ("num_draft_tokens", _to_int),
    "ignore_eos": ("ignore_eos", _to_bool),
    "stream": ("stream", _to_bool),
    "stream_interval": ("stream_interval", _to_int),
    "exclude_input_in_output": ("exclude_input_in_output", _to_bool),
    # Token controls (vLLM's names; min_length and bad_words are TRT-LLM's too).
    "repetition_penalty": ("repetition_penalty", _to_float),
    "presence_penalty": ("presence_penalty", _to_float),
    "frequency_penalty": ("frequency_penalty", _to_float),
    "min_tokens": ("min_tokens", _to_int),
    "min_length": ("min_tokens", _to_int),
    "stop_token_ids": ("stop_token_ids", _to_int_list),
    "bad_words": ("bad_words", _to_str_list),
    "logit_bias": ("logit_bias", _to_logit_bias),
    "allowed_token_ids": ("allowed_token_ids", _to_allowed_ids),
    "logprobs": ("logprobs", _to_logprobs),
    "cache_salt": ("cache_salt", _to_salt),  # vLLM's: prefix-cache isolation between tenants
    # The vLLM backend's additional outputs (r24.12+).
    **{f"return_{name}": (f"return_{name}", _to_bool) for name in RETURN_OUTPUTS},
    # Structured outputs, read as a whole by structured_params.parse_structured.
    **{key: (key, lambda name, v: v) for key in STRUCTURED_KEYS},
    **VLLM_NEUTRAL_KEYS,
}


def _collect(source: str, values: dict[str, Any], into: dict[str, Any]) -> None:
    for key, value in values.items():
        if key not in _KEYS:
            raise RequestError(f"unknown key {_shown(key)} in {source}; supported: {', '.join(sorted(_KEYS))}")
        if value is None:
            continue
        name, convert = _KEYS[key]
        converted = convert(key, value)
        if name:
            into[name] = converted


def _parse_json_object(source: str, text: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:  # also numbers over 4300 digits, deep nesting
        raise RequestError(f"{source} is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(value, dict):
        raise RequestError(f"{source} must be a JSON object, got {type(value).__name__}")
    return value


def parse_request(tensors: dict[str, Any], parameters_json: str = "", sampling_json: str = "") -> GenerationRequest:
    """Build a GenerationRequest from decoded input tensors (python scalars/lists),
    the request's parameters JSON and the `sampling_parameters` JSON."""
    prompt = _prompt(tensors)
    values = _gather(tensors, parameters_json, sampling_json)
    max_tokens = _check_lengths(values)
    _check_sampling(values)
    _check_controls(values, max_tokens)
    stream, exclude = _stream_flags(values)
    return GenerationRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=_sampling(values),
        stop=values.get("stop", []),
        stream=stream,
        exclude_input_in_output=exclude,
        num_draft_tokens=values.get("num_draft_tokens"),
        ignore_eos=values.get("ignore_eos", False),
        stop_token_ids=values.get("stop_token_ids", []),
        bad_words=values.get("bad_words", []),
        stream_interval=values.get("stream_interval"),
        returns=frozenset(name for name in RETURN_OUTPUTS if values.get(f"return_{name}")),
        structured=parse_structured(values),
    )


def _prompt(tensors: dict[str, Any]) -> str:
    prompt = tensors.get("text_input")
    if prompt is None:
        raise RequestError("text_input is required")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("text_input is empty")
    return prompt


def _gather(tensors: dict[str, Any], parameters_json: str, sampling_json: str) -> dict[str, Any]:
    """Every key's value, converted: input tensors win over `sampling_parameters`, which wins
    over request parameters."""
    values: dict[str, Any] = {}
    # HTTP /generate also sends the input tensors' own names as parameters: skip those.
    params = _parse_json_object("request parameters", parameters_json)
    _collect("request parameters", {k: v for k, v in params.items() if k not in tensors}, values)
    _collect("sampling_parameters", _parse_json_object("sampling_parameters", sampling_json), values)
    _collect("inputs", {k: v for k, v in tensors.items() if k in _KEYS}, values)
    return values


def _check_lengths(values: dict[str, Any]) -> int:
    """max_tokens (returned), num_draft_tokens and stream_interval within their ranges."""
    max_tokens = values.get("max_tokens", 16)
    if max_tokens <= 0:
        raise RequestError(f"max_tokens must be at least 1, got {max_tokens}")
    if max_tokens > MAX_INT32:
        raise RequestError(f"max_tokens must be at most {MAX_INT32}, got {max_tokens}")
    num_draft = values.get("num_draft_tokens")
    if num_draft is not None and num_draft < 0:
        raise RequestError(f"num_draft_tokens must be >= 0, got {num_draft}")
    if num_draft is not None and num_draft > MAX_DRAFT_TOKENS:
        raise RequestError(f"num_draft_tokens must be at most {MAX_DRAFT_TOKENS}, got {num_draft}")
    interval = values.get("stream_interval")
    if interval is not None and not 1 <= interval <= MAX_INT32:
        raise RequestError(f"stream_interval must be a whole number of tokens in [1, {MAX_INT32}], got {interval}")
    return max_tokens


def _check_sampling(values: dict[str, Any]) -> None:
    """vLLM's ranges for temperature, top-k, top-p, min-p and the seed."""
    temperature = values.get("temperature", 0.0)
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}")
    top_k = values.get("top_k")
    if top_k is not None and not -1 <= top_k <= MAX_INT32:
        raise RequestError(f"top_k must be -1, 0 (both: off) or a positive integer up to {MAX_INT32}, got {top_k}")
    top_p = values.get("top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    min_p = values.get("min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise RequestError(f"min_p must be in [0, 1] (0: off), got {min_p}")
    seed = values.get("seed")
    if seed is not None and not 0 <= seed < 2**63:
        raise RequestError(f"seed must be a non-negative 63-bit integer, got {seed}")


def _stream_flags(values: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, exclude_input_in_output): a stream carries the new text only."""
    stream = values.get("stream", False)
    exclude = values.get("exclude_input_in_output", stream)
    if stream and not exclude:
        raise RequestError("exclude_input_in_output=false is not supported with stream=true")
    return stream, exclude


def _sampling(values: dict[str, Any]) -> SamplingParams:
    """The parameters the verifier samples with (disabled filters as None, as vLLM drops
    them; min_p off for greedy requests, as vLLM sets it)."""
    temperature = values.get("temperature", 0.0)
    top_k, top_p = values.get("top_k"), values.get("top_p")
    return SamplingParams(
        temperature=temperature,
        top_k=top_k if top_k and top_k > 0 else None,
        top_p=top_p if top_p is not None and top_p < 1 else None,
        min_p=0.0 if is_greedy(temperature) else values.get("min_p", 0.0),
        seed=values.get("seed"),
        repetition_penalty=values.get("repetition_penalty", 1.0),
        presence_penalty=values.get("presence_penalty", 0.0),
        frequency_penalty=values.get("frequency_penalty", 0.0),
        min_tokens=values.get("min_tokens", 0),
        logit_bias=values.get("logit_bias", ()),
        allowed_token_ids=values.get("allowed_token_ids", ()),
        logprobs=values.get("logprobs"),
        cache_salt=values.get("cache_salt", ""),
    )


def _check_controls(values: dict[str, Any], max_tokens: int) -> None:
    """vLLM's ranges for the token controls."""
    repetition = values.get("repetition_penalty", 1.0)
    if not 0 < repetition <= 100:
        raise RequestError(f"repetition_penalty must be in (0, 100] (1: off), got {repetition}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= values.get(name, 0.0) <= 2:
            raise RequestError(f"{name} must be in [-2, 2] (0: off), got {values[name]}")
    min_tokens = values.get("min_tokens", 0)
    if not 0 <= min_tokens <= max_tokens:
        raise RequestError(f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}")
    if any(t < 0 for t in values.get("stop_token_ids", [])):
        raise RequestError(f"stop_token_ids must be token ids (>= 0), got {values['stop_token_ids']}")


def bind_token_ids(
    req: GenerationRequest, tokenizer: Any, eos_token_ids: set[int], vocab_size: int
) -> GenerationRequest:
    """What needs the served model: token ids checked against its vocabulary, bad words
    tokenized (vLLM's way), and the tokens min_tokens holds back (EOS unless ignore_eos,
    and stop_token_ids), all in the sampling parameters the verifier receives."""
    for where, ids in (
        ("stop_token_ids", req.stop_token_ids),
        ("logit_bias", [t for t, _ in req.sampling.logit_bias]),
        ("allowed_token_ids", req.sampling.allowed_token_ids),
    ):
        outside = [t for t in ids if not 0 <= t < vocab_size]
        if outside:
            raise RequestError(f"{where}: token id {outside[0]} is outside the vocabulary [0, {vocab_size})")
    held = set(req.stop_token_ids) | (set() if req.ignore_eos else set(eos_token_ids))
    sampling = replace(
        req.sampling,
        bad_words_ids=bad_words_token_ids(req.bad_words, tokenizer),
        min_tokens_stop_ids=tuple(sorted(held)) if req.sampling.min_tokens else (),
    )
    return replace(req, sampling=sampling)


def bad_words_token_ids(words: list[str], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's SamplingParams.update_from_tokenizer: each word as it tokenizes alone, and
    with a leading space when that is another token sequence of the same length (the word
    in the middle of a text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not alone:
            continue
        out.append(alone)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced[:1] != alone[:1] and len(spaced) == len(alone):
            out.append(spaced)
    return tuple(out)


# No tokenizer packs more characters than this into one token on average, so a longer
# prompt cannot fit the context; refusing it first spares tokenizing megabytes.
MAX_PROMPT_CHARS_PER_TOKEN = 64


def check_prompt_size(prompt: str, max_model_len: int) -> None:
    limit = MAX_PROMPT_CHARS_PER_TOKEN * max_model_len
    if len(prompt) > limit:
        raise RequestError(
            f"text_input has {len(prompt)} characters, more than fit the context window of "
            f"{max_model_len} tokens (at most {limit} characters are accepted)"
        )
