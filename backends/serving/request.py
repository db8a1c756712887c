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
from backends.serving.request_values import (
    MAX_FLOAT32,
    MAX_INT32,
    MAX_LOGPROBS,
    VLLM_NEUTRAL_KEYS,
    to_allowed_ids,
    to_bool,
    to_float,
    to_int,
    to_int_list,
    to_logit_bias,
    to_logprobs,
    to_prompt_logprobs,
    to_salt,
    to_stop,
    to_str_list,
)
from backends.serving.structured_params import STRUCTURED_KEYS, parse_structured
from backends.structured.spec import StructuredOutputs

if TYPE_CHECKING:
    import torch


RETURN_OUTPUTS = ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens")
MAX_DRAFT_TOKENS = 128  # vLLM V1's limit on drafts per request (rejection.MAX_SPEC_LEN)
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
    # Alternatives reported per prompt token (from the prompt's second: vLLM's prompt_logprobs);
    # None: none. The target computes them in its prefill; such a prompt skips the prefix cache.
    prompt_logprobs: int | None = None
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


GREEDY = SamplingParams()  # the defaults: greedy decoding, no filter, no control


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
    # Under a constraint, the tokens the grammar forces are verified as drafts (this project's
    # key; False: one token a step where no drafter drafts, as the peers decode constrained).
    forced_drafts: bool = True
    # The `n` of the client request this generation is a choice of, for vllm:request_params_n:
    # the OpenAI front end sends n with a prompt's first choice and 0 with the others (observed
    # once per prompt, as vLLM observes a parent request once).
    params_n: int = 1


def _check_token_controls(params: SamplingParams) -> None:
    """The verifier's check of the token controls it received (see parse_request)."""
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RequestError(f"sampling parameter {name} must be a finite number, got {_shown(value)}")
    ids = [t for t, _ in params.logit_bias] + [t for word in params.bad_words_ids for t in word]
    ids += list(params.allowed_token_ids)
    ids += list(params.min_tokens_stop_ids) + [params.min_tokens, params.logprobs or 0, params.prompt_logprobs or 0]
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


# key -> (field it sets, converter); `seed`/`stop` are vLLM's names, the others TRT-LLM's. A
# key sent as null is left out, as the vLLM backend leaves it (its defaults apply).
_KEYS: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "max_tokens": ("max_tokens", to_int),
    "temperature": ("temperature", to_float),
    "top_k": ("top_k", to_int),
    "top_p": ("top_p", to_float),
    "min_p": ("min_p", to_float),
    "seed": ("seed", to_int),
    "random_seed": ("seed", to_int),
    "stop": ("stop", to_stop),
    "stop_words": ("stop", to_str_list),
    "num_draft_tokens": ("num_draft_tokens", to_int),
    "forced_drafts": ("forced_drafts", to_bool),
    "ignore_eos": ("ignore_eos", to_bool),
    "stream": ("stream", to_bool),
    "stream_interval": ("stream_interval", to_int),
    "exclude_input_in_output": ("exclude_input_in_output", to_bool),
    # Token controls (vLLM's names; min_length and bad_words are TRT-LLM's too).
    "repetition_penalty": ("repetition_penalty", to_float),
    "presence_penalty": ("presence_penalty", to_float),
    "frequency_penalty": ("frequency_penalty", to_float),
    "min_tokens": ("min_tokens", to_int),
    "min_length": ("min_tokens", to_int),
    "stop_token_ids": ("stop_token_ids", to_int_list),
    "bad_words": ("bad_words", to_str_list),
    "logit_bias": ("logit_bias", to_logit_bias),
    "allowed_token_ids": ("allowed_token_ids", to_allowed_ids),
    "logprobs": ("logprobs", to_logprobs),
    "prompt_logprobs": ("prompt_logprobs", to_prompt_logprobs),
    "cache_salt": ("cache_salt", to_salt),  # vLLM's: prefix-cache isolation between tenants
    "params_n": ("params_n", to_int),
    # The vLLM backend's additional outputs (r24.12+).
    **{f"return_{name}": (f"return_{name}", to_bool) for name in RETURN_OUTPUTS},
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
        forced_drafts=values.get("forced_drafts", True),
        params_n=values.get("params_n", 1),
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
    if not 0 <= values.get("params_n", 1) <= MAX_INT32:
        raise RequestError(
            f"params_n must be in [0, {MAX_INT32}] (0: a choice counted with its first), got {values['params_n']}"
        )
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
        prompt_logprobs=values.get("prompt_logprobs"),
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
        prompt_logprobs=_num_prompt_logprobs(req.sampling.prompt_logprobs, vocab_size),
        bad_words_ids=bad_words_token_ids(req.bad_words, tokenizer),
        min_tokens_stop_ids=tuple(sorted(held)) if req.sampling.min_tokens else (),
    )
    return replace(req, sampling=sampling)


def _num_prompt_logprobs(n: int | None, vocab_size: int) -> int | None:
    """prompt_logprobs with -1 read as the whole vocabulary, which counts against the same
    limit (vLLM's default max_logprobs; vllm/v1/engine/processor.py, _validate_logprobs, at
    vLLM commit 3eb3ac3e)."""
    if n == -1 and vocab_size > MAX_LOGPROBS:
        raise RequestError(
            f"prompt_logprobs must be at most {MAX_LOGPROBS} (max allowed), got -1: the whole "
            f"vocabulary of {vocab_size} tokens"
        )
    return vocab_size if n == -1 else n


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
