"""The routes vLLM users call beside completions, on `tritonspec openai` in front of a real
tritonserver: /tokenize and /detokenize (vLLM's shapes; the ids are the ones the model
counts), /version, /metrics (the front end's counters and Triton's), /v1/responses through
the official `openai` SDK (equal to chat completions on the same messages, streamed as
OpenAI's response.* events), and `param` on the range errors the model itself raises."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from importlib.metadata import version

import openai
import pytest

from client.api.triton import grpc_generate
from tests.e2e.test_openai_server import MESSAGES, PROMPT, TEMPLATE, openai_api
from tests.fixtures.servers import free_ports


@pytest.fixture(scope="module")
def api(tiny_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai-endpoints")
    (tmp / "template.jinja").write_text(TEMPLATE)
    metrics_url = f"http://{tiny_server.host}:{tiny_server.metrics_port}/metrics"
    options = ("--chat-template", str(tmp / "template.jinja"), "--metrics-url", metrics_url)
    with openai_api(free_ports(1)[0], tiny_server.grpc_url, tmp / "openai.log", *options) as front:
        yield front.base


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=f"{api}/v1", api_key="unused", max_retries=0)


def call(api: str, path: str, body: dict | None = None) -> tuple[int, dict | str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(api + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if r.headers.get_content_type() == "application/json" else text
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_gives_the_ids_the_model_counts(api, tiny_server, client):
    status, out = call(api, "/tokenize", {"model": "speculative", "prompt": PROMPT, "return_token_strs": True})
    ref = grpc_generate(tiny_server.grpc_url, PROMPT, max_tokens=1)
    assert status == 200 and out["count"] == len(out["tokens"]) == ref.num_input_tokens
    assert out["max_model_len"] == 512 and len(out["token_strs"]) == out["count"]
    status, plain = call(api, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert plain["token_strs"] is None and plain["count"] <= out["count"]
    # Chat messages: rendered as /v1/chat/completions renders them.
    status, chat = call(api, "/tokenize", {"messages": MESSAGES})
    usage = client.chat.completions.create(model="speculative", messages=MESSAGES, max_tokens=1).usage
    assert status == 200 and chat["count"] == usage.prompt_tokens
    status, back = call(api, "/detokenize", {"model": "speculative", "tokens": plain["tokens"]})
    assert status == 200 and back == {"prompt": PROMPT}


def test_tokenize_refuses_what_it_cannot_do_by_name(api):
    for path, body, param in [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": PROMPT, "model": "gpt-4"}, "model"),
        ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
        ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ]:
        status, out = call(api, path, body)
        assert status in (400, 404) and out["error"]["param"] == param, (body, out)


def test_version_and_metrics(api):
    status, out = call(api, "/version")
    assert status == 200 and out == {"version": version("tritonspec")}
    call(api, "/tokenize", {"prompt": PROMPT})
    status, text = call(api, "/metrics")
    assert status == 200
    assert 'tritonspec_openai_requests_total{route="/tokenize",status="200"}' in text
    assert 'tritonspec_openai_requests_in_flight{route="/metrics"} 1' in text  # this one
    # Triton's, merged: vLLM's names among them.
    assert "# TYPE vllm:request_success_total counter" in text and "nv_inference_count{" in text


def test_responses_equal_chat_completions(client):
    chat = client.chat.completions.create(model="speculative", messages=MESSAGES, max_tokens=10, temperature=0)
    out = client.responses.create(
        model="speculative",
        instructions=MESSAGES[0]["content"],
        input=[{"role": "user", "content": MESSAGES[1]["content"]}],
        max_output_tokens=10,
        temperature=0,
    )
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.output_text == chat.choices[0].message.content
    assert out.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert out.output[0].type == "message" and out.output[0].role == "assistant"
    # A string input is one user message.
    single = client.responses.create(model="speculative", input="def add(a, b):", max_output_tokens=6, temperature=0)
    again = client.chat.completions.create(
        model="speculative", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=6, temperature=0
    )
    assert single.output_text == again.choices[0].message.content


def test_responses_stream_openais_events(client):
    whole = client.responses.create(
        model="speculative", input=MESSAGES[1]["content"], max_output_tokens=12, temperature=0
    )
    events = list(
        client.responses.create(
            model="speculative", input=MESSAGES[1]["content"], max_output_tokens=12, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    final = f"response.{whole.status}"
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", final]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text == events[-4].text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_responses_refuse_what_they_cannot_do_by_name(client):
    for kwargs, param in [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(**{"model": "speculative", "input": "Hi", **kwargs})
        assert info.value.body["param"] == param, (kwargs, info.value.body)


@pytest.mark.parametrize("stream", [False, True])
def test_the_models_range_errors_name_their_parameter(client, stream):
    for extra, param in [({"repetition_penalty": 0}, "repetition_penalty"), ({"min_tokens": 9}, "min_tokens")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="speculative", prompt=PROMPT, max_tokens=4, stream=stream, extra_body=extra)
        assert info.value.body["param"] == param, info.value.body
