"""A corpus of bad requests against the real server (issue 17): wrong types, out-of-range,
huge and NaN numbers, huge stop lists, broken unicode, overlong prompts, unknown keys, wrong
tensor dtypes and shapes over gRPC and HTTP, and requests addressed to the internal
`verifier` and `drafter` models directly. Each must be refused with an error naming the
problem, while greedy requests running beside them keep their exact output; afterwards the
server is ready and holds no sequence state. One server (the shared tiny one) for all."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from client.api.triton import grpc_generate
from tests.fixtures.helpers import grpc_request, wait_for_no_active_sequences

GOOD_PROMPTS = ["The quick brown fox", "def add(a, b):\n    return a + b\ndef add(a, b):", "café naïve 東京"]


# -- transports: each returns the server's error message (or "" when the request succeeded) ----------------------


def _text(*values: str | bytes) -> np.ndarray:
    return np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)


def _speculative(server, prompt: str | bytes = "hi", **tensors: np.ndarray) -> str:
    return grpc_request(server, "speculative", {"text_input": _text(prompt), **tensors})


def _sampling(server, sampling: str | bytes, prompt: str = "hi") -> str:
    """`sampling_parameters` sent as given (malformed JSON too)."""
    return _speculative(server, prompt, sampling_parameters=_text(sampling))


def _http(server, path: str, body: dict | bytes) -> str:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{server.http_url}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        urllib.request.urlopen(request, timeout=60).read()
        return ""
    except urllib.error.HTTPError as e:
        return e.read().decode(errors="replace")


def _generate(server, body: dict | bytes) -> str:
    return _http(server, "/v2/models/speculative/generate", body)


def _verifier_inputs() -> dict[str, np.ndarray]:
    return {"input_ids": np.array([[1, 2, 3]], np.int64), "draft_ids": np.zeros((1, 0), np.int64)}


def _drafter_inputs() -> dict[str, np.ndarray]:
    return {"input_ids": np.array([[1, 2, 3]], np.int64), "num_draft_tokens": np.array([[2]], np.int32)}


def _http_tensors(tensors: dict[str, np.ndarray]) -> list[dict]:
    kinds = {np.int64: "INT64", np.int32: "INT32"}
    return [
        {"name": n, "shape": list(v.shape), "datatype": kinds[v.dtype.type], "data": v.reshape(-1).tolist()}
        for n, v in tensors.items()
    ]


@dataclass
class Case:
    name: str
    send: Callable[[Any], str]
    expected: str  # a part of the error message that names the problem


def _s(name: str, sampling: Any, expected: str) -> Case:
    """A case sent as `sampling_parameters` JSON over gRPC."""
    text = sampling if isinstance(sampling, (str, bytes)) else json.dumps(sampling)
    return Case(name, lambda server: _sampling(server, text), expected)


def _p(name: str, parameters: dict, expected: str) -> Case:
    """A case sent as HTTP /generate request parameters."""
    return Case(
        name,
        lambda server: _generate(server, {"text_input": "hi", "max_tokens": 4, "parameters": parameters}),
        expected,
    )


def _t(name: str, expected: str, prompt: str | bytes = "hi", **tensors: np.ndarray) -> Case:
    """A case sent as gRPC tensors of the `speculative` model."""
    return Case(name, lambda server: _speculative(server, prompt, **tensors), expected)


STANDING_BY = "verifier: standing by, the target is verified in the process of `speculative`"
DRAFTER_STANDING_BY = "drafter: standing by, drafting runs in the process of `speculative`"


def _start_over_grpc(model: str, inputs: Callable[[], dict[str, np.ndarray]]) -> Case:
    """A START sent straight to `model` over gRPC, without the orchestrator's token."""
    return Case(
        f"{model} START over gRPC",
        lambda server: grpc_request(server, model, inputs(), sequence_id=12345, sequence_start=True),
        f"{model}: this model only serves the `speculative` model of this server",
    )


def _over_http(name: str, model: str, parameters: dict, inputs: Callable[[], dict[str, np.ndarray]]) -> Case:
    """A request sent straight to `model`'s /infer over HTTP, without the orchestrator's token."""
    body = lambda: {"parameters": parameters, "inputs": _http_tensors(inputs())}
    return Case(name, lambda server: _http(server, f"/v2/models/{model}/infer", body()), "lacks its internal token")


# Requests addressed to a loaded drafter model (an EAGLE head called over BLS, `bls_server`).
DRAFTER_CASES = [
    _start_over_grpc("drafter", _drafter_inputs),
    _over_http(
        "drafter END over HTTP",
        "drafter",
        {"sequence_id": 4242, "sequence_start": True, "sequence_end": True},
        _drafter_inputs,
    ),
]

# Requests addressed to a loaded verifier model (verifier_in_process "false", `bls_server`).
VERIFIER_CASES = [
    _start_over_grpc("verifier", _verifier_inputs),
    Case(
        "verifier END over gRPC",
        lambda server: grpc_request(
            server, "verifier", _verifier_inputs(), sequence_id=7, sequence_start=True, sequence_end=True
        ),
        "lacks its internal token",
    ),
    Case(
        "verifier with a forged token",
        lambda server: grpc_request(
            server,
            "verifier",
            _verifier_inputs(),
            sequence_id=99,
            sequence_start=True,
            parameters={"tritonspec_token": "0" * 64},
        ),
        "lacks its internal token",
    ),
    _over_http("verifier START over HTTP", "verifier", {"sequence_id": 4242, "sequence_start": True}, _verifier_inputs),
]

CASES = [
    # wrong types
    _s("max_tokens as a word", {"max_tokens": "abc"}, "max_tokens must be an integer, got 'abc'"),
    _s("max_tokens fractional", {"max_tokens": 2.5}, "max_tokens must be an integer"),
    _s("max_tokens boolean", {"max_tokens": True}, "max_tokens must be an integer"),
    _s("max_tokens list", {"max_tokens": [1]}, "max_tokens must be an integer"),
    _s("max_tokens object", {"max_tokens": {}}, "max_tokens must be an integer"),
    _s("temperature as a word", {"temperature": "hot"}, "temperature must be a number"),
    _s("temperature list", {"temperature": [0.5]}, "temperature must be a number"),
    _s("top_p as a word", {"top_p": "x"}, "top_p must be a number"),
    _s("top_k fractional", {"top_k": 1.5}, "top_k must be an integer"),
    _s("seed as a word", {"seed": "abc"}, "seed must be an integer"),
    _s("stop as a number", {"stop": 5}, "stop must be a string or a list of strings"),
    _s("stop list of numbers", {"stop": [1, 2]}, "stop must be a string or a list of strings"),
    _s("ignore_eos maybe", {"ignore_eos": "maybe"}, "ignore_eos must be a boolean"),
    _s("stream yes", {"stream": "yes"}, "stream must be a boolean"),
    _s("num_draft_tokens as a word", {"num_draft_tokens": "four"}, "num_draft_tokens must be an integer"),
    _p("HTTP parameter seed as a word", {"seed": "many"}, "seed must be an integer"),
    # out of range
    _s("max_tokens zero", {"max_tokens": 0}, "max_tokens must be at least 1"),
    _s("max_tokens negative", {"max_tokens": -1}, "max_tokens must be at least 1"),
    _s("max_tokens past the window", {"max_tokens": 100000}, "above the model's limit"),
    _s("max_tokens past int32", {"max_tokens": 1e12}, "max_tokens must be at most 2147483647"),
    _s("temperature negative", {"temperature": -0.5}, "temperature must be >= 0"),
    _s("top_p zero", {"top_p": 0}, "top_p must be in (0, 1]"),
    _s("top_p above one", {"top_p": 1.5}, "top_p must be in (0, 1]"),
    _s("top_k below -1", {"top_k": -5}, "top_k must be -1, 0"),
    _s("seed negative", {"seed": -1}, "seed must be a non-negative 63-bit integer"),
    _s("seed past 63 bits", {"seed": 2**64}, "seed must be a non-negative 63-bit integer"),
    _s("num_draft_tokens negative", {"num_draft_tokens": -2}, "num_draft_tokens must be >= 0"),
    _s("num_draft_tokens above the drafter's k", {"num_draft_tokens": 99}, "num_draft_tokens=99 must be in [0, 4]"),
    _s("num_draft_tokens past the limit", {"num_draft_tokens": 4096}, "num_draft_tokens must be at most 128"),
    _t("top_k tensor below -1", "top_k must be -1, 0", top_k=np.array([-7], np.int32)),
    _t("top_p tensor above one", "top_p must be in (0, 1]", top_p=np.array([3.0], np.float32)),
    _t("max_tokens tensor negative", "max_tokens must be at least 1", max_tokens=np.array([-4], np.int32)),
    _s(
        "streaming with the prompt prepended",
        {"stream": True, "exclude_input_in_output": False},
        "not supported with stream",
    ),
    # huge and NaN numbers
    _s("top_k 1e19", {"top_k": 1e19}, "top_k must be -1, 0 (both: off) or a positive integer up to 2147483647"),
    _s("top_k 10**19 exactly", '{"top_k": 10000000000000000000, "temperature": 1}', "top_k must be -1, 0"),
    _s("temperature NaN literal", '{"temperature": NaN}', "temperature must be a finite number"),
    _s("temperature 'nan'", {"temperature": "nan"}, "temperature must be a finite number"),
    _s("temperature Infinity", '{"temperature": Infinity}', "temperature must be a finite number"),
    _s("top_p -Infinity", {"top_p": "-Infinity"}, "top_p must be a finite number"),
    _s("temperature past float32", {"temperature": 1e39}, "temperature must be a finite number"),
    _t("temperature tensor NaN", "temperature must be a finite number", temperature=np.array([np.nan], np.float32)),
    _t("top_p tensor infinite", "top_p must be a finite number", top_p=np.array([np.inf], np.float32)),
    _s("a 5000-digit max_tokens", '{"max_tokens": ' + "9" * 5000 + "}", "sampling_parameters is not valid JSON"),
    _s(
        "JSON nested 100000 deep",
        '{"stop": ' + "[" * 100000 + "]" * 100000 + "}",
        "sampling_parameters is not valid JSON",
    ),
    _s("sampling_parameters not JSON", "{not json", "sampling_parameters is not valid JSON"),
    _s("sampling_parameters a JSON list", "[1, 2]", "sampling_parameters must be a JSON object"),
    _p("HTTP parameter temperature NaN", {"temperature": float("nan")}, "temperature must be a finite number"),
    # huge stop lists
    _s("33 stop strings", {"stop": [f"s{i}" for i in range(33)]}, "at most 32 stop strings"),
    _s("a stop string of 1025 characters", {"stop": "x" * 1025}, "at most 1024 characters"),
    _s("10 stop strings of 8k characters", {"stop": ["y" * 8192] * 10}, "at most 1024 characters"),
    _t("10000 stop_words tensors", "at most 32 stop strings", stop_words=_text(*[f"w{i}" for i in range(10000)])),
    _t("stop_words with broken UTF-8", "must be UTF-8 text", stop_words=_text(b"\xc3\x28")),
    # unicode edge cases
    _t("text_input with broken UTF-8", "must be UTF-8 text", prompt=b"\xff\xfehello"),
    _t("text_input with a truncated character", "must be UTF-8 text", prompt="東京".encode()[:-1]),
    _t("text_input with an encoded surrogate", "must be UTF-8 text", prompt=b"a\xed\xa0\x80b"),
    _t("text_input only whitespace", "text_input is empty", prompt=" \n\t\u3000 "),
    _t("text_input empty", "text_input is empty", prompt=""),
    _s("sampling_parameters with broken UTF-8", b'{"stop": "\xff"}', "must be UTF-8 text"),
    _s("an unknown key in another script", {"tëmpérature": 1}, "unknown key 'tëmpérature' in sampling_parameters"),
    Case(
        "HTTP JSON with a lone surrogate",
        lambda server: _generate(server, b'{"text_input": "\\ud800 hi", "max_tokens": 3}'),
        "surrogate",
    ),
    # overlong prompts
    _t("a prompt past the context window", "context window", prompt="The quick brown fox " * 200),
    _t("a 1 MB prompt", "characters, more than fit the context window", prompt="z" * 1_000_000),
    Case(
        "a 1 MB prompt over HTTP",
        lambda server: _generate(server, {"text_input": "é" * 1_000_000, "max_tokens": 3}),
        "characters, more than fit the context window",
    ),
    # unknown keys
    _s("an unknown sampling key", {"frobnicate": 2}, "unknown key 'frobnicate' in sampling_parameters"),
    _s("an empty key", {"": 1}, "unknown key '' in sampling_parameters"),
    _s("a megabyte key", {"k" * 1_000_000: 1}, "characters) in sampling_parameters"),
    _p("an unknown request parameter", {"beam_width_x": 2}, "unknown key 'beam_width_x' in request parameters"),
    Case(
        "an unknown input tensor",
        lambda server: _speculative(server, foo=np.array([3], np.int32)),
        "unexpected inference input 'foo'",
    ),
    Case("HTTP without text_input", lambda server: _generate(server, {"max_tokens": 3}), "text_input is required"),
    # wrong tensor dtypes and shapes
    Case(
        "text_input as INT32",
        lambda server: grpc_request(server, "speculative", {"text_input": np.array([1], np.int32)}),
        "inference input 'text_input' data-type is 'INT32', but model 'speculative' expects 'BYTES'",
    ),
    _t("max_tokens as FP32", "input 'max_tokens' data-type is 'FP32'", max_tokens=np.array([3.0], np.float32)),
    _t("random_seed as INT64", "input 'random_seed' data-type is 'INT64'", random_seed=np.array([3], np.int64)),
    _t("temperature as BYTES", "input 'temperature' data-type is 'BYTES'", temperature=_text("0.5")),
    _t("stream as INT32", "input 'stream' data-type is 'INT32'", stream=np.array([1], np.int32)),
    _t("max_tokens of shape [2]", "unexpected shape for input 'max_tokens'", max_tokens=np.array([3, 4], np.int32)),
    _t("max_tokens of shape [1, 1]", "unexpected shape for input 'max_tokens'", max_tokens=np.array([[3]], np.int32)),
    Case(
        "two prompts in text_input",
        lambda server: grpc_request(server, "speculative", {"text_input": _text("a", "b")}),
        "unexpected shape for input 'text_input'",
    ),
    Case(
        "HTTP text_input as a list of two",
        lambda server: _generate(server, {"text_input": ["a", "b"]}),
        "input 'text_input'",
    ),
    Case(
        "HTTP /infer on the streaming model",
        lambda server: _http(
            server,
            "/v2/models/speculative/infer",
            {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]},
        ),
        "doesn't support models with decoupled transaction policy",
    ),
    # the internal models, addressed directly
    Case(
        "verifier without a sequence id",
        lambda server: _http(server, "/v2/models/verifier/infer", {"inputs": _http_tensors(_verifier_inputs())}),
        "must specify a non-zero or non-empty correlation ID",
    ),
    # A standing-by verifier (it is verified in the orchestrator's process) refuses the same.
    *[Case(f"{case.name}, standing by", case.send, STANDING_BY) for case in VERIFIER_CASES],
    # A standing-by drafter (ngram drafts in the orchestrator's process) refuses the same.
    *[Case(f"{case.name}, standing by", case.send, DRAFTER_STANDING_BY) for case in DRAFTER_CASES],
]


def test_the_corpus_is_large_and_names_every_case():
    assert len(CASES) >= 60
    assert len({case.name for case in CASES}) == len(CASES)


def _refused_by_name_hurting_nobody(server, cases: list[Case]) -> None:
    """Send every case while two streams of good requests run: each case is refused with its
    expected words, and every good request gets its reference output."""
    reference = {p: grpc_generate(server.grpc_url, p, max_tokens=24).output_ids for p in GOOD_PROMPTS}
    done = threading.Event()
    good: list[tuple[str, list[int]]] = []
    errors: list[str] = []

    def good_traffic(offset: int) -> None:
        n = offset
        while not done.is_set():
            prompt = GOOD_PROMPTS[n % len(GOOD_PROMPTS)]
            n += 1
            try:
                good.append((prompt, grpc_generate(server.grpc_url, prompt, max_tokens=24).output_ids))
            except Exception as e:  # noqa: BLE001 - a good request must never fail
                errors.append(f"{prompt!r}: {e}")

    threads = [threading.Thread(target=good_traffic, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    failures = []
    try:
        for case in cases:
            message = case.send(server)
            if not message:
                failures.append(f"{case.name}: accepted")
            elif case.expected not in message:
                failures.append(f"{case.name}: {message[:300]!r} does not say {case.expected!r}")
            elif len(message) > 2000:
                failures.append(f"{case.name}: a {len(message)}-character message echoes the input")
        deadline = time.monotonic() + 60  # a short corpus: let each good prompt come through once
        while len(good) < len(GOOD_PROMPTS) and not errors and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        done.set()
        for t in threads:
            t.join()
    assert not failures, "\n".join(failures)
    assert not errors, errors
    assert len(good) >= len(GOOD_PROMPTS)
    assert all(ids == reference[prompt] for prompt, ids in good)
    assert server.is_ready()
    assert not any(wait_for_no_active_sequences(server).values())


def test_bad_requests_are_refused_by_name_and_hurt_nobody(tiny_server):
    _refused_by_name_hurting_nobody(tiny_server, CASES)


def test_loaded_internal_models_refuse_requests_without_the_internal_token(bls_server):
    _refused_by_name_hurting_nobody(bls_server, VERIFIER_CASES + DRAFTER_CASES)


def test_unusual_but_valid_text_is_served(tiny_server):
    """Unicode that is valid must not be refused with the broken kind."""
    for prompt in (
        "emoji 🎉👩‍👩‍👧 done",
        "שלום עולם right-to-left",
        "nul \x00 inside",
        "e\u0301 combining",
        "\ufeffbyte order mark",
        "tab\tand\r\nnewlines",
    ):
        result = grpc_generate(tiny_server.grpc_url, prompt, max_tokens=4, ignore_eos=True)
        assert len(result.output_ids) == 4, prompt
    assert not any(wait_for_no_active_sequences(tiny_server).values())
