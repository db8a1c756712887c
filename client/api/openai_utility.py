"""vLLM's utility routes on `tritonspec openai`, with vLLM's request and response shapes
(vllm/entrypoints/openai/protocol.py at 0052bed36509c7a5a2d8e48265334e40cf2f5a0e:
TokenizeCompletionRequest, TokenizeChatRequest, TokenizeResponse, DetokenizeRequest,
DetokenizeResponse):

- POST /tokenize: {"prompt": text} (add_special_tokens, default true) or {"messages": [...]}
  (rendered with the chat template as /v1/chat/completions renders them) -> {"count",
  "max_model_len", "tokens", "token_strs"}: the ids the `speculative` model computes for
  that request (its prompt token count);
- POST /detokenize: {"tokens": [ids]} -> {"prompt": text};
- GET /version: {"version": tritonspec's version};
- GET /metrics: the front end's own counters (requests by route and status, requests in
  flight) followed by Triton's /metrics (vLLM's `vllm:*` set among them), so one scrape of
  the front end sees both. Scrape either this or Triton's port, not both: the Triton
  series would be counted twice.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from client.api.openai_http import OpenAIError
from client.api.openai_params import chat_messages, chat_prompt, check_type

# The routes counted by name; any other path counts as "other" (a bounded set of labels).
COUNTED_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/version",
    "/metrics",
    "/health",
)
TRITON_METRICS_TIMEOUT_S = 5


class RouteCounts:
    """The front end's requests by route and HTTP status, and those in flight by route."""

    def __init__(self) -> None:
        self.finished: Counter[tuple[str, int]] = Counter()
        self.in_flight: Counter[str] = Counter({route: 0 for route in COUNTED_ROUTES})

    @staticmethod
    def route(path: str) -> str:
        if path.startswith("/v1/models/"):
            return "/v1/models/{model}"
        return path if path in COUNTED_ROUTES else "other"

    def exposition(self) -> str:
        """Prometheus' text format."""
        lines = [
            "# HELP tritonspec_openai_requests_total Requests the OpenAI front end answered, by route and HTTP status.",
            "# TYPE tritonspec_openai_requests_total counter",
        ]
        lines += [
            f'tritonspec_openai_requests_total{{route="{route}",status="{status}"}} {count}'
            for (route, status), count in sorted(self.finished.items())
        ]
        lines += [
            "# HELP tritonspec_openai_requests_in_flight Requests the OpenAI front end is answering now, by route.",
            "# TYPE tritonspec_openai_requests_in_flight gauge",
        ]
        lines += [f'tritonspec_openai_requests_in_flight{{route="{r}"}} {n}' for r, n in sorted(self.in_flight.items())]
        return "\n".join(lines) + "\n"


class RouteCounting:
    """ASGI middleware counting every HTTP request into `counts` once its response ends (a
    stream's last event); outside the front door, so 401s and 429s count too."""

    def __init__(self, app: ASGIApp, counts: RouteCounts) -> None:
        self.app, self.counts = app, counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route, status = self.counts.route(scope["path"]), 500  # 500: failed before any answer

        async def sending(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.counts.in_flight[route] += 1
        try:
            await self.app(scope, receive, sending)
        finally:
            self.counts.in_flight[route] -= 1
            self.counts.finished[(route, status)] += 1


def tritonspec_version() -> str:
    try:
        return version("tritonspec")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is not None and model != served:
        raise OpenAIError(
            404,
            f"the model {model!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def _check_chat_options(body: dict) -> None:
    """vLLM's chat tokenize options other than the rendering /v1/chat/completions uses: refused by name."""
    for name, neutral in (("add_generation_prompt", True), ("continue_final_message", False)):
        if body.get(name, neutral) != neutral:
            raise OpenAIError(400, f"'{name}' is only supported at {str(neutral).lower()}", param=name)
    for name in ("chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs", "media_io_kwargs"):
        if body.get(name) is not None:
            raise OpenAIError(400, f"'{name}' is not supported", param=name)


def tokenize(body: dict, backend: Any) -> dict:
    """vLLM's /tokenize: the ids of a prompt, or of chat messages rendered as
    /v1/chat/completions renders them, with the special tokens the model adds (unless
    add_special_tokens is false): what the model counts as the request's prompt tokens."""
    _check_model(body, backend.served_model_name)
    tokenizer = backend.tokenizer
    if "messages" in body:
        _check_chat_options(body)
        text = chat_prompt(chat_messages(body, backend.max_prompt_chars), tokenizer)
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
    else:
        raise OpenAIError(400, "'prompt' (a string) or 'messages' is required", param="prompt")
    add_special = check_type(body, "add_special_tokens", (bool,), "a boolean") is not False
    ids = tokenizer(text, add_special_tokens=add_special)["input_ids"]
    strs = tokenizer.convert_ids_to_tokens(ids) if check_type(body, "return_token_strs", (bool,), "a boolean") else None
    return {"count": len(ids), "max_model_len": backend.context_window, "tokens": ids, "token_strs": strs}


def detokenize(body: dict, backend: Any) -> dict:
    """vLLM's /detokenize: the text of token ids."""
    _check_model(body, backend.served_model_name)
    tokens = body.get("tokens")
    size = len(backend.tokenizer)
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise OpenAIError(400, "'tokens' must be a list of token ids (integers)", param="tokens")
    if any(not 0 <= t < size for t in tokens):
        bad = next(t for t in tokens if not 0 <= t < size)
        raise OpenAIError(400, f"'tokens' must be token ids in [0, {size}), got {bad}", param="tokens")
    return {"prompt": backend.tokenizer.decode(tokens)}


def triton_metrics(url: str) -> str:
    """Triton's /metrics text, or a comment saying why there is none (the front end's own
    counters still answer)."""
    if not url:
        return "# Triton's metrics: no --metrics-url\n"
    try:
        with urllib.request.urlopen(url, timeout=TRITON_METRICS_TIMEOUT_S) as r:
            return r.read().decode()
    except OSError as e:
        return f"# Triton's metrics at {url} could not be read: {e}\n"


def add_utility_routes(
    app: FastAPI,
    backend: Any,
    body_of: Callable[[Request], Awaitable[dict]],
    offload: Callable[..., Awaitable[Any]],
    counts: RouteCounts,
) -> None:
    """/tokenize, /detokenize, /version and /metrics on `app` (tokenizing on `offload`'s threads)."""

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await offload(tokenize, await body_of(request), backend)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await offload(detokenize, await body_of(request), backend)

    @app.get("/version")
    async def version_route():
        return {"version": tritonspec_version()}

    @app.get("/metrics")
    async def metrics_route():
        triton = await asyncio.to_thread(triton_metrics, backend.metrics_url)
        return PlainTextResponse(counts.exposition() + triton, media_type="text/plain; version=0.0.4")
