"""`tritonspec openai`: an OpenAI-compatible HTTP API (/v1/models, /v1/completions,
/v1/chat/completions, streamed as server-sent events or not) in front of the `speculative`
model over gRPC, so OpenAI SDKs and genai-perf's OpenAI mode can drive it.

Chat messages are rendered with the served model's tokenizer chat template (the model
directory comes from the Triton model's `model` parameter, or --model). OpenAI's sampling
defaults apply (temperature 1, top_p 1; completions: max_tokens 16; chat: up to the context
window). `n` choices per prompt and, for completions, a list of prompts are separate
generations on the server (the j-th choice of a prompt samples with `seed + j` when a seed
is given, as vLLM's parallel sampling does), at most MAX_CHOICES per request. Errors come
back in OpenAI's shape, {"error": {"message", "type", "param",
"code"}}, with 400 for a bad request (including what the Triton model rejects), 404 for an
unknown model or route, 503 when Triton is unreachable or its KV cache budget is full, and
500 for a failure inside generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from client.api.triton import Generation, ServerUnavailableError, grpc_generate

log = logging.getLogger("tritonspec.openai")
# Choices in one request (prompts x n): each is a generation of its own on the server.
MAX_CHOICES = 16


class OpenAIError(Exception):
    """An error answered in OpenAI's JSON shape with an HTTP status."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "api_error", 503: "service_unavailable_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "api_error"),
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass
class Backend:
    """Where requests go and what the OpenAI layer needs to know about the served model."""

    grpc_url: str
    served_model_name: str
    tokenizer: Any
    context_window: int
    triton_model: str = "speculative"


# ---------------------------------------------------------------------------- parameters


def _check_type(body: dict, name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise OpenAIError(400, f"'{name}' must be {what}, got {json.dumps(value)}", param=name)
    return value


def _check_unsupported(body: dict, kind: str) -> None:
    """Parameters that would change the answer but have no equivalent here: refused, not ignored."""
    best_of = _check_type(body, "best_of", (int,), "an integer")
    if best_of is not None and best_of != 1:
        raise OpenAIError(400, f"'best_of' must be 1 here, got {best_of}", param="best_of")
    if kind == "completion" and body.get("suffix"):
        raise OpenAIError(400, "'suffix' is not supported", param="suffix")
    if kind == "chat":
        if body.get("tools") or body.get("functions"):
            raise OpenAIError(400, "tool calling is not supported", param="tools")
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise OpenAIError(
                400, '\'response_format\' other than {"type": "text"} is not supported', param="response_format"
            )


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    """A number within OpenAI's range for it."""
    value = _check_type(body, name, (int, float), "a number")
    if value is not None and not low <= value <= high:
        raise OpenAIError(400, f"'{name}' must be in [{low}, {high}], got {json.dumps(value)}", param=name)
    return value


def requested_logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives per token the request wants (0: the chosen token's only), or
    None without logprobs: chat's `logprobs` + `top_logprobs` (0-20), completions'
    `logprobs` (0-5)."""
    if kind == "chat":
        top = _number(body, "top_logprobs", 0, 20)
        if not _check_type(body, "logprobs", (bool,), "a boolean"):
            if top is not None:
                raise OpenAIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            return None
        return int(top or 0)
    value = _number(body, "logprobs", 0, 5)
    if isinstance(value, float) and not value.is_integer():
        raise OpenAIError(400, f"'logprobs' must be an integer, got {value}", param="logprobs")
    return None if value is None else int(value)


def _token_controls(body: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """Penalties and token controls: (input tensors, sampling_parameters entries). OpenAI's
    presence / frequency penalties and logit_bias, and vLLM's extensions repetition_penalty,
    min_tokens, stop_token_ids and bad_words."""
    inputs: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, -2, 2)
        if value:  # 0 changes nothing
            inputs[name] = float(value)
    repetition = _check_type(body, "repetition_penalty", (int, float), "a number")
    if repetition is not None:
        inputs["repetition_penalty"] = float(repetition)
    min_tokens = _check_type(body, "min_tokens", (int,), "an integer")
    if min_tokens:
        inputs["min_tokens"] = min_tokens
    bias = _check_type(body, "logit_bias", (dict,), "an object mapping token ids to biases")
    if bias:
        if not all(isinstance(b, (int, float)) and not isinstance(b, bool) and -100 <= b <= 100 for b in bias.values()):
            raise OpenAIError(400, "'logit_bias' values must be numbers in [-100, 100]", param="logit_bias")
        sampling["logit_bias"] = bias
    ids = _check_type(body, "stop_token_ids", (list,), "a list of token ids")
    if ids:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise OpenAIError(400, "'stop_token_ids' must be a list of token ids", param="stop_token_ids")
        sampling["stop_token_ids"] = ids
    words = _check_type(body, "bad_words", (list,), "a list of strings")
    if words:
        if not all(isinstance(w, str) for w in words):
            raise OpenAIError(400, "'bad_words' must be a list of strings", param="bad_words")
        inputs["bad_words"] = words
    return inputs, sampling


def sampling_inputs(body: dict, default_max_tokens: int, kind: str) -> dict[str, Any]:
    """The `speculative` model's inputs for an OpenAI request body (types and OpenAI's
    ranges checked here, the rest by the model itself)."""
    _check_unsupported(body, kind)
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    max_tokens = default_max_tokens
    for name in names:
        value = _check_type(body, name, (int,), "an integer")
        if value is not None:
            max_tokens = value
            break
    inputs: dict[str, Any] = {"max_tokens": max_tokens}
    temperature = _number(body, "temperature", 0, 2)
    inputs["temperature"] = 1.0 if temperature is None else float(temperature)
    top_p = _number(body, "top_p", 0, 1)
    if top_p is not None:
        inputs["top_p"] = float(top_p)
    top_k = _check_type(body, "top_k", (int,), "an integer")  # vLLM's extension
    if top_k is not None:
        inputs["top_k"] = top_k
    seed = _check_type(body, "seed", (int,), "an integer")
    if seed is not None:
        if seed < 0:
            raise OpenAIError(400, f"'seed' must be non-negative here, got {seed}", param="seed")
        inputs["random_seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise OpenAIError(400, "'stop' must be a non-empty string or a list of them", param="stop")
        if stop:
            inputs["stop_words"] = stop
    if _check_type(body, "ignore_eos", (bool,), "a boolean"):  # vLLM's extension
        inputs["ignore_eos"] = True
    controls, sampling = _token_controls(body)
    inputs.update(controls)
    logprobs = requested_logprobs(body, kind)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
        inputs["return_logprobs"] = True
    if sampling:
        inputs["sampling_parameters"] = sampling
    return inputs


def _stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = bool(_check_type(body, "stream", (bool,), "a boolean"))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise OpenAIError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
    if not isinstance(options, dict):
        raise OpenAIError(400, "'stream_options' must be an object", param="stream_options")
    return stream, bool(_check_type(options, "include_usage", (bool,), "a boolean"))


def completion_prompts(body: dict) -> list[str]:
    """The prompts of a completions request: a string or a list of strings."""
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt else [prompt]
    if not all(isinstance(p, str) for p in prompts):
        raise OpenAIError(
            400, "'prompt' must be a string or a list of strings (token ids are not supported)", param="prompt"
        )
    if not all(prompts):
        raise OpenAIError(400, "'prompt' is empty", param="prompt")
    return prompts


def choices_per_prompt(body: dict, num_prompts: int) -> int:
    n = _check_type(body, "n", (int,), "an integer")
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


def chat_prompt(body: dict, tokenizer: Any) -> str:
    """The messages rendered with the tokenizer's chat template, ending in the assistant's turn."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "'messages' must be a non-empty list", param="messages")
    messages = [_message_text(m, i) for i, m in enumerate(messages)]
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


# ---------------------------------------------------------------------------- responses


def _usage(result: Generation) -> dict[str, int]:
    return {
        "prompt_tokens": int(result.num_input_tokens),
        "completion_tokens": int(result.num_output_tokens),
        "total_tokens": int(result.num_input_tokens + result.num_output_tokens),
    }


def generation_error(e: Exception) -> OpenAIError:
    """Triton's answer to a failed request, as an HTTP status: what the model rejected is the
    client's (400); transport failures and a full KV budget are 503; the rest is ours (500)."""
    message = str(e)
    if not message:  # never an empty message: at least say what failed
        return OpenAIError(500, f"generation failed: {type(e).__name__}")
    if (
        isinstance(e, (OSError, ServerUnavailableError))
        or message.startswith("[StatusCode.")
        or "StatusCode.UNAVAILABLE" in message
    ):
        return OpenAIError(503, f"the Triton server is unavailable: {message}")
    if "KV cache budget full" in message:
        return OpenAIError(503, message, code="kv_cache_full")
    if message.startswith("generation failed") or "unexpected inference" in message:
        return OpenAIError(500, message)
    return OpenAIError(400, message)


def _ranked(entry: dict) -> list[tuple[str, float]]:
    """One token's vLLM-backend logprobs entry as (text, logprob) pairs, most likely first."""
    ranked = sorted(entry.values(), key=lambda v: v["rank"])
    return [(v["decoded_token"], v["logprob"]) for v in ranked]


def openai_logprobs(kind: str, entries: list[dict], num_top: int, offset: int = 0) -> dict:
    """OpenAI's `logprobs` of a choice from the `speculative` model's per-token entries (the
    chosen token first, then its alternatives): chat's {"content": [...]} or completions'
    tokens / token_logprobs / top_logprobs / text_offset (from `offset` on)."""
    chosen = [next(iter(entry.values())) for entry in entries]
    tops = [_ranked(entry)[:num_top] for entry in entries]
    if kind == "chat":

        def item(text: str, logprob: float) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {**item(c["decoded_token"], c["logprob"]), "top_logprobs": [item(*t) for t in top]}
                for c, top in zip(chosen, tops)
            ]
        }
    offsets = []
    for c in chosen:
        offsets.append(offset)
        offset += len(c["decoded_token"])
    return {
        "tokens": [c["decoded_token"] for c in chosen],
        "token_logprobs": [c["logprob"] for c in chosen],
        "top_logprobs": [dict(top) for top in tops],
        "text_offset": offsets,
    }


class _Response:
    """The envelope every body and chunk of one response shares: id, time, model, object."""

    def __init__(self, kind: str, model: str) -> None:
        self.kind, self.model = kind, model
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def envelope(self, choices: list, usage: dict | None = None, chunk: bool = False, with_usage: bool = False) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.kind == "chat" else "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or with_usage:
            out["usage"] = usage
        return out


class _Choice:
    """One choice of a response: its index, and its logprobs' text offsets as they come."""

    def __init__(self, kind: str, index: int, num_logprobs: int | None = None, offset: int = 0) -> None:
        self.kind, self.index = kind, index
        self.num_logprobs = num_logprobs  # alternatives per token; None: no logprobs
        self.offset = offset  # completions' text_offset of the first generated token (echo)

    def logprobs(self, entries: list[dict]) -> dict | None:
        if self.num_logprobs is None:
            return None
        out = openai_logprobs(self.kind, entries, self.num_logprobs, self.offset)
        self.offset += sum(len(text) for text in out.get("tokens", []))
        return out

    def whole(self, text: str, result: Generation) -> dict:
        """The choice of a non-streamed response."""
        choice: dict[str, Any] = {"index": self.index}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**choice, "logprobs": self.logprobs(result.logprobs), "finish_reason": result.finish_reason or None}

    def delta(
        self, text: str | None, finish_reason: str | None, first: bool = False, entries: list[dict] | None = None
    ) -> dict:
        """The choice of one streamed chunk."""
        logprobs = self.logprobs(entries) if entries else None
        if self.kind == "chat":
            delta: dict = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": self.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


# ---------------------------------------------------------------------------- generation


class GenerationRuns:
    """One request to the `speculative` model per choice, each on a worker thread; their
    text deltas and ends (result or error) arrive on one asyncio queue as (choice, event, value)."""

    def __init__(self, backend: Backend, prompts: list[str], inputs: list[dict], stream: bool) -> None:
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        for index, (prompt, choice_inputs) in enumerate(zip(prompts, inputs)):
            threading.Thread(
                target=self._work,
                args=(backend, index, prompt, choice_inputs, stream),
                name="openai-request",
                daemon=True,
            ).start()

    def _put(self, *event: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def _work(self, backend: Backend, index: int, prompt: str, inputs: dict, stream: bool) -> None:
        try:
            # No timeout of our own: max_tokens and the context window bound the request
            # (a fixed 300 s used to throw away long finished generations with an empty
            # HTTP 400); a streaming client that leaves cancels it.
            result = grpc_generate(
                backend.grpc_url,
                prompt,
                backend.triton_model,
                stream=stream,
                on_response=(lambda out: self._put(index, "text", out)) if stream else None,
                cancel=self.cancel,
                timeout_s=None,
                exclude_input_in_output=True,
                **inputs,
            )
            self._put(index, "done", result)
        except Exception as e:  # noqa: BLE001 - every failure becomes an HTTP error
            self._put(index, "error", e)

    async def next(self) -> tuple:
        return await self.events.get()


def _usage(results: list[Generation], per_prompt: int) -> dict[str, int]:
    """Prompt tokens once per prompt (its first choice's count), completion tokens of every choice."""
    prompt = sum(int(r.num_input_tokens) for r in results[::per_prompt])
    completion = sum(int(r.num_output_tokens) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _complete(backend: Backend, kind: str, body: dict) -> Any:
    """Shared by both endpoints: validate, render, run one generation per choice; a JSON body
    or an SSE stream."""
    model = body.get("model")
    if model is not None and model != backend.served_model_name:
        raise OpenAIError(
            404,
            f"the model {model!r} does not exist; this server serves {backend.served_model_name!r}",
            param="model",
            code="model_not_found",
        )
    stream, include_usage = _stream_flags(body)
    if kind == "chat":
        prompts = [chat_prompt(body, backend.tokenizer)]
        default_max = max(1, backend.context_window - len(backend.tokenizer(prompts[0])["input_ids"]))
    else:
        prompts = completion_prompts(body)
        default_max = 16
    n = choices_per_prompt(body, len(prompts))
    inputs = sampling_inputs(body, default_max, kind)
    echo = kind == "completion" and bool(_check_type(body, "echo", (bool,), "a boolean"))
    prompts = [p for p in prompts for _ in range(n)]  # choice i*n + j: prompt i's j-th sample
    seeded = "random_seed" in inputs
    per_choice = [
        {**inputs, "random_seed": inputs["random_seed"] + i % n} if seeded else inputs for i in range(len(prompts))
    ]
    num_logprobs = requested_logprobs(body, kind)
    choices = [_Choice(kind, i, num_logprobs, len(p) if echo else 0) for i, p in enumerate(prompts)]
    response = _Response(kind, backend.served_model_name)
    runs = GenerationRuns(backend, prompts, per_choice, stream)
    results: list[Generation | None] = [None] * len(prompts)
    if not stream:
        try:
            while None in results:
                index, event, value = await runs.next()
                if event == "error":
                    raise generation_error(value)
                results[index] = value
        finally:
            runs.cancel.set()  # a no-op when all are done; else the others are not wanted
        bodies = [c.whole((p if echo else "") + r.text, r) for c, p, r in zip(choices, prompts, results)]
        return JSONResponse(response.envelope(bodies, _usage(results, n)))

    # Wait for every choice's first event before answering, so a rejected request gets its
    # HTTP status; what came meanwhile is sent first.
    early: list[tuple] = []
    started: set[int] = set()
    while len(started) < len(prompts):
        index, event, value = await runs.next()
        if event == "error":
            runs.cancel.set()
            raise generation_error(value)
        started.add(index)
        early.append((index, event, value))

    def chunk(choice: _Choice, *args: Any, **kwargs: Any) -> str:
        return _sse(response.envelope([choice.delta(*args, **kwargs)], chunk=True, with_usage=include_usage))

    async def events() -> AsyncIterator[str]:
        pending: list[list[dict]] = [[] for _ in prompts]  # logprobs of tokens whose text is held back
        try:
            for choice, prompt in zip(choices, prompts):
                if kind == "chat":
                    yield chunk(choice, None, None, first=True)
                if echo:
                    yield chunk(choice, prompt, None)
            while None in results:
                index, event, value = early.pop(0) if early else await runs.next()
                choice = choices[index]
                if event == "text":
                    pending[index] += json.loads(value.get("logprobs") or "null") or []
                    if value.get("text_output"):
                        yield chunk(choice, value["text_output"], None, entries=pending[index])
                        pending[index] = []
                elif event == "done":
                    yield chunk(choice, None, value.finish_reason or None, entries=pending[index])
                    results[index] = value
                else:  # the headers are gone: the error travels in the stream, as vLLM does
                    yield _sse(generation_error(value).body())
                    break
            else:
                if include_usage:
                    yield _sse(response.envelope([], _usage(results, n), chunk=True))
            yield _sse("[DONE]")
        finally:
            runs.cancel.set()  # a no-op after the end; stops generation when the client left

    return StreamingResponse(events(), media_type="text/event-stream")


# ---------------------------------------------------------------------------- the app


def create_app(backend: Backend) -> FastAPI:
    app = FastAPI(title="tritonspec OpenAI-compatible API")

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown routes, wrong methods
        return JSONResponse(OpenAIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    async def json_body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise OpenAIError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        return body

    def model_card() -> dict:
        return {
            "id": backend.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tritonspec",
            "max_model_len": backend.context_window,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != backend.served_model_name:
            raise OpenAIError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(backend, "completion", await json_body(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(backend, "chat", await json_body(request))

    @app.get("/health")
    async def health():
        ready = await asyncio.to_thread(_triton_ready, backend)
        if not ready:
            raise OpenAIError(503, f"model {backend.triton_model!r} is not ready on {backend.grpc_url}")
        return {"status": "ok"}

    return app


def _triton_ready(backend: Backend) -> bool:
    import tritonclient.grpc as grpcclient

    try:
        with grpcclient.InferenceServerClient(backend.grpc_url) as client:
            return client.is_model_ready(backend.triton_model)
    except Exception:  # noqa: BLE001 - unreachable is not ready
        return False


# ---------------------------------------------------------------------------- set-up


def served_model_settings(grpc_url: str, triton_model: str) -> tuple[str, int | None]:
    """The `model` and `max_model_len` parameters of the Triton model's config."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(grpc_url) as client:
        config = client.get_model_config(triton_model, as_json=True)["config"]
    params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
    if not params.get("model"):
        raise ValueError(f"model {triton_model!r} on {grpc_url} has no `model` parameter; pass --model")
    return params["model"], int(params.get("max_model_len") or 0) or None


def build_backend(
    grpc_url: str,
    triton_model: str = "speculative",
    model: str | None = None,
    served_model_name: str | None = None,
    chat_template: Path | None = None,
) -> Backend:
    """Everything the app needs: the tokenizer (and chat template) and context window of the
    model Triton serves (from its config, or `model`)."""
    from backends.runtime.model_store import load_tokenizer, local_model, model_context_window

    cap = None
    if model is None:
        model, cap = served_model_settings(grpc_url, triton_model)
    path = local_model(model)
    tokenizer = load_tokenizer(path)
    if chat_template is not None:
        tokenizer.chat_template = Path(chat_template).read_text()
    return Backend(
        grpc_url, served_model_name or triton_model, tokenizer, model_context_window(path, cap), triton_model
    )


def serve(backend: Backend, host: str, port: int) -> None:
    import uvicorn

    log.info(
        "OpenAI-compatible API on http://%s:%d/v1 -> %s (gRPC %s)", host, port, backend.triton_model, backend.grpc_url
    )
    uvicorn.run(create_app(backend), host=host, port=port, log_level="warning")
