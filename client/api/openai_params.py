"""The OpenAI request body read as the `speculative` model's inputs: types and OpenAI's
ranges checked here (integers also against what the model's tensors hold), the rest by the
model itself; prompts and chat messages checked against the context window before any
rendering, and messages rendered with the served model's chat template."""

from __future__ import annotations

import json
from typing import Any

from backends.serving.structured_params import STRUCTURED_KEYS
from client.api.openai_http import OpenAIError

# Choices in one request (prompts x n): each is a generation of its own on the server.
MAX_CHOICES = 16
MAX_INT32 = 2**31 - 1  # max_tokens, top_k, min_tokens travel as int32 tensors
MAX_SEED = 2**63 - 1  # the model's (vLLM's) seed range: int64
# vLLM's extra parameters for structured outputs, passed on in sampling_parameters.
STRUCTURED_EXTRAS = tuple(key for key in STRUCTURED_KEYS if key != "guided_decoding")


def check_type(body: dict, name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise OpenAIError(400, f"'{name}' must be {what}, got {json.dumps(value)}", param=name)
    return value


# Every body key a completions or chat request may carry: OpenAI's, and the extra ones vLLM's
# OpenAI server takes (vllm/entrypoints/openai/protocol.py). What is not listed is refused by
# name: a parameter that is silently ignored gives an answer the client did not ask for.
_READ = {
    "model", "prompt", "messages", "stream", "stream_options", "n", "echo", "suffix", "best_of",
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
    "logit_bias", "allowed_token_ids", "stop_token_ids", "bad_words", "logprobs", "top_logprobs",
    "prompt_logprobs",
    "tools", "functions", "response_format", *STRUCTURED_EXTRAS,
    "cache_salt",  # read by the admission change (prefix-cache isolation, issue 57)
}  # fmt: skip
_COMPLETION = {"echo", "suffix"}  # completions' own (in chat, vLLM's echo repeats the last message)
# What changes nothing about the tokens generated here, at any value: bookkeeping OpenAI keeps.
_IGNORED = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "request_id"}
# The rest, each at the values that change nothing here, with what to do instead.
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not served; decode greedily (temperature 0)"),
    "length_penalty": ((1, 1.0), "it weighs beam search, which is not served"),
    "early_stopping": ((False,), "it stops beam search, which is not served"),
    "truncate_prompt_tokens": ((), "shorten the prompt before sending it"),
    "include_stop_str_in_output": ((False,), "the text ends before the stop string"),
    "skip_special_tokens": ((True,), "special tokens are always left out of the text"),
    "spaces_between_special_tokens": ((True,), "special tokens are left out of the text"),
    "return_tokens_as_token_ids": ((False,), "tokens are returned as text"),
    "add_generation_prompt": ((True,), "the chat template always ends in the assistant's turn"),
    "continue_final_message": ((False,), "the chat template always starts a new assistant turn"),
    "add_special_tokens": ((False, True), ""),  # the model's tokenizer adds what it adds either way
    "chat_template": ((), "start the server with --chat-template FILE"),
    "chat_template_kwargs": (({},), "the chat template is rendered with the messages only"),
    "documents": ((), "put the documents in the messages"),
    "mm_processor_kwargs": ((), "only text is served"),
    "logits_processors": ((), "custom logits processors are not served"),
    "vllm_xargs": (({},), "no sampling plugin reads them here"),
    "priority": ((0,), "requests are served first come, first served"),
    "tool_choice": (("none", "auto"), "tool calling is not supported"),
    "function_call": (("none", "auto"), "tool calling is not supported"),
    "parallel_tool_calls": ((False, True), ""),  # without tools nothing is called either way
    "modalities": ((["text"],), "only text is served"),
    "reasoning_effort": ((), "the served model's reasoning is not configurable per request"),
    "audio": ((), "only text is served"),
    "prediction": ((), "predicted outputs are not served; speculative decoding needs no prediction"),
    "web_search_options": ((), "web search is not served"),
}


def check_parameters(body: dict, kind: str) -> None:
    """Each key of a completions or chat body is read, changes nothing, or is refused by name
    (a null value is the default, as OpenAI reads it)."""
    for name, value in body.items():
        if value is None or name in _IGNORED or name in _READ and (kind == "completion" or name not in _COMPLETION):
            continue
        if name in _COMPLETION:
            if value in (False, ""):
                continue
            raise OpenAIError(400, f"'{name}' is not supported in chat completions", param=name)
        if name not in _NEUTRAL:
            raise OpenAIError(400, f"unsupported parameter '{name}'", param=name)
        neutral, hint = _NEUTRAL[name]
        if not any(value == v and type(value) is type(v) for v in neutral):
            shown = json.dumps(value)[:80]
            raise OpenAIError(400, f"'{name}' is not supported here (got {shown}): {hint}", param=name)


def structured_outputs(body: dict) -> dict[str, Any]:
    """The sampling_parameters entries of the body's output constraint: `response_format` read
    as vLLM reads it, vLLM's extra parameters (structured_outputs, guided_*) passed on as
    sent (the model checks them and names what is wrong)."""
    extras = {name: body[name] for name in STRUCTURED_EXTRAS if body.get(name) is not None}
    constraint = _response_format(body.get("response_format"))
    if constraint is None:
        return extras
    if "structured_outputs" in extras:
        raise OpenAIError(
            400,
            "one kind of structured output per request: send response_format or structured_outputs, not both",
            param="response_format",
        )
    return {**extras, "structured_outputs": constraint}


def _response_format(fmt: Any) -> dict[str, Any] | None:
    """{"type": "text"}: nothing; json_object: any JSON object; json_schema: its schema
    (`strict` or not, the schema is enforced); structural_tag: the tag, as vLLM passes it."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise OpenAIError(
                400,
                "'response_format' json_schema needs 'json_schema': {\"name\", \"schema\": {...}}",
                param="response_format",
            )
        check_type(spec, "strict", (bool,), "a boolean")
        return {"json": spec["schema"]}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(fmt)}
    raise OpenAIError(
        400,
        "'response_format' must have type text, json_object, json_schema or structural_tag",
        param="response_format",
    )


def _check_unsupported(body: dict, kind: str) -> None:
    """Parameters that would change the answer but have no equivalent here: refused, not ignored."""
    best_of = check_type(body, "best_of", (int,), "an integer")
    if best_of is not None and best_of != 1:
        raise OpenAIError(400, f"'best_of' must be 1 here, got {best_of}", param="best_of")
    if kind == "completion" and body.get("suffix"):
        raise OpenAIError(400, "'suffix' is not supported", param="suffix")
    if body.get("tools") or body.get("functions"):
        raise OpenAIError(400, "tool calling is not supported", param="tools")


def _integer(body: dict, name: str, low: int, high: int) -> int | None:
    """An integer within [low, high]: what the model's tensor holds (int32 would wrap
    2**32 + 3 to 3) and the model accepts."""
    value = check_type(body, name, (int,), "an integer")
    if value is not None and not low <= value <= high:
        raise OpenAIError(400, f"'{name}' must be an integer in [{low}, {high}], got {value}", param=name)
    return value


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    """A number within OpenAI's range for it."""
    value = check_type(body, name, (int, float), "a number")
    if value is not None and not low <= value <= high:
        raise OpenAIError(400, f"'{name}' must be in [{low}, {high}], got {json.dumps(value)}", param=name)
    return value


def requested_logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives per token the request wants (0: the chosen token's only), or
    None without logprobs: chat's `logprobs` + `top_logprobs` (0-20), completions'
    `logprobs` (0-5)."""
    if kind == "chat":
        top = _number(body, "top_logprobs", 0, 20)
        if not check_type(body, "logprobs", (bool,), "a boolean"):
            if top is not None:
                raise OpenAIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            return None
        return int(top or 0)
    value = _number(body, "logprobs", 0, 5)
    if isinstance(value, float) and not value.is_integer():
        raise OpenAIError(400, f"'logprobs' must be an integer, got {value}", param="logprobs")
    return None if value is None else int(value)


def requested_prompt_logprobs(body: dict) -> int | None:
    """vLLM's prompt_logprobs: alternatives per prompt token (-1: the whole vocabulary; the
    model refuses more than its limit, 20), not with a stream, as vLLM's OpenAI server checks
    it (vllm/entrypoints/openai/protocol.py, check_logprobs, at vLLM commit ec3b890c)."""
    value = _integer(body, "prompt_logprobs", -1, MAX_INT32)
    if value is not None and (value > 0 or value == -1) and body.get("stream"):
        raise OpenAIError(400, "'prompt_logprobs' are not available when 'stream' is true", param="prompt_logprobs")
    return value


def _token_controls(body: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """Penalties and token controls: (input tensors, sampling_parameters entries). OpenAI's
    presence / frequency penalties and logit_bias, and vLLM's extensions repetition_penalty,
    min_tokens, min_p, allowed_token_ids, stop_token_ids and bad_words."""
    inputs: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, -2, 2)
        if value:  # 0 changes nothing
            inputs[name] = float(value)
    repetition = check_type(body, "repetition_penalty", (int, float), "a number")
    if repetition is not None:
        inputs["repetition_penalty"] = float(repetition)
    min_tokens = _integer(body, "min_tokens", 0, MAX_INT32)
    if min_tokens:
        inputs["min_tokens"] = min_tokens
    bias = check_type(body, "logit_bias", (dict,), "an object mapping token ids to biases")
    if bias:
        if not all(isinstance(b, (int, float)) and not isinstance(b, bool) and -100 <= b <= 100 for b in bias.values()):
            raise OpenAIError(400, "'logit_bias' values must be numbers in [-100, 100]", param="logit_bias")
        sampling["logit_bias"] = bias
    ids = check_type(body, "stop_token_ids", (list,), "a list of token ids")
    if ids:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise OpenAIError(400, "'stop_token_ids' must be a list of token ids", param="stop_token_ids")
        sampling["stop_token_ids"] = ids
    min_p = _number(body, "min_p", 0, 1)  # vLLM's extension
    if min_p:  # 0 changes nothing
        sampling["min_p"] = float(min_p)
    allowed = check_type(body, "allowed_token_ids", (list,), "a list of token ids")
    if allowed is not None:
        if not allowed or not all(isinstance(t, int) and not isinstance(t, bool) for t in allowed):
            raise OpenAIError(
                400, "'allowed_token_ids' must be a non-empty list of token ids", param="allowed_token_ids"
            )
        sampling["allowed_token_ids"] = allowed
    words = check_type(body, "bad_words", (list,), "a list of strings")
    if words:
        if not all(isinstance(w, str) for w in words):
            raise OpenAIError(400, "'bad_words' must be a list of strings", param="bad_words")
        inputs["bad_words"] = words
    return inputs, sampling


def sampling_inputs(body: dict, default_max_tokens: int, kind: str) -> dict[str, Any]:
    """The `speculative` model's inputs for an OpenAI request body (types and OpenAI's
    ranges checked here, the rest by the model itself)."""
    check_parameters(body, kind)
    _check_unsupported(body, kind)
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    max_tokens = default_max_tokens
    for name in names:
        value = _integer(body, name, 1, MAX_INT32)
        if value is not None:
            max_tokens = value
            break
    inputs: dict[str, Any] = {"max_tokens": max_tokens}
    temperature = _number(body, "temperature", 0, 2)
    inputs["temperature"] = 1.0 if temperature is None else float(temperature)
    top_p = _number(body, "top_p", 0, 1)
    if top_p is not None:
        inputs["top_p"] = float(top_p)
    top_k = _integer(body, "top_k", -1, MAX_INT32)  # vLLM's extension: -1 and 0 are off
    if top_k is not None:
        inputs["top_k"] = top_k
    seed = _integer(body, "seed", 0, MAX_SEED)
    if seed is not None:
        inputs["random_seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise OpenAIError(400, "'stop' must be a string or a list of strings", param="stop")
        if "" in stop:  # it would match everywhere (vLLM's words)
            raise OpenAIError(400, "'stop' cannot contain an empty string", param="stop")
        if stop:
            inputs["stop_words"] = stop
    if check_type(body, "ignore_eos", (bool,), "a boolean"):  # vLLM's extension
        inputs["ignore_eos"] = True
    controls, sampling = _token_controls(body)
    inputs.update(controls)
    sampling.update(structured_outputs(body))
    logprobs = requested_logprobs(body, kind)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
        inputs["return_logprobs"] = True
    prompt_logprobs = requested_prompt_logprobs(body)
    if prompt_logprobs is not None:
        sampling["prompt_logprobs"] = prompt_logprobs
    salt = check_type(body, "cache_salt", (str,), "a non-empty string")  # vLLM's extension
    if salt is not None:
        if not salt:
            raise OpenAIError(400, "'cache_salt' must be a non-empty string", param="cache_salt")
        sampling["cache_salt"] = salt
    if sampling:
        inputs["sampling_parameters"] = sampling
    return inputs


def stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = bool(check_type(body, "stream", (bool,), "a boolean"))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise OpenAIError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
    if not isinstance(options, dict):
        raise OpenAIError(400, "'stream_options' must be an object", param="stream_options")
    return stream, bool(check_type(options, "include_usage", (bool,), "a boolean"))


def check_fits(length: int, what: str, param: str, max_chars: int | None) -> None:
    """Text longer than `max_chars` cannot fit the context window however it tokenizes:
    refused before any rendering or tokenization spends time and memory on it."""
    if max_chars is not None and length > max_chars:
        raise OpenAIError(
            400,
            f"{what} is {length} characters, more than the context window can hold (at most {max_chars})",
            param=param,
            code="context_length_exceeded",
        )


def completion_prompts(body: dict, max_chars: int | None = None) -> list[str]:
    """The prompts of a completions request: a string or a list of strings."""
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt else [prompt]
    if not all(isinstance(p, str) for p in prompts):
        raise OpenAIError(
            400, "'prompt' must be a string or a list of strings (token ids are not supported)", param="prompt"
        )
    if not all(prompts):
        raise OpenAIError(400, "'prompt' is empty", param="prompt")
    for i, text in enumerate(prompts):
        check_fits(len(text), f"prompt[{i}]" if isinstance(prompt, list) else "'prompt'", "prompt", max_chars)
    return prompts


def choices_per_prompt(body: dict, num_prompts: int) -> int:
    n = check_type(body, "n", (int,), "an integer")
    n = 1 if n is None else n
    if n < 1:
        raise OpenAIError(400, f"'n' must be at least 1, got {n}", param="n")
    if n * num_prompts > MAX_CHOICES:
        raise OpenAIError(
            400, f"{n * num_prompts} choices ({num_prompts} prompt(s) x n={n}); at most {MAX_CHOICES}", param="n"
        )
    return n


def _message_text(message: Any, index: int) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise OpenAIError(400, f"{where} must be an object with a 'role'", param="messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise OpenAIError(400, f"{where}.content: only text parts are supported", param="messages")
        content = "".join(p["text"] for p in content)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise OpenAIError(400, f"{where}.content must be a string or a list of text parts", param="messages")
    return {"role": message["role"], "content": content}


def chat_messages(body: dict, max_chars: int | None = None) -> list[dict[str, str]]:
    """The messages as {role, content} text, each and all together short enough to fit."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "'messages' must be a non-empty list", param="messages")
    messages = [_message_text(m, i) for i, m in enumerate(messages)]
    for i, message in enumerate(messages):
        check_fits(len(message["content"]), f"messages[{i}].content", "messages", max_chars)
    check_fits(sum(len(m["content"]) for m in messages), "the messages' content", "messages", max_chars)
    return messages


def chat_prompt(messages: list[dict[str, str]], tokenizer: Any) -> str:
    """The messages rendered with the tokenizer's chat template, ending in the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(
            400,
            "the served model's tokenizer has no chat template (start the server with "
            "--chat-template FILE, or use /v1/completions)",
            param="messages",
        )
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # the template itself raises on inputs it does not accept
        raise OpenAIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    # The model tokenizes the text with its special tokens: a BOS the template wrote would be doubled.
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and tokenizer("")["input_ids"][:1] == [tokenizer.bos_token_id]:
        text = text[len(bos) :]
    return text
