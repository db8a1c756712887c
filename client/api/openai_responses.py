"""POST /v1/responses on `tritonspec openai`: OpenAI's Responses API for text
(https://platform.openai.com/docs/api-reference/responses/create). `input` is a string or
a list of messages ({"role", "content"}: a string or input_text / output_text parts),
`instructions` a system message before them; they are rendered with the chat template and
generated as /v1/chat/completions generates them (its sampling defaults and checks). The
answer is one `message` output item of one `output_text` part; streamed, it comes as
OpenAI's response.* server-sent events (created, in_progress, output_item.added,
content_part.added, output_text.delta..., output_text.done, content_part.done,
output_item.done, then completed, incomplete at max_output_tokens, or failed).

Fields that would change the answer or ask for what is not kept here (tools, reasoning,
previous_response_id, stored responses, structured text formats, logprobs) are refused
with a 400 naming them; purely informational ones (metadata, user, ...) are echoed or
ignored."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from client.api.openai_frontend import (
    Backend,
    GenerationRuns,
    Offload,
    client_left,
    first_events,
    generation_error,
    plan_request,
    raise_for_event,
)
from client.api.openai_http import OpenAIError
from client.api.openai_params import MAX_INT32
from client.api.triton import Generation

# Accepted at these values only (None: absent); anything else is refused by name.
NEUTRAL = {
    "store": (False,),
    "background": (False,),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "truncation": ("disabled",),
    "top_logprobs": (0,),
    "include": ([],),
    "text": ({"format": {"type": "text"}},),
}
UNSUPPORTED = ("previous_response_id", "conversation", "reasoning", "prompt", "max_tool_calls")
IGNORED = (
    "metadata",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "service_tier",
    "parallel_tool_calls",
    "stream_options",
)
SAMPLING = ("temperature", "top_p")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _check_fields(body: dict) -> None:
    known = {"model", "input", "instructions", "stream", "max_output_tokens", *SAMPLING, *NEUTRAL, *IGNORED}
    for name, value in body.items():
        if name in UNSUPPORTED and value is not None or name not in known | set(UNSUPPORTED):
            raise OpenAIError(400, f"'{name}' is not supported by this server", param=name)
        if name in NEUTRAL and value is not None and value not in NEUTRAL[name]:
            allowed = " or ".join(json.dumps(v) for v in NEUTRAL[name])
            raise OpenAIError(400, f"'{name}' is only supported as {allowed}, got {json.dumps(value)}", param=name)


def _item_text(item: Any, index: int) -> dict[str, str]:
    """One input message as {role, content} text."""
    where = f"input[{index}]"
    if not isinstance(item, dict) or item.get("type", "message") != "message" or item.get("role") not in ROLES:
        raise OpenAIError(
            400, f"{where} must be a message with a role of {', '.join(ROLES)} (only text input is supported)", "input"
        )
    content = item.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text") for p in content):
            raise OpenAIError(400, f"{where}.content: only input_text and output_text parts are supported", "input")
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise OpenAIError(400, f"{where}.content must be a string or a list of text parts", "input")
    return {"role": ROLES[item["role"]], "content": content}


def chat_body(body: dict) -> dict:
    """The /v1/chat/completions request this Responses request amounts to."""
    _check_fields(body)
    source = body.get("input")
    if isinstance(source, str):
        messages = [{"role": "user", "content": source}]
    elif isinstance(source, list) and source:
        messages = [_item_text(item, i) for i, item in enumerate(source)]
    else:
        raise OpenAIError(400, "'input' must be a string or a non-empty list of messages", param="input")
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise OpenAIError(400, "'instructions' must be a string", param="instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    limit = body.get("max_output_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_INT32):
        raise OpenAIError(
            400, f"'max_output_tokens' must be an integer in [1, {MAX_INT32}], got {limit}", "max_output_tokens"
        )
    chat = {name: body[name] for name in ("model", "stream", *SAMPLING) if body.get(name) is not None}
    return {**chat, "messages": messages, "max_completion_tokens": limit}


class ResponseObject:
    """The `response` object of one request, as it stands: its ids, echoed settings and status."""

    def __init__(self, body: dict, model: str) -> None:
        self.id, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created_at, self.model = int(time.time()), model
        self.settings = {
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "metadata": body.get("metadata") or {},
            "user": body.get("user"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": False,
            "background": False,
        }

    def part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self, text: str | None) -> dict:
        """The message output item: in progress with no part yet (None), or done."""
        done = text is not None
        content = [self.part(text)] if done else []
        status = "completed" if done else "in_progress"
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def body(self, status: str, result: Generation | None = None, error: dict | None = None) -> dict:
        out = {"id": self.id, "object": "response", "created_at": self.created_at, "model": self.model}
        out |= {"status": status, "error": error, "incomplete_details": None, **self.settings}
        out["output"], out["usage"] = [], None
        if result is not None:
            out["output"] = [self.item(result.text)]
            if result.finish_reason == "length":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
            prompt, completion = int(result.num_input_tokens), int(result.num_output_tokens)
            out["usage"] = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion,
            }
        return out


def _final_status(result: Generation) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


async def respond(backend: Backend, body: dict, request: Request, offload: Offload) -> Any:
    """One Responses request: validated, then a JSON body or an SSE stream. A client that
    leaves cancels its generation."""
    try:
        plan = await plan_request(backend, "chat", chat_body(body), offload)
    except OpenAIError as e:  # chat's names for what the Responses request calls otherwise
        e.param = {"messages": "input", "max_completion_tokens": "max_output_tokens"}.get(e.param, e.param)
        raise
    response = ResponseObject(body, backend.served_model_name)
    runs = GenerationRuns(backend, plan.prompts, plan.inputs, plan.stream)
    watcher = asyncio.ensure_future(client_left(request, runs))
    try:
        if not plan.stream:
            _, event, value = await runs.next()
            raise_for_event(event, value)
            return JSONResponse(response.body(_final_status(value), value))
        early = await first_events(plan, runs)
    except BaseException:
        runs.cancel.set()
        raise
    finally:
        watcher.cancel()
    return StreamingResponse(_events(response, runs, early), media_type="text/event-stream")


async def _events(response: ResponseObject, runs: GenerationRuns, early: list[tuple]) -> AsyncIterator[str]:
    """OpenAI's response.* events for one message of one text part."""
    sequence = itertools.count()
    where = {"item_id": response.item_id, "output_index": 0, "content_index": 0}

    def sse(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(sequence), **fields})}\n\n"

    text = ""
    try:
        yield sse("response.created", response=response.body("in_progress"))
        yield sse("response.in_progress", response=response.body("in_progress"))
        yield sse("response.output_item.added", output_index=0, item=response.item(None))
        yield sse("response.content_part.added", **where, part=response.part(""))
        while True:
            _, event, value = early.pop(0) if early else await runs.next()
            if event == "gone":
                return
            if event == "text" and value.get("text_output"):
                text += value["text_output"]
                yield sse("response.output_text.delta", **where, delta=value["text_output"], logprobs=[])
            elif event == "done":
                yield sse("response.output_text.done", **where, text=text, logprobs=[])
                yield sse("response.content_part.done", **where, part=response.part(text))
                yield sse("response.output_item.done", output_index=0, item=response.item(text))
                status = _final_status(value)
                yield sse(f"response.{status}", response=response.body(status, value))
                return
            elif event == "error":  # the headers are gone: the failure travels in the stream
                error = generation_error(value)
                failed = response.body("failed", error={"code": error.code or "server_error", "message": error.message})
                yield sse("response.failed", response=failed)
                return
    finally:
        runs.cancel.set()  # a no-op after the end; stops generation when the client left


def add_responses_route(
    app: FastAPI, backend: Backend, body_of: Callable[[Request], Awaitable[dict]], offload: Offload
) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request):
        return await respond(backend, await body_of(request), request, offload)
