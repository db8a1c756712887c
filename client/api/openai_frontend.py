"""`tritonspec openai`: an OpenAI-compatible HTTP API (/v1/models, /v1/completions,
/v1/chat/completions, streamed as server-sent events or not; /v1/responses in
openai_responses.py; vLLM's /tokenize, /detokenize, /version and /metrics in
openai_utility.py) in front of the `speculative` model over gRPC, so OpenAI SDKs and
genai-perf's OpenAI mode can drive it.

Chat messages are rendered with the served model's tokenizer chat template (the model
directory comes from the Triton model's `model` parameter, or --model). OpenAI's sampling
defaults apply (temperature 1, top_p 1; completions: max_tokens 16; chat: up to the context
window). `n` choices per prompt and, for completions, a list of prompts are separate
generations on the server (the j-th choice of a prompt samples with `seed + j` when a seed
is given, as vLLM's parallel sampling does), at most 16 per request. Errors come back in
OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with 400 for a bad request
(including what the Triton model rejects, `param` naming the input it refused), 401
without the API key, 404 for an unknown model or route, 413 for a body over the limit, 429
beyond the requests in flight allowed, 503 when Triton is unreachable or its KV cache
budget is full, and 500 for a failure inside generation. The limits and the key are the front door's (openai_http.py); request bodies are
parsed, and chat templates rendered, on worker threads, so one large request does not hold
up the others.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from backends.runtime.gc_heap import freeze_startup_heap
from backends.triton_models.admission import UNAVAILABLE
from client.api.openai_http import ClientGone, DoorPolicy, FrontDoor, OpenAIError, read_json_body
from client.api.openai_params import (
    chat_messages,
    chat_prompt,
    check_type,
    choices_per_prompt,
    completion_prompts,
    requested_logprobs,
    sampling_inputs,
    stream_flags,
)
from client.api.triton import Generation, ServerUnavailableError, grpc_generate

log = logging.getLogger("tritonspec.openai")
# Runs CPU work of a request (parsing, rendering, tokenizing) off the event loop.
Offload = Callable[..., Awaitable[Any]]


@dataclass
class Backend:
    """Where requests go and what the OpenAI layer needs to know about the served model."""

    grpc_url: str
    served_model_name: str
    tokenizer: Any
    context_window: int
    triton_model: str = "speculative"
    # The longest token's text: a prompt longer than context_window times this cannot fit,
    # whatever it says, and is refused before it is rendered or tokenized (0: no check).
    max_token_chars: int = 0
    metrics_url: str = ""  # Triton's /metrics, merged into ours ("": not merged)

    @property
    def max_prompt_chars(self) -> int | None:
        return self.context_window * self.max_token_chars or None


# ---------------------------------------------------------------------------- responses


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
    if message.startswith(UNAVAILABLE):  # the model's retryable refusals: busy, shutting down, not ready
        return OpenAIError(503, message.removeprefix(UNAVAILABLE), code="server_unavailable")
    if message.startswith("generation failed") or "unexpected inference" in message:
        return OpenAIError(500, message)
    return OpenAIError(400, message, param=server_param(message))


# The `speculative` model names the input it refuses first ("repetition_penalty must be in
# (0, 100], got 0", "logit_bias[5] must be in [-100, 100]"); these are the request's own names.
_REFUSED_INPUT = re.compile(r"^([a-z_]+)(?:\[[^\]]*\])? (?:must|is only)")
_SERVER_PARAMS = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "random_seed": "seed",
    "min_tokens": "min_tokens",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "stop_token_ids": "stop_token_ids",
    "logit_bias": "logit_bias",
    "allowed_token_ids": "allowed_token_ids",
    "num_draft_tokens": "num_draft_tokens",
    "prompt_logprobs": "prompt_logprobs",
}


def server_param(message: str) -> str | None:
    """The request parameter a model's refusal names, if it names one."""
    match = _REFUSED_INPUT.match(message)
    return _SERVER_PARAMS.get(match.group(1)) if match else None


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
        choice.update(logprobs=self.logprobs(result.logprobs), finish_reason=result.finish_reason or None)
        if self.kind == "completion" and result.prompt_logprobs is not None:  # chat: on the response (vLLM's)
            choice["prompt_logprobs"] = result.prompt_logprobs
        return choice

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
        for index, (prompt, request_inputs) in enumerate(zip(prompts, inputs)):
            threading.Thread(
                target=self._work,
                args=(backend, index, prompt, request_inputs, stream),
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


async def client_left(request: Request, runs: GenerationRuns) -> None:
    """Once the HTTP client disconnects (its body is read, so the next message is the
    disconnect), cancel the generations on Triton and wake the handler waiting on them."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    runs.cancel.set()
    runs.events.put_nowait((None, "gone", None))


@dataclass
class _Plan:
    """One request, validated: per choice its prompt, the model's inputs and its envelope."""

    kind: str
    prompts: list[str]
    inputs: list[dict]
    choices: list[_Choice]
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    response: _Response


def _render_chat(body: dict, backend: Backend, count_room: bool) -> tuple[str, int]:
    """(the rendered chat prompt, with `count_room` the tokens it leaves in the context
    window): CPU work on a worker thread, after the length check."""
    prompt = chat_prompt(chat_messages(body, backend.max_prompt_chars), backend.tokenizer)
    if not count_room:
        return prompt, 0
    return prompt, max(1, backend.context_window - len(backend.tokenizer(prompt)["input_ids"]))


def choice_inputs(inputs: dict, j: int, n: int) -> dict:
    """The model's inputs for a prompt's j-th of n choices: seed + j when seeded, and with n > 1
    the request's n on its first choice (params_n: vllm:request_params_n observes each prompt
    once, as vLLM observes a parent request) and 0 on the others."""
    if "random_seed" in inputs:
        inputs = {**inputs, "random_seed": inputs["random_seed"] + j}
    if n > 1:
        inputs = {**inputs, "sampling_parameters": {**inputs.get("sampling_parameters", {}), "params_n": 0 if j else n}}
    return inputs


async def plan_request(backend: Backend, kind: str, body: dict, offload: Offload) -> _Plan:
    model = body.get("model")
    if model is not None and model != backend.served_model_name:
        raise OpenAIError(
            404,
            f"the model {model!r} does not exist; this server serves {backend.served_model_name!r}",
            param="model",
            code="model_not_found",
        )
    stream, include_usage = stream_flags(body)
    if kind == "chat":
        inputs = sampling_inputs(body, 0, kind)  # max_tokens 0: the room the prompt leaves
        prompt, room = await offload(_render_chat, body, backend, inputs["max_tokens"] == 0)
        inputs["max_tokens"] = inputs["max_tokens"] or room
        prompts = [prompt]
    else:
        prompts = completion_prompts(body, backend.max_prompt_chars)
        inputs = sampling_inputs(body, 16, kind)
    n = choices_per_prompt(body, len(prompts))
    echo = kind == "completion" and bool(check_type(body, "echo", (bool,), "a boolean"))
    prompts = [p for p in prompts for _ in range(n)]  # choice i*n + j: prompt i's j-th sample
    per_choice = [choice_inputs(inputs, i % n, n) for i in range(len(prompts))]
    num_logprobs = requested_logprobs(body, kind)
    choices = [_Choice(kind, i, num_logprobs, len(p) if echo else 0) for i, p in enumerate(prompts)]
    response = _Response(kind, backend.served_model_name)
    return _Plan(kind, prompts, per_choice, choices, n, stream, include_usage, echo, response)


async def _complete(backend: Backend, kind: str, body: dict, request: Request, offload: Offload) -> Any:
    """Shared by both endpoints: validate, render, run one generation per choice; a JSON body
    or an SSE stream. A client that leaves cancels its generations, streamed or not."""
    plan = await plan_request(backend, kind, body, offload)
    runs = GenerationRuns(backend, plan.prompts, plan.inputs, plan.stream)
    watcher = asyncio.ensure_future(client_left(request, runs))
    try:
        if not plan.stream:
            return JSONResponse(await _whole(plan, runs))
        early = await first_events(plan, runs)
    except BaseException:
        runs.cancel.set()  # the others are not wanted
        raise
    finally:
        watcher.cancel()  # a stream watches for the client itself (StreamingResponse)
    return StreamingResponse(_events(plan, runs, early), media_type="text/event-stream")


def raise_for_event(event: str, value: Any) -> None:
    if event == "error":
        raise generation_error(value)
    if event == "gone":
        raise ClientGone()


async def _whole(plan: _Plan, runs: GenerationRuns) -> dict:
    """The non-streamed response, once every choice is done."""
    results: list[Generation | None] = [None] * len(plan.prompts)
    while None in results:
        index, event, value = await runs.next()
        raise_for_event(event, value)
        results[index] = value
    echoed = [p if plan.echo else "" for p in plan.prompts]
    bodies = [c.whole(e + r.text, r) for c, e, r in zip(plan.choices, echoed, results)]
    response = plan.response.envelope(bodies, _usage(results, plan.n))
    if plan.kind == "chat" and results[0].prompt_logprobs is not None:
        response["prompt_logprobs"] = results[0].prompt_logprobs
    return response


async def first_events(plan: _Plan, runs: GenerationRuns) -> list[tuple]:
    """Every choice's first event, awaited before the stream starts so that a rejected
    request gets its HTTP status; what came meanwhile is sent first."""
    early: list[tuple] = []
    started: set[int] = set()
    while len(started) < len(plan.prompts):
        index, event, value = await runs.next()
        raise_for_event(event, value)
        started.add(index)
        early.append((index, event, value))
    return early


async def _events(plan: _Plan, runs: GenerationRuns, early: list[tuple]) -> AsyncIterator[str]:
    """The SSE stream: each choice's deltas as they come, its end, the usage, [DONE]."""

    def chunk(choice: _Choice, *args: Any, **kwargs: Any) -> str:
        envelope = plan.response.envelope([choice.delta(*args, **kwargs)], chunk=True, with_usage=plan.include_usage)
        return _sse(envelope)

    results: list[Generation | None] = [None] * len(plan.prompts)
    pending: list[list[dict]] = [[] for _ in plan.prompts]  # logprobs of tokens whose text is held back
    try:
        for choice, prompt in zip(plan.choices, plan.prompts):
            if plan.kind == "chat":
                yield chunk(choice, None, None, first=True)
            if plan.echo:
                yield chunk(choice, prompt, None)
        while None in results:
            index, event, value = early.pop(0) if early else await runs.next()
            if event == "gone":
                return
            choice = plan.choices[index]
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
            if plan.include_usage:
                yield _sse(plan.response.envelope([], _usage(results, plan.n), chunk=True))
        yield _sse("[DONE]")
    finally:
        runs.cancel.set()  # a no-op after the end; stops generation when the client left


# ---------------------------------------------------------------------------- the app


def create_app(backend: Backend, policy: DoorPolicy | None = None) -> FastAPI:
    # Imported here: the Responses route builds on this module's generation.
    from client.api.openai_responses import add_responses_route
    from client.api.openai_utility import RouteCounting, RouteCounts, add_utility_routes

    policy = policy or DoorPolicy()
    app = FastAPI(title="tritonspec OpenAI-compatible API")
    app.add_middleware(FrontDoor, policy=policy)
    counts = RouteCounts()
    app.add_middleware(RouteCounting, counts=counts)  # outside the door: its 401s and 429s count
    _add_error_handlers(app)
    # Parsing, rendering and tokenizing run here, so that /health, /v1/models and streams
    # stay responsive while a large request is worked on; two threads: the rest wait.
    request_work = ThreadPoolExecutor(max_workers=2, thread_name_prefix="openai-render")

    async def offload(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(request_work, fn, *args)

    async def body_of(request: Request) -> dict:
        return await read_json_body(request, policy.max_body_bytes, offload)

    async def generate(kind: str, request: Request) -> Any:
        return await _complete(backend, kind, await body_of(request), request, offload)

    _add_model_routes(app, backend)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate("completion", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate("chat", request)

    readiness = ReadinessWatch(backend)
    if backend is not None:  # watching from the start: the first probe finds an answer
        readiness.current()

    @app.get("/health")
    async def health():
        ready = readiness.current()
        if ready is None:  # no recent check (the first probe, or the watch is behind): ask now
            ready = await asyncio.to_thread(_triton_ready, backend)
        if not ready:
            raise OpenAIError(503, f"model {backend.triton_model!r} is not ready on {backend.grpc_url}")
        return {"status": "ok"}

    add_responses_route(app, backend, body_of, offload)
    add_utility_routes(app, backend, body_of, offload, counts)
    return app


def _add_model_routes(app: FastAPI, backend: Backend) -> None:
    """/v1/models and /v1/models/{id}: the one model served."""

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


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's JSON shape (a client that left gets nginx's 499)."""

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown routes, wrong methods
        return OpenAIError(e.status_code, str(e.detail)).response()

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone):  # nobody reads it: nginx's "client closed"
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):  # JSON, not Starlette's plain text
        log.exception("internal error on %s", request.url.path)
        return OpenAIError(500, f"internal error: {type(e).__name__}: {e}").response()


class ReadinessWatch:
    """Triton's readiness as /health reports it: asked on a thread of its own every
    `interval_s`, so a probe is answered at once from the last answer instead of waiting on a
    server busy with generation (one round trip took up to 112 ms at 32 streams on 2 cores).
    vLLM's /health likewise reports its engine's own state. A server that stops is seen
    within `interval_s`; an answer older than `stale_s` is not used (None: ask now)."""

    def __init__(self, backend: Backend, interval_s: float = 1.0, stale_s: float = 5.0) -> None:
        self.backend, self.interval_s, self.stale_s = backend, interval_s, stale_s
        self.last: tuple[float, bool] | None = None  # (time.monotonic() of the answer, ready)
        self.thread: threading.Thread | None = None

    def current(self) -> bool | None:
        """The last answer while it is recent; the first call starts the watch."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._watch, name="openai-readiness", daemon=True)
            self.thread.start()
        last = self.last
        return last[1] if last is not None and time.monotonic() - last[0] <= self.stale_s else None

    def _watch(self) -> None:
        while True:
            self.last = (time.monotonic(), _triton_ready(self.backend))
            time.sleep(self.interval_s)


def _triton_ready(backend: Backend) -> bool:
    import tritonclient.grpc as grpcclient

    try:
        with grpcclient.InferenceServerClient(backend.grpc_url) as client:
            # A server shutting down is not ready, while its models still are (they finish requests).
            return client.is_server_ready() and client.is_model_ready(backend.triton_model)
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
    metrics_url: str = "",
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
        grpc_url,
        served_model_name or triton_model,
        tokenizer,
        model_context_window(path, cap),
        triton_model,
        longest_token_chars(tokenizer),
        metrics_url,
    )


def longest_token_chars(tokenizer: Any) -> int:
    """The most text one token stands for: a vocabulary entry's length is its bytes for a
    byte-level BPE, its characters (with '▁' for a space) for SentencePiece, never fewer
    than the characters it decodes to. (Tokenizers whose normalizer drops characters, as
    BERT's whitespace split does, are not LLM tokenizers.)"""
    return max(map(len, tokenizer.get_vocab()), default=0)


def serve(backend: Backend, host: str, port: int, policy: DoorPolicy | None = None) -> None:
    import uvicorn

    log.info(
        "OpenAI-compatible API on http://%s:%d/v1 -> %s (gRPC %s)", host, port, backend.triton_model, backend.grpc_url
    )
    app = create_app(backend, policy)
    freeze_startup_heap("OpenAI front end")  # a full collection held /health for 200 ms under load
    uvicorn.run(app, host=host, port=port, log_level="warning")
