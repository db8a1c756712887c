"""`tritonspec openai` against a real tritonserver, driven by the official `openai` client:
completions and chat, streamed and not, return exactly what the `speculative` model returns
over gRPC for the same prompt and parameters; bad requests get OpenAI-shaped errors with
their HTTP status; a client that leaves mid-stream cancels the generation."""

from __future__ import annotations

import contextlib
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from backends.runtime.model_store import load_tokenizer
from client.api.triton import grpc_generate
from client.cli.launcher import openai_front_end
from tests.fixtures.helpers import genai_perf_report, wait_for_no_active_sequences
from tests.fixtures.servers import free_ports
from tests.fixtures.structured import TAG, tagged_animals

# A plain template for the tiny model, whose tokenizer has none.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "def add(a, b):"}]


@dataclass
class FrontEnd:
    """A running `tritonspec openai`: its base URL and process id."""

    base: str
    pid: int

    def peak_rss_mb(self) -> float:
        """The process's peak resident memory so far (VmHWM), in MiB."""
        status = Path(f"/proc/{self.pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024


@contextlib.contextmanager
def openai_api(port: int, triton_url: str, log_path: Path, *options: str) -> Iterator[FrontEnd]:
    """`tritonspec openai` on `port` in front of the Triton server at `triton_url`."""
    with openai_front_end(triton_url, port, log_path, *options) as process:
        yield FrontEnd(f"http://127.0.0.1:{port}", process.pid)


@pytest.fixture(scope="module")
def api_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("openai") / "openai.log"


@pytest.fixture(scope="module")
def api(tiny_server, api_log):
    """`tritonspec openai` in front of the tiny server (model found from the server's config)."""
    template = api_log.parent / "template.jinja"
    template.write_text(TEMPLATE)
    port = free_ports(1)[0]
    with openai_api(port, tiny_server.grpc_url, api_log, "--chat-template", str(template)) as front:
        yield front.base


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=f"{api}/v1", api_key="unused", max_retries=0)


def complete(client: openai.OpenAI, **params):
    """/v1/completions of PROMPT by the `speculative` model; `params` add to or replace those."""
    return client.completions.create(**{"model": "speculative", "prompt": PROMPT, **params})


def chat(client: openai.OpenAI, **params):
    """/v1/chat/completions of MESSAGES by the `speculative` model; `params` add to or replace those."""
    return client.chat.completions.create(**{"model": "speculative", "messages": MESSAGES, **params})


def reference(server, prompt: str, **inputs):
    """The `speculative` model's own answer over gRPC (no prompt echoed)."""
    return grpc_generate(server.grpc_url, prompt, stream=False, exclude_input_in_output=True, **inputs)


def chat_text(tiny_model_dir) -> str:
    tokenizer = load_tokenizer(tiny_model_dir)
    return tokenizer.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)


def streamed(chunks, chat: bool) -> tuple[str, list]:
    chunks = list(chunks)
    pieces = [(c.choices[0].delta.content if chat else c.choices[0].text) or "" for c in chunks if c.choices]
    return "".join(pieces), chunks


def test_every_process_froze_its_start_up_heap_out_of_garbage_collection(api, api_log, tiny_server):
    """A full collection walked ~330k start-up objects (170 ms): /health waited on it (gc_heap.py)."""
    frozen = re.compile(r"(\w[\w ]*): (\d+) start-up objects frozen out of garbage collection")
    front = dict(frozen.findall(api_log.read_text()))
    stubs = dict(frozen.findall(tiny_server.log_path.read_text()))
    assert int(front["OpenAI front end"]) > 10_000, front
    assert int(stubs["speculative"]) > 10_000, stubs


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == ["speculative"]


def test_response_format_structural_tag_holds_inside_its_tags(client, tiny_server, tiny_model_dir):
    """vLLM's response_format {"type": "structural_tag", "structures", "triggers"}: the same
    output as the constraint sent in sampling_parameters to the `speculative` model."""
    fmt = {"type": "structural_tag", **TAG}
    out = chat(client, max_tokens=64, temperature=0, response_format=fmt)
    sampling = {"structured_outputs": {"structural_tag": TAG}}
    ref = reference(
        tiny_server, chat_text(tiny_model_dir), max_tokens=64, temperature=0.0, sampling_parameters=sampling
    )
    text = out.choices[0].message.content
    assert text == ref.text and tagged_animals(text) and "\n" not in text.replace("\n<animal>", ""), text


def test_completions_equal_the_speculative_model(client, tiny_server):
    ref = reference(tiny_server, PROMPT, max_tokens=12, temperature=0.0)
    assert ref.output_ids
    out = complete(client, max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (ref.num_input_tokens, ref.num_output_tokens)
    assert out.usage.total_tokens == ref.num_input_tokens + ref.num_output_tokens

    text, chunks = streamed(
        complete(client, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}), chat=False
    )
    assert text == ref.text and len(chunks) > 3  # token by token, not one lump
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.num_output_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_prompt_logprobs_are_on_the_response_as_vllm_puts_them(client, tiny_server, tiny_model_dir):
    """vLLM's ChatCompletionResponse carries prompt_logprobs beside the choices: those of the
    rendered prompt, as the `speculative` model returns them."""
    ref = reference(tiny_server, chat_text(tiny_model_dir), max_tokens=4, sampling_parameters={"prompt_logprobs": 2})
    out = chat(client, max_completion_tokens=4, temperature=0, extra_body={"prompt_logprobs": 2})
    assert out.model_extra["prompt_logprobs"] == ref.prompt_logprobs
    assert ref.prompt_logprobs[0] is None and len(ref.prompt_logprobs) == ref.num_input_tokens
    assert "prompt_logprobs" not in out.choices[0].model_extra


def test_chat_equals_the_speculative_model_on_the_rendered_template(client, tiny_server, tiny_model_dir):
    ref = reference(tiny_server, chat_text(tiny_model_dir), max_tokens=10, temperature=0.0)
    assert ref.output_ids
    out = chat(client, max_completion_tokens=10, temperature=0)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text and out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == ref.num_input_tokens

    text, chunks = streamed(chat(client, max_tokens=10, temperature=0, stream=True), chat=True)
    assert text == ref.text and chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason and chunks[-1].usage is None


def test_sampling_parameters_and_stop_are_passed_on(client, tiny_server):
    params = {"temperature": 0.9, "top_p": 0.95}
    ref = reference(tiny_server, PROMPT, max_tokens=16, random_seed=11, **params)
    out = complete(client, max_tokens=16, seed=11, **params)
    assert out.choices[0].text == ref.text
    greedy = reference(tiny_server, PROMPT, max_tokens=16, temperature=0.0).text
    stop = greedy.strip()[2:5]
    ref = reference(tiny_server, PROMPT, max_tokens=16, temperature=0.0, stop_words=[stop])
    assert ref.finish_reason == "stop" and len(ref.text) < len(greedy)
    for stream in (False, True):
        out = complete(client, max_tokens=16, temperature=0, stop=stop, stream=stream)
        text = streamed(out, chat=False)[0] if stream else out.choices[0].text
        assert text == ref.text


def test_several_prompts_and_choices_are_generations_of_their_own(client, tiny_server):
    """A list of prompts and n > 1, streamed and not: choice i*n + j is prompt i's generation
    with seed + j (what the `speculative` model gives that prompt and seed alone); usage
    counts each prompt once and every choice's tokens; echo and logprobs stay per choice."""
    prompts, n, seed = [PROMPT, "def add(a, b):"], 2, 5
    params = {"max_tokens": 8, "temperature": 2.0, "top_k": 50}
    refs = [reference(tiny_server, p, random_seed=seed + j, **params) for p in prompts for j in range(n)]
    assert len({r.text for r in refs}) > 2  # the seeds matter: choices of one prompt differ
    usage = (refs[0].num_input_tokens + refs[2].num_input_tokens, sum(r.num_output_tokens for r in refs))
    common = {"prompt": prompts, "n": n, "seed": seed, "max_tokens": 8, "temperature": 2.0}
    out = complete(client, **common, extra_body={"top_k": 50}, echo=True, logprobs=1)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [prompts[i // n] + r.text for i, r in enumerate(refs)]
    assert all(c.logprobs.text_offset[0] == len(prompts[c.index // n]) for c in out.choices)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == usage
    chunks = list(
        complete(client, **common, extra_body={"top_k": 50}, stream=True, stream_options={"include_usage": True})
    )
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)]
    assert texts == [r.text for r in refs]
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2, 3]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == usage
    error = _error(lambda: complete(client, **{**common, "n": 9}))
    assert error.status_code == 400 and "18 choices (2 prompt(s) x n=9); at most 16" in error.message


def test_logprobs_and_penalties_equal_the_speculative_model(client, tiny_server):
    """Completions and chat, streamed and not: the text and the logprobs are the
    `speculative` model's own with the same penalties (which change the text)."""
    controls = {"frequency_penalty": 0.8, "presence_penalty": 0.4}
    free = reference(tiny_server, PROMPT, max_tokens=12, temperature=0.0)
    bias = {str(free.output_ids[2]): -100}  # the third token can no longer be chosen
    ref = reference(
        tiny_server,
        PROMPT,
        max_tokens=12,
        temperature=0.0,
        return_logprobs=True,
        sampling_parameters={"logprobs": 2, "logit_bias": bias},
        **controls,
    )
    assert ref.text != free.text
    chosen = [next(iter(entry.values())) for entry in ref.logprobs]
    for stream in (False, True):
        out = complete(client, max_tokens=12, temperature=0, logprobs=2, logit_bias=bias, stream=stream, **controls)
        choices = [c.choices[0] for c in out] if stream else [out.choices[0]]
        assert "".join(c.text for c in choices) == ref.text
        logprobs = [c.logprobs for c in choices if c.logprobs]
        assert [t for lp in logprobs for t in lp.token_logprobs] == [c["logprob"] for c in chosen]
        assert [t for lp in logprobs for t in lp.tokens] == [c["decoded_token"] for c in chosen]
        assert all(len(top) == 2 for lp in logprobs for top in lp.top_logprobs)
    out = chat(client, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, **controls)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob <= 0 and t.bytes == list(t.token.encode()) for t in content)
    error = _error(lambda: chat(client, top_logprobs=2))
    assert error.status_code == 400 and "'top_logprobs' needs 'logprobs': true" in error.message


def test_an_unreachable_triton_is_503(tiny_model_dir, tmp_path):
    """Triton down (or restarting) is 503, which OpenAI SDKs retry, streamed or not."""
    port, dead = free_ports(2)
    with openai_api(port, f"127.0.0.1:{dead}", tmp_path / "openai.log", "--model", str(tiny_model_dir)) as front:
        unreachable = openai.OpenAI(base_url=f"{front.base}/v1", api_key="unused", max_retries=0)
        for stream in (False, True):
            error = _error(lambda stream=stream: complete(unreachable, stream=stream))
            assert error.status_code == 503 and "unavailable" in error.message


def _error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value


@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_get_400_with_a_message(client, stream):
    def completion(**kw):
        return lambda: complete(client, stream=stream, **kw)

    cases = [
        (completion(n=0), "'n' must be at least 1"),
        (completion(max_tokens="ten"), "'max_tokens' must be an integer"),
        (completion(temperature=-1.0), "'temperature' must be in [0, 2]"),  # OpenAI's ranges
        (completion(temperature=2.5), "'temperature' must be in [0, 2]"),
        (completion(frequency_penalty=2.5), "'frequency_penalty' must be in [-2, 2]"),
        (completion(logprobs=6), "'logprobs' must be in [0, 5]"),
        (completion(extra_body={"repetition_penalty": 0}), "repetition_penalty must be in (0, 100]"),  # the model's
        (completion(max_tokens=0), "'max_tokens' must be an integer in [1, 2147483647], got 0"),
        (completion(max_tokens=2**32 + 3), "'max_tokens' must be an integer in [1, 2147483647], got 4294967299"),
        (completion(prompt="fox " * 2000), "context window"),
        (completion(prompt=[1, 2, 3]), "'prompt' must be a string or a list of strings (token ids"),
        (lambda: chat(client, messages=[], stream=stream), "'messages' must be a non-empty list"),
    ]
    for call, message in cases:
        error = _error(call)
        assert error.status_code == 400 and message in error.message, (message, error.message)
        assert error.body["type"] == "invalid_request_error"
    # Integers the model's int32 / uint64 tensors cannot hold are refused by name, not wrapped
    # (max_tokens 2**32 + 3 generated 3 tokens; top_k 2**32 + 1 acted as 1), and so is an
    # empty stop string, which would match everywhere.
    for param, call in [
        ("max_tokens", completion(max_tokens=2**32 + 3)),
        ("max_completion_tokens", lambda: chat(client, max_completion_tokens=2**31, stream=stream)),
        ("top_k", completion(extra_body={"top_k": 2**32 + 1})),
        ("min_tokens", completion(extra_body={"min_tokens": 2**32 + 1})),
        ("seed", completion(seed=2**64 + 5)),
        ("stop", completion(stop=[""])),
        ("stop", completion(stop=["fox", ""])),
    ]:
        error = _error(call)
        assert error.status_code == 400 and error.body["param"] == param, (param, error.message)
    error = _error(completion(stop=[""]))
    assert error.body["message"] == "'stop' cannot contain an empty string"
    error = _error(completion(model="gpt-4"))
    assert error.status_code == 404 and error.body["code"] == "model_not_found"


def test_raw_http_errors_have_the_openai_shape(api, client):
    def post(path: str, data: bytes) -> tuple[int, dict]:
        request = urllib.request.Request(api + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, body = post("/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = post("/v1/nothing", b"{}")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    # Nested past what any OpenAI request needs: a JSON 400 saying so, not a plain-text 500
    # (json's RecursionError at 100 000 levels; 40 levels parse, and are refused after).
    for depth in (100_000, 40):
        status, body = post("/v1/chat/completions", b'{"messages": ' + b"[" * depth + b"]" * depth + b"}")
        assert status == 400 and "nests more than 32 levels" in body["error"]["message"], (depth, body)
    status, body = post(
        "/v1/chat/completions",
        json.dumps(
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
        ).encode(),
    )
    assert status == 400 and "only text parts" in body["error"]["message"]
    # The server is still fine afterwards.
    assert complete(client, max_tokens=2).usage.completion_tokens == 2


def test_a_client_leaving_mid_stream_cancels_the_generation(client, tiny_server):
    # Long enough that the tiny model is still generating when the cancellation arrives:
    # sampled, its text rarely repeats, so n-gram drafts seldom shorten it to a few steps.
    stream = complete(client, max_tokens=480, temperature=1.0, stream=True, extra_body={"ignore_eos": True})
    for _ in zip(range(3), stream):
        pass
    stream.close()
    assert not any(wait_for_no_active_sequences(tiny_server, timeout_s=10).values())
    log = tiny_server.log_path.read_text()
    deadline = time.monotonic() + 10
    while "cancelled by the client" not in log and time.monotonic() < deadline:
        time.sleep(0.2)
        log = tiny_server.log_path.read_text()
    assert "cancelled by the client" in log


def test_genai_perf_openai_chat_mode(api, tiny_model_dir, tmp_path):
    """genai-perf's OpenAI mode (chat, streaming) runs its requests through the API and reports
    (`--endpoint-type completions` works the same way; checked by hand)."""
    genai_perf_report(tmp_path, api.removeprefix("http://"), tiny_model_dir, "--endpoint-type", "chat")
