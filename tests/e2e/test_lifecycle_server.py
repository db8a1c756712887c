"""A server's limits and its end, through a real tritonserver (issue 57): refused requests to
the internal models hold no sequence slot, requests beyond the queue are refused as retryable,
a graceful stop refuses new requests and lets those in flight finish (or cuts them with an
error at the end of its grace period) and exits 0, and a verify step past its timeout fails
its request and leaves the server refusing new ones."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from client.api.triton import GenerationError, ServerUnavailableError, grpc_generate
from client.cli.launcher import DEFAULT_REPOSITORY, RepositoryOverrides, TritonServer
from client.cli.soak import CHAOS_SPECULATIVE_CONFIG
from tests.fixtures.servers import NGRAM_CONFIG, free_ports, make_server

# The internal models' sequence batchers, shrunk: 4 slots, freed after 20 s idle (shipped:
# 256 and 120 s). A refused sequence that kept its slot made the next request wait ~20 s.
SLOTS, IDLE_S = 4, 20
PROMPT = "def add(a, b):\n    return a + b\ndef add(a, b):"  # repetitive: the n-gram drafter drafts
# The stopping tests' stream: the chaos drafter's stall holds it in flight at the stop whatever
# its length, and every token costs two BLS round trips (480 took ~10 s a stream in a suite run).
STREAM_TOKENS = 128


def _server(
    tmp_path, model_dir, speculative: dict, grace_s: float = 30.0, graceful: bool = False, drafter: dict | None = None
) -> TritonServer:
    """The shipped repository on the tiny model, its internal models' slots shrunk."""
    repository = tmp_path / "repository"
    shutil.copytree(DEFAULT_REPOSITORY, repository, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("verifier", "drafter"):
        config = repository / name / "config.pbtxt"
        text = re.sub(r"max_candidate_sequences: \d+", f"max_candidate_sequences: {SLOTS}", config.read_text())
        text = re.sub(r"max_sequence_idle_microseconds: \d+", f"max_sequence_idle_microseconds: {IDLE_S}000000", text)
        config.write_text(text)
    http, grpc, metrics = free_ports(3)
    overrides = RepositoryOverrides(
        common={"model": str(model_dir), "dtype": "float32"},
        per_model={"speculative": speculative, "drafter": drafter or {"speculative_config": NGRAM_CONFIG}},
    )
    return TritonServer(
        repository,
        http,
        grpc,
        metrics,
        overrides=overrides,
        log_path=tmp_path / "server.log",
        graceful_stop=graceful,
        shutdown_grace_s=grace_s,
    )


@pytest.fixture(scope="module")
def bls_limited(tiny_model_dir, tmp_path_factory):
    """Verifying over BLS (the internal verifier serves), one worker and no room to wait."""
    limits = {"verifier_in_process": "false", "max_concurrent_requests": "1", "max_queued_requests": "0"}
    server = _server(tmp_path_factory.mktemp("bls-limited"), tiny_model_dir, limits).start()
    yield server
    server.stop()


def _tokenless_start(url: str, model: str, seq_id: int) -> str:
    """A sequence START without the internal token, as anyone reaching gRPC can send it."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    arrays = {"input_ids": np.array([[1, 2, 3]], np.int64)}
    arrays.update(
        {"draft_ids": np.zeros((1, 0), np.int64)}
        if model == "verifier"
        else {"num_draft_tokens": np.array([[2]], np.int32)}
    )
    tensors = []
    for name, value in arrays.items():
        tensor = grpcclient.InferInput(name, list(value.shape), "INT64" if value.dtype == np.int64 else "INT32")
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    with grpcclient.InferenceServerClient(url) as client:
        try:
            client.infer(model, tensors, sequence_id=seq_id, sequence_start=True, client_timeout=60)
        except InferenceServerException as e:
            return str(e)
    return ""


@pytest.mark.parametrize("model", ["verifier", "drafter"])
def test_refused_sequences_hold_no_slot(bls_limited, model):
    """Token-less STARTs to the serving verifier, and to the drafter standing by, are refused,
    and their sequences end: three times the slots of them, then a request that needs a slot of
    that model is answered at once (before: it waited for the idle timeout)."""
    for i in range(3 * SLOTS):
        error = _tokenless_start(bls_limited.grpc_url, model, 1000 + i)
        assert "only serves the `speculative` model" in error or "standing by" in error, error
    start = time.monotonic()
    if model == "verifier":  # every verify step needs a slot of the verifier's
        generated = grpc_generate(bls_limited.grpc_url, "The quick brown fox", max_tokens=8, timeout_s=60)
        assert len(generated.output_ids) == 8
    else:
        assert "standing by" in _tokenless_start(bls_limited.grpc_url, model, 99)
    took = time.monotonic() - start
    assert took < IDLE_S / 2, f"waited {took:.1f}s for a sequence slot"


def test_requests_beyond_the_queue_are_refused_as_retryable(bls_limited):
    """Its one worker busy and no room to wait: the next request is refused at once, as
    retryable (`unavailable:`, over gRPC and /generate); the running one is served whole."""
    first, stop = threading.Event(), threading.Event()
    results: list = []

    def long_stream() -> None:
        results.append(
            grpc_generate(
                bls_limited.grpc_url,
                "The quick brown fox",
                max_tokens=480,
                ignore_eos=True,
                num_draft_tokens=0,  # one token a step: the longest the tiny model runs
                on_response=lambda out: first.set(),
                cancel=stop,
                timeout_s=60,
            )
        )

    running = threading.Thread(target=long_stream, daemon=True)
    running.start()
    try:
        assert first.wait(30)
        with pytest.raises(GenerationError, match="^unavailable: the server is at its limit of 1 requests running"):
            grpc_generate(bls_limited.grpc_url, "Hello", max_tokens=4, timeout_s=30)
        body = json.dumps({"text_input": "Hello", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"http://{bls_limited.http_url}/v2/models/speculative/generate", data=body)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        # Triton's /generate answers any error a model's response carries with 400: the message says it.
        assert json.loads(refused.value.read())["error"].startswith("unavailable: the server is at its limit")
        running.join(timeout=60)
        assert results and len(results[0].output_ids) == 480
    finally:
        stop.set()
        running.join(timeout=30)
    assert len(grpc_generate(bls_limited.grpc_url, "Hello", max_tokens=4).output_ids) == 4


def test_a_request_sent_as_soon_as_the_last_one_answered_is_admitted(bls_limited):
    """One worker, no queue: a client that sends its next request the moment it has the last
    one's final response is admitted every time (the slot used to stay taken while the worker
    released the sequence in the verifier, and the next request was refused now and then)."""
    import queue

    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(bls_limited.grpc_url)
    # One stream, each request sent from the callback of the last one's final response.
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(60):
            tensors = {
                "text_input": np.array([f"Hello {i}".encode()], np.object_),
                "max_tokens": np.array([2], np.int32),
            }
            inputs = []
            for name, value in tensors.items():
                inputs.append(grpcclient.InferInput(name, [1], "BYTES" if value.dtype == np.object_ else "INT32"))
                inputs[-1].set_data_from_numpy(value)
            client.async_stream_infer("speculative", inputs)
            result, error = answers.get(timeout=30)
            assert error is None, f"request {i}: {error}"
            assert len(result.as_numpy("output_ids").ravel()) == 2
    finally:
        client.stop_stream()
        client.close()


# ---------------------------------------------------------------------------- stopping


def _ready(server: TritonServer) -> bool | None:
    """Triton's readiness; None once nothing answers."""
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=5) as r:
            return r.status == 200
    except urllib.error.HTTPError:
        return False
    except OSError:
        return None


def _sse_stream(server: TritonServer, max_tokens: int) -> tuple[list[dict], threading.Event, threading.Event]:
    """A /generate_stream request read on a thread: its events, an event set once the first one
    came and one set at its end."""
    events: list[dict] = []
    first, done = threading.Event(), threading.Event()
    body = json.dumps({"text_input": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True})
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/speculative/generate_stream", data=body.encode()
    )

    def read() -> None:
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                for line in response:
                    if line.startswith(b"data:"):
                        events.append(json.loads(line[5:]))
                        first.set()
        finally:
            first.set()
            done.set()

    threading.Thread(target=read, daemon=True).start()
    return events, first, done


def _grpc_stream(server: TritonServer, max_tokens: int) -> tuple[list[dict], threading.Event, threading.Event]:
    """As _sse_stream over a gRPC stream (the OpenAI front end's way): each response's outputs,
    or {"error": ...}. Triton's stop waits for open HTTP connections, never for gRPC streams."""
    events: list[dict] = []
    first, done = threading.Event(), threading.Event()

    def read() -> None:
        try:
            grpc_generate(
                server.grpc_url,
                PROMPT,
                max_tokens=max_tokens,
                ignore_eos=True,
                on_response=lambda out: (events.append(out), first.set()),
                timeout_s=60,
            )
        except GenerationError as e:
            events.append({"error": str(e)})
        finally:
            first.set()
            done.set()

    threading.Thread(target=read, daemon=True).start()
    return events, first, done


def _stop_during(
    server: TritonServer, trigger: Path, stream: Callable = _sse_stream
) -> tuple[list[dict], bool | None, Exception | str]:
    """Start a stream and stall its drafter for a while (the chaos proposer's `slow` fault), then
    stop the server gracefully: the stream's events, and what readiness and a new request got
    meanwhile."""
    events, first, done = stream(server, STREAM_TOKENS)
    assert first.wait(30)
    trigger.write_text("slow")  # the stream's next draft takes SLOW_S: it is in flight at the stop
    stopper = threading.Thread(target=server.stop)
    events.append({"stop": True})  # where the stop begins among the events: every later one is after it
    stopper.start()
    time.sleep(0.5)
    ready = _ready(server)
    try:
        grpc_generate(server.grpc_url, "Hello", max_tokens=4, timeout_s=30)
        new_request: Exception | str = "served"
    except GenerationError as e:
        new_request = e
    stopper.join(timeout=120)
    assert not stopper.is_alive() and done.wait(30)
    return events, ready, new_request


def _ids(events: list[dict]) -> list[int]:
    """The token ids a stream's events carried, in order."""
    ids: list[int] = []
    for e in events:
        if "output_ids" in e:
            ids += e["output_ids"] if isinstance(e["output_ids"], list) else [e["output_ids"]]
    return ids


@pytest.fixture
def chaos_trigger(tmp_path, monkeypatch) -> Path:
    trigger = tmp_path / "chaos-trigger"
    monkeypatch.setenv("TRITONSPEC_CHAOS_TRIGGER", str(trigger))  # the server's stubs inherit it
    return trigger


def _stoppable(tmp_path, model_dir, grace_s: float) -> TritonServer:
    """Every peer over BLS: the chaos drafter in the drafter model, and the verifier model
    verifying (verifier_in_process "false"), so a stream in flight at the stop calls both."""
    drafter = {"speculative_config": json.dumps(CHAOS_SPECULATIVE_CONFIG)}
    # Every step drafts (an adaptive length may stop drafting): the stall comes at the next step.
    speculative = {"adaptive_draft_length": "false", "verifier_in_process": "false"}
    server = _server(tmp_path, model_dir, speculative, grace_s=grace_s, graceful=True, drafter=drafter)
    return server.start()


def test_a_graceful_stop_lets_requests_in_flight_finish(tiny_model_dir, tmp_path, chaos_trigger):
    """The stop begins while a stream runs that calls the verifier and the drafter over BLS: a
    new request is refused as retryable at once, and tritonserver is stopped only once the
    stream has ended (readiness stays true until then): it finishes whole, the tokens of the
    same request alone, no error and no drafter fallback; tritonserver exits 0, no crash.
    Before: the verifier and drafter unloaded at once and the stream failed at its next step."""
    server = _stoppable(tmp_path, tiny_model_dir, grace_s=60)
    alone = grpc_generate(server.grpc_url, PROMPT, max_tokens=STREAM_TOKENS, ignore_eos=True, timeout_s=60).output_ids
    events, ready, new_request = _stop_during(server, chaos_trigger, _grpc_stream)
    assert isinstance(new_request, ServerUnavailableError) or str(new_request).startswith("unavailable:"), new_request
    stop = next(i for i, e in enumerate(events) if "stop" in e)
    assert stop < len(events) - 1, "the stream had ended before the stop"  # then it went on
    assert not any("error" in e for e in events), events[-2:]
    assert _ids(events) == list(alone) and events[-1].get("finish_reason") == "length"
    assert "fallback" not in json.loads(events[-1]["perf_metrics"]), events[-1]["perf_metrics"]
    assert ready is True  # the price of waiting (docs/deployment.md, "Stopping")
    assert server.process.returncode == 0, server.log_tail(40)
    assert "Signal (11)" not in server.log_tail(400)
    # The stubs froze their start-up heaps (gc_heap.py) and give them back at exit: no
    # extension module reports them as leaked as it unloads.
    assert "leaked" not in server.log_tail(400), server.log_tail(40)


def test_a_stream_past_the_grace_period_ends_with_an_error_event(tiny_model_dir, tmp_path, chaos_trigger):
    """A grace period of 0: the stream in flight is cut at its next step, with an SSE error event
    saying why, and the server exits 0."""
    server = _stoppable(tmp_path, tiny_model_dir, grace_s=0)
    events, _, _ = _stop_during(server, chaos_trigger)
    assert len(_ids(events)) < STREAM_TOKENS
    assert events[-1].get("error", "").startswith("unavailable: the server shut down before this request finished"), (
        events[-2:]
    )
    assert server.process.returncode == 0, server.log_tail(40)


def test_a_verify_step_past_its_timeout_fails_and_the_server_refuses_more(tiny_model_dir, tmp_path):
    """step_timeout_s shorter than any forward: the request fails naming the hung step, and the
    next is refused as retryable (the server is not ready)."""
    server = make_server(tmp_path, str(tiny_model_dir), per_model={"speculative": {"step_timeout_s": "0.000001"}})
    server.start()
    try:
        with pytest.raises(GenerationError, match="the forward of 'verifier''s target ran past 1e-06 s"):
            grpc_generate(server.grpc_url, "The quick", max_tokens=4, timeout_s=60)
        with pytest.raises(GenerationError, match="^unavailable: the server is not ready: a verify step hung"):
            grpc_generate(server.grpc_url, "The quick", max_tokens=4, timeout_s=60)
    finally:
        server.stop()
