"""Client side of the `speculative` model: gRPC streaming and HTTP /generate(_stream),
returning the text, the ids and the per-request statistics."""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class GenerationError(RuntimeError):
    """The server answered the request with an error."""


class GenerationTimeout(GenerationError):
    """No response came within the caller's timeout; the request was cancelled."""


class ServerUnavailableError(GenerationError):
    """The server cannot be reached, or is starting or stopping: retry later."""


# How gRPC and Triton word a server that is down, starting or shutting down (a model's BLS
# call during shutdown fails with "Server not ready"; a request for a model that is unloading,
# as every model is once the server stops, "Request for unknown model: ... has no available versions").
_UNAVAILABLE = (
    "StatusCode.UNAVAILABLE",
    "Server not ready",
    "Server is stopping",
    "no longer in valid state",
    "has no available versions",
)


def server_error(error: object) -> GenerationError:
    message = str(error)
    if any(mark in message for mark in _UNAVAILABLE):
        return ServerUnavailableError(message)
    return GenerationError(message)


# Outputs a Generation keeps as they come (the last response's value stands).
SCALAR_OUTPUTS = (
    "finish_reason",
    "num_input_tokens",
    "num_output_tokens",
    "total_draft_tokens",
    "total_accepted_draft_tokens",
    "acceptance_rate",
)


@dataclass
class Generation:
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    total_draft_tokens: int = 0
    total_accepted_draft_tokens: int = 0
    acceptance_rate: float = 0.0
    perf_metrics: dict = field(default_factory=dict)
    num_responses: int = 0
    seconds: float = 0.0
    first_token_s: float | None = None  # from the send to the first response with output tokens
    # From an extract_hidden_states drafter (gRPC): [positions, layers, hidden] for prompt +
    # output but the last token, the layer ids, and the server-side file when one was written.
    hidden_states: np.ndarray | None = None
    hidden_layer_ids: list[int] = field(default_factory=list)
    hidden_states_file: str = ""
    # With return_logprobs / return_cumulative_logprob: per output token the vLLM backend's
    # {token id (str): {"logprob", "rank", "decoded_token"}}, and their sum.
    logprobs: list[dict] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # With prompt_logprobs: null for the first prompt token, then entries as in `logprobs`.
    prompt_logprobs: list[dict | None] | None = None

    def add(self, out: dict[str, Any]) -> None:
        """Fold one response (streamed delta or whole) into the result."""
        self.num_responses += 1
        self.text += out.get("text_output", "")
        self.output_ids += list(out.get("output_ids", []))
        for key in SCALAR_OUTPUTS:
            if key in out and out[key] != "":
                setattr(self, key, out[key])
        if out.get("perf_metrics"):
            self.perf_metrics = json.loads(out["perf_metrics"])
        if out.get("logprobs"):
            self.logprobs += json.loads(out["logprobs"]) or []
        if out.get("prompt_logprobs"):
            self.prompt_logprobs = json.loads(out["prompt_logprobs"])
        if "cumulative_logprob" in out:
            self.cumulative_logprob = float(out["cumulative_logprob"])
        for key in HIDDEN_OUTPUTS:
            if key in out:
                setattr(self, key, out[key])

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.seconds if self.seconds else 0.0


def _scalar(array: np.ndarray) -> Any:
    value = array.reshape(-1)[0] if array.size else ""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return value.item() if hasattr(value, "item") else value


def _decode_outputs(result: Any, names: list[str]) -> dict[str, Any]:
    out = {}
    for name in names:
        array = result.as_numpy(name)
        if array is None:
            continue
        if name == "hidden_states":
            out[name] = array
        elif name in ("output_ids", "hidden_layer_ids"):
            out[name] = array.reshape(-1).tolist()
        else:
            out[name] = _scalar(array)
    return out


OUTPUTS = [
    "text_output",
    "output_ids",
    *SCALAR_OUTPUTS,
    "perf_metrics",
    "cumulative_logprob",
    "logprobs",
    "prompt_logprobs",
]
HIDDEN_OUTPUTS = ["hidden_states", "hidden_layer_ids", "hidden_states_file"]  # gRPC only


# The dtype of each numeric / flag input tensor the `speculative` model takes.
INPUT_DTYPES = {
    "max_tokens": np.int32,
    "num_draft_tokens": np.int32,
    "stream_interval": np.int32,
    "top_k": np.int32,
    "min_tokens": np.int32,
    "temperature": np.float32,
    "top_p": np.float32,
    "random_seed": np.uint64,
    "repetition_penalty": np.float32,
    "presence_penalty": np.float32,
    "frequency_penalty": np.float32,
    "exclude_input_in_output": bool,
    "ignore_eos": bool,
}


def grpc_generate(
    url: str,
    prompt: str,
    model: str = "speculative",
    stream: bool = True,
    sampling_parameters: dict | None = None,
    on_text: Callable[[str], None] | None = None,
    cancel_after_responses: int | None = None,
    timeout_s: float | None = 300.0,
    cancel: threading.Event | None = None,
    on_response: Callable[[dict], None] | None = None,
    **inputs: Any,
) -> Generation:
    """Run one request over a gRPC stream. `inputs` become input tensors (max_tokens=...).
    `on_response` gets each response's decoded outputs (`on_text` its text, when any).
    Setting `cancel` (from another thread) cancels the request on the server. `timeout_s`:
    the longest wait for each response (a whole non-streamed generation; None: no limit);
    past it the request is cancelled and GenerationTimeout raised."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    infer_inputs = _grpc_inputs(_input_tensors(prompt, stream, sampling_parameters, inputs))
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    result = Generation()
    start = time.perf_counter()
    finished = False
    try:
        try:
            client.async_stream_infer(
                model,
                infer_inputs,
                enable_empty_final_response=True,
                outputs=[grpcclient.InferRequestedOutput(n) for n in OUTPUTS + HIDDEN_OUTPUTS],
            )
        except InferenceServerException as e:  # the stream died first; its callback has the reason
            raise ServerUnavailableError(_stream_failure(responses, e)) from None
        finished = _receive(
            client, responses, result, start, timeout_s, cancel, cancel_after_responses, on_response, on_text
        )
    finally:
        result.seconds = time.perf_counter() - start
        # Without the final response (a timeout, an error raised here) closing the stream
        # would wait for the server to finish: cancel the request instead.
        client.stop_stream(cancel_requests=not finished)
        client.close()
    return result


def _input_tensors(
    prompt: str, stream: bool, sampling_parameters: dict | None, inputs: dict[str, Any]
) -> dict[str, np.ndarray]:
    """The request's input tensors by name: the prompt, `stream`, the vLLM backend's
    sampling_parameters JSON, and each of `inputs` in its dtype."""
    tensors = {"text_input": np.array([prompt.encode()], dtype=np.object_), "stream": np.array([stream], dtype=bool)}
    if sampling_parameters is not None:
        tensors["sampling_parameters"] = np.array([json.dumps(sampling_parameters).encode()], dtype=np.object_)
    for name, value in inputs.items():
        if name.startswith("return_"):  # the vLLM backend's flags: return_logprobs=True, ...
            tensors[name] = np.array([value], dtype=bool)
        elif name in ("stop_words", "bad_words"):
            tensors[name] = np.array([s.encode() for s in value], dtype=np.object_)
        else:
            tensors[name] = np.array([value], dtype=INPUT_DTYPES[name])
    return tensors


def _grpc_inputs(tensors: dict[str, np.ndarray]) -> list:
    import tritonclient.grpc as grpcclient

    infer_inputs = []
    for name, value in tensors.items():
        tensor = grpcclient.InferInput(name, list(value.shape), _triton_dtype(value))
        tensor.set_data_from_numpy(value)
        infer_inputs.append(tensor)
    return infer_inputs


def _receive(
    client: Any,
    responses: queue.Queue,
    result: Generation,
    start: float,
    timeout_s: float | None,
    cancel: threading.Event | None,
    cancel_after_responses: int | None,
    on_response: Callable[[dict], None] | None,
    on_text: Callable[[str], None] | None,
) -> bool:
    """Fold the stream's responses into `result` until the final one (True), or until the
    caller cancels or `cancel_after_responses` is reached (False: the request is cancelled)."""
    while True:
        response, error = next_response(responses, timeout_s, cancel)
        if response is None and error is None:  # cancelled by the caller
            client.stop_stream(cancel_requests=True)
            return False
        if error is not None:
            # The request's last response: close without cancelling the request it ended (that
            # cancel, under load, left Triton 2.51 holding the model: its unload never finished).
            client.stop_stream(cancel_requests=False)
            raise server_error(error)
        params = response.get_response().parameters
        final = params["triton_final_response"].bool_param if "triton_final_response" in params else False
        out = _decode_outputs(response, OUTPUTS + HIDDEN_OUTPUTS)
        if out:
            result.add(out)
            if result.first_token_s is None and out.get("output_ids"):
                result.first_token_s = time.perf_counter() - start
            if on_text and out.get("text_output"):
                on_text(out["text_output"])
            if on_response:
                on_response(out)
        if final:
            return True
        if cancel_after_responses is not None and result.num_responses >= cancel_after_responses:
            client.stop_stream(cancel_requests=True)
            return False


def _stream_failure(responses: queue.Queue, e: Exception) -> str:
    try:
        _, error = responses.get(timeout=1.0)
    except queue.Empty:
        error = None
    return f"the stream to the Triton server closed: {error or e}"


def next_response(responses: queue.Queue, timeout_s: float | None, cancel: threading.Event | None) -> tuple:
    """The next (result, error) from the stream; (None, None) once `cancel` is set."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while cancel is None or not cancel.is_set():
        wait = None if cancel is None else 0.1  # polling for `cancel`
        if deadline is not None:
            left = max(0.0, deadline - time.monotonic())
            wait = left if wait is None else min(wait, left)
        try:
            return responses.get(timeout=wait)
        except queue.Empty:
            if deadline is not None and time.monotonic() >= deadline:
                raise GenerationTimeout(
                    f"no response from the server within {timeout_s:g} s (the client's "
                    "timeout_s); the request was cancelled"
                ) from None
    return None, None


def _triton_dtype(value: np.ndarray) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return np_to_triton_dtype(value.dtype)


def http_generate(
    url: str,
    prompt: str,
    model: str = "speculative",
    stream: bool = False,
    parameters: dict | None = None,
    on_text: Callable[[str], None] | None = None,
    timeout_s: float | None = 300.0,
    **inputs: Any,
) -> Generation:
    """POST /generate (one response) or /generate_stream (SSE) with a JSON body.
    `timeout_s`: the longest wait for data (None: no limit), else GenerationTimeout."""
    body = {"text_input": prompt, "stream": stream, **inputs}
    if parameters:
        body["parameters"] = parameters
    endpoint = "generate_stream" if stream else "generate"
    request = urllib.request.Request(
        f"http://{url}/v2/models/{model}/{endpoint}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    result = Generation()
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            if not stream:
                body = json.loads(response.read())
                if "error" in body:  # Triton answers some failures with 200 and an error body
                    raise server_error(body["error"])
                result.add(_http_outputs(body))
            else:
                for line in response:
                    line = line.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        raise server_error(event["error"])
                    out = _http_outputs(event)
                    result.add(out)
                    if on_text and out.get("text_output"):
                        on_text(out["text_output"])
    except urllib.error.HTTPError as e:
        raise server_error(json.loads(e.read() or b"{}").get("error", str(e))) from None
    except urllib.error.URLError as e:  # refused, unknown host: nothing answered
        raise ServerUnavailableError(f"cannot reach the Triton server at {url}: {e.reason}") from None
    except TimeoutError:
        raise GenerationTimeout(f"no data from the server within {timeout_s:g} s (the client's timeout_s)") from None
    result.seconds = time.perf_counter() - start
    return result


def _http_outputs(event: dict) -> dict:
    out = {k: v for k, v in event.items() if k in OUTPUTS}
    for key, value in out.items():  # single-element arrays come back as lists
        if isinstance(value, list) and key != "output_ids":
            out[key] = value[0] if value else ""
    if isinstance(out.get("output_ids"), int):
        out["output_ids"] = [out["output_ids"]]
    return out
