"""The HTTP edge of `tritonspec openai`: OpenAI's error shape, request bodies read within
limits (size before anything is parsed, nesting), and the door in front of the app: an API
key (Bearer, as vLLM's `--api-key`) and a bound on generation requests in flight, beyond
which clients get 429 with `Retry-After` (OpenAI SDKs wait and retry on it)."""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

# A request body may be this large by default: a 128k-token prompt is ~0.5 MB of text, and a
# completions request may carry 16 prompts.
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
# Generation requests in flight by default: twice the `speculative` model's 64 worker threads
# (its `max_concurrent_requests`), so a queue on Triton keeps it busy, but a bounded one.
DEFAULT_MAX_CONCURRENT_REQUESTS = 128
# An OpenAI request nests 5 levels (messages[].content[].image_url.url); past this, refused.
MAX_NESTING = 32
API_KEY_ENV = "TRITONSPEC_API_KEY"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
RETRY_AFTER_S = 1
# Past the limit, this much more of a body is read and dropped so that the client gets the 413.
DRAIN_BYTES = 64 * 2**20


class OpenAIError(Exception):
    """An error answered in OpenAI's JSON shape with an HTTP status."""

    TYPES = {
        400: "invalid_request_error",
        401: "invalid_request_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        500: "api_error",
        503: "service_unavailable_error",
    }

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

    def response(self) -> JSONResponse:
        headers = {}
        if self.status in (429, 503):  # retryable: say when
            headers["Retry-After"] = str(RETRY_AFTER_S)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


# ---------------------------------------------------------------------------- bodies


async def read_json_body(request: Request, max_bytes: int, offload: Callable[..., Awaitable[Any]]) -> dict[str, Any]:
    """The request's JSON object, refused with 413 as soon as it is known to exceed `max_bytes`
    (its Content-Length, or the bytes received so far), and parsed by `offload` (a worker
    thread) so that a large body does not hold up the event loop."""
    declared = request.headers.get("content-length", "")
    too_large = declared.isdigit() and int(declared) > max_bytes
    if too_large and request.headers.get("expect", "").lower() == "100-continue":
        raise _too_large(max_bytes)  # the client waits for our word before it sends the body
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            too_large = too_large or size > max_bytes
            if not too_large:
                chunks.append(chunk)
            elif size > max_bytes + DRAIN_BYTES:
                break  # answered now, the connection is closed
            # else dropped: most clients send the whole body before they read the answer,
            # and one closed under them sees a broken pipe, not the 413
    except ClientDisconnect:
        raise ClientGone() from None
    if too_large:
        raise _too_large(max_bytes)
    return await offload(parse_json_object, b"".join(chunks))


def _too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(
        413, f"the request body is larger than {max_bytes} bytes (the server's --max-body-bytes)", code="body_too_large"
    )


def parse_json_object(data: bytes) -> dict[str, Any]:
    """A JSON object nested at most MAX_NESTING levels deep, else a 400 saying what is wrong."""
    try:
        body = json.loads(data)
    except RecursionError:  # the C parser's own limit, far above ours
        raise _too_deep() from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    if nesting_depth(body) > MAX_NESTING:
        raise _too_deep()
    return body


def _too_deep() -> OpenAIError:
    return OpenAIError(400, f"the request body nests more than {MAX_NESTING} levels of arrays and objects")


def nesting_depth(value: Any) -> int:
    """How many levels of arrays and objects `value` nests (walked without recursion, and
    stopping once past MAX_NESTING)."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_NESTING:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


# ---------------------------------------------------------------------------- the door


@dataclass(frozen=True)
class DoorPolicy:
    """Who may come in and how many at once: the API key (None: anyone) and the bound on
    generation requests in flight (each may hold up to 16 generations on Triton)."""

    api_key: str | None = None
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


class FrontDoor:
    """ASGI middleware: /v1 routes need the API key when one is set (/health stays open, as
    vLLM's does); generation requests beyond the bound are answered 429 before their body
    is read. A request counts until its response ends (a stream's last event)."""

    def __init__(self, app: ASGIApp, policy: DoorPolicy) -> None:
        self.app, self.policy = app, policy
        self.in_flight = 0  # touched on the event loop only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.policy.api_key is not None and path.startswith("/v1") and not self._authorized(scope):
            error = OpenAIError(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key")
            return await error.response()(scope, receive, send)
        if path not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if self.in_flight >= self.policy.max_concurrent_requests:
            error = OpenAIError(
                429,
                f"the server is at its limit of {self.policy.max_concurrent_requests} requests in flight; "
                f"retry after {RETRY_AFTER_S} s",
                code="too_many_requests",
            )
            return await error.response()(scope, receive, send)
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        # compare_digest: the time taken says nothing about how much of the key matched.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.policy.api_key.encode())
