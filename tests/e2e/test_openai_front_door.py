"""The front door of `tritonspec openai` (issue 57) against a real tritonserver: an API key on
/v1 routes, a body limit answered 413 before the body is read, a message too long for the
context window refused before it is rendered, rendering off the event loop (so /health stays
fast), a bound on requests in flight answered 429 with Retry-After (which the OpenAI SDK
honours), and a non-streamed request cancelled on Triton when its client leaves."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import openai
import pytest

from client.api.openai_http import GENERATION_PATHS
from client.cli.launcher import family_values
from tests.e2e.test_openai_server import PROMPT, openai_api
from tests.fixtures.helpers import wait_for_no_active_sequences
from tests.fixtures.servers import free_ports

KEY = "sk-front-door-test"
# Spends seconds on a message's first 200 characters (a loop per character): it stands for
# a conversation that takes long to render; the rest of the content is copied as it is.
SLOW_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% for c in m['content'][:200] %}{% set ns = namespace(n=0) %}"
    "{% for _ in range(2500) %}{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}"
    "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXT = "the quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module")
def door(tiny_server, tmp_path_factory):
    """`tritonspec openai` with an API key, at most 2 requests in flight, the default body
    limit (8 MiB) and the slow template."""
    tmp = tmp_path_factory.mktemp("front-door")
    (tmp / "slow.jinja").write_text(SLOW_TEMPLATE)
    options = ("--chat-template", str(tmp / "slow.jinja"), "--api-key", KEY, "--max-concurrent-requests", "2")
    with openai_api(free_ports(1)[0], tiny_server.grpc_url, tmp / "openai.log", *options) as front:
        yield front


@pytest.fixture(scope="module")
def client(door):
    return openai.OpenAI(base_url=f"{door.base}/v1", api_key=KEY, max_retries=0)


def request(
    door, path: str, body: bytes | None = None, key: str | None = KEY, timeout: float = 60
) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a GET (no body) or POST."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(door.base + path, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def door_counts(door) -> tuple[int, Counter[str]]:
    """(generation requests the door has in flight, {status: requests it answered on
    /v1/completions}) from its /metrics."""
    text = request_text(door, "/metrics")
    in_flight = family_values(text, "tritonspec_openai_requests_in_flight")
    totals = family_values(text, "tritonspec_openai_requests_total")
    completions = 'route="/v1/completions",status="'
    return (
        int(sum(in_flight.get(f'route="{path}"', 0) for path in GENERATION_PATHS)),
        Counter(
            {
                labels.removeprefix(completions)[:-1]: int(n)
                for labels, n in totals.items()
                if labels.startswith(completions)
            }
        ),
    )


def request_text(door, path: str) -> str:
    with urllib.request.urlopen(door.base + path, timeout=10) as r:
        return r.read().decode()


def chat_body(content: str, **extra) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 1, **extra}).encode()


def test_v1_routes_need_the_api_key_and_health_does_not(door, client):
    for key in (None, "sk-wrong", KEY + "x"):
        status, body, headers = request(door, "/v1/models", key=key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (key, body)
        assert headers["www-authenticate"] == "Bearer"
    status, body, _ = request(door, "/v1/completions", json.dumps({"prompt": PROMPT}).encode(), key=None)
    assert status == 401 and body["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{door.base}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list()] == ["speculative"]
    assert client.completions.create(model="speculative", prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3
    assert request(door, "/health", key=None)[:2] == (200, {"status": "ok"})


def test_a_body_over_the_limit_is_413_before_it_is_read(door):
    """9 MB against the default 8 MiB: refused from its Content-Length, or (chunked, no
    length) once 8 MiB have come, in OpenAI's shape, without the memory parsing it takes."""
    body = chat_body(TEXT * (9 * 2**20 // len(TEXT)))
    peak = door.peak_rss_mb()
    start = time.monotonic()
    status, error, _ = request(door, "/v1/chat/completions", body)
    assert status == 413 and error["error"]["code"] == "body_too_large", error
    assert "larger than 8388608 bytes" in error["error"]["message"]
    assert time.monotonic() - start < 5

    conn = http.client.HTTPConnection("127.0.0.1", int(door.base.rsplit(":", 1)[1]), timeout=60)
    chunks = (body[i : i + 2**20] for i in range(0, len(body), 2**20))
    headers = {"Authorization": f"Bearer {KEY}", "Transfer-Encoding": "chunked"}
    conn.request("POST", "/v1/completions", body=chunks, headers=headers, encode_chunked=True)
    response = conn.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["code"] == "body_too_large"
    conn.close()
    assert door.peak_rss_mb() - peak < 100


def test_a_message_too_long_for_the_context_is_refused_before_it_is_rendered(door):
    """6 MB of chat (within the body limit) cannot fit 512 tokens whatever it says: refused
    by its length at once, not after seconds of rendering and tokenizing it and a peak of
    ~1 GB of memory."""
    peak = door.peak_rss_mb()
    start = time.monotonic()
    status, error, _ = request(door, "/v1/chat/completions", chat_body(TEXT * (6 * 2**20 // len(TEXT))))
    assert time.monotonic() - start < 2.0
    assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
    assert error["error"]["param"] == "messages" and error["error"]["message"].startswith("messages[0].content is ")
    assert door.peak_rss_mb() - peak < 150
    status, error, _ = request(door, "/v1/completions", json.dumps({"prompt": [PROMPT, "x" * 10**6]}).encode())
    assert status == 400 and error["error"]["message"].startswith("prompt[1] is 1000000 characters"), error


def test_health_stays_fast_while_a_request_is_rendered(door):
    """The template renders on a worker thread: /health and /v1/models answer in well under a
    second meanwhile (they waited the whole rendering when it ran on the event loop)."""
    answer = {}

    def chat() -> None:
        start = time.monotonic()
        answer["status"] = request(door, "/v1/chat/completions", chat_body(TEXT * 5))[0]
        answer["seconds"] = time.monotonic() - start

    worker = threading.Thread(target=chat)
    worker.start()
    time.sleep(0.3)
    waits = []
    while worker.is_alive() and len(waits) < 10:
        for path in ("/health", "/v1/models"):
            start = time.monotonic()
            assert request(door, path, timeout=10)[0] == 200
            waits.append(time.monotonic() - start)
        time.sleep(0.1)
    worker.join()
    assert answer["status"] == 200 and answer["seconds"] > 1.0  # the rendering did take long
    assert len(waits) >= 2 and max(waits) < 0.5, waits


def test_requests_beyond_the_limit_get_429_and_the_sdk_retries(door, client):
    """Two chats being rendered fill the 2 places: a third request is 429 with Retry-After
    (OpenAI's shape), /v1/models still answers, and an SDK that retries gets its answer once
    a place is free."""
    busy = [threading.Thread(target=request, args=(door, "/v1/chat/completions", chat_body(TEXT))) for _ in range(2)]
    for thread in busy:
        thread.start()
    time.sleep(0.5)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model="speculative", prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 429 and info.value.response.headers["retry-after"] == "1"
    assert info.value.body["code"] == "too_many_requests" and "2 requests in flight" in info.value.message
    assert request(door, "/v1/models")[0] == 200
    patient = openai.OpenAI(base_url=f"{door.base}/v1", api_key=KEY, max_retries=20)
    out = patient.completions.create(model="speculative", prompt=PROMPT, max_tokens=2)
    assert out.usage.completion_tokens == 2
    for thread in busy:
        thread.join()


def test_a_client_leaving_a_non_streamed_request_cancels_it(door, tiny_server):
    """A non-streamed request is cancelled on Triton when its client disconnects: the
    server logs the cancellation and holds no sequence soon after (it ran to its end)."""
    log = tiny_server.log_path
    cancelled = log.read_text().count("cancelled by the client")
    # The last test's requests leave the door's count only after their responses were sent:
    # wait until none is counted, or this request could be the one answered 429.
    deadline = time.monotonic() + 10
    while door_counts(door)[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    answered = door_counts(door)[1]
    body = {"prompt": PROMPT, "max_tokens": 480, "n": 4, "temperature": 1.0, "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", int(door.base.rsplit(":", 1)[1]), timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    deadline = time.monotonic() + 10
    while not any(tiny_server.active_sequences().values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(tiny_server.active_sequences().values()), (
        f"the request never started generating; the door answered {door_counts(door)[1] - answered}"
    )
    conn.close()  # the client leaves while the 4 generations run
    left = time.monotonic()
    assert not any(wait_for_no_active_sequences(tiny_server, timeout_s=5).values())
    deadline = left + 5
    while log.read_text().count("cancelled by the client") == cancelled and time.monotonic() < deadline:
        time.sleep(0.1)
    assert log.read_text().count("cancelled by the client") > cancelled
