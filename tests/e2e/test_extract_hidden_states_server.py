"""extract_hidden_states through the real server: the hidden states of the configured layers,
as outputs of `speculative` and in the safetensors file it writes, equal a plain Hugging Face
forward over prompt + output (all but the last token, which never goes through the target),
also under a grammar."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from backends.runtime.model_store import load_tokenizer
from client.api.triton import grpc_generate
from tests.fixtures.helpers import EXTRACT_LAYERS, EXTRACT_SPEC, hf_greedy, hf_hidden_states
from tests.fixtures.servers import CHUNKED_PREFILL, start_server
from tests.fixtures.structured import PROMPT as CONSTRAINED_PROMPT
from tests.fixtures.structured import check_served_constrained

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The"]


def test_served_hidden_states_and_files(tiny_model_dir, tmp_path):
    server = start_server(
        tmp_path,
        str(tiny_model_dir),
        json.dumps(EXTRACT_SPEC),
        per_model=CHUNKED_PREFILL,
        hidden_states_dir=str(tmp_path / "states"),
    )
    try:
        tokenizer = load_tokenizer(tiny_model_dir)
        # Streamed and not; one token only: the prompt's states.
        for prompt, stream, max_tokens in ((PROMPTS[0], True, 10), (PROMPTS[1], False, 10), (PROMPTS[1], True, 1)):
            result = grpc_generate(server.grpc_url, prompt, max_tokens=max_tokens, stream=stream)
            assert tuple(result.output_ids) == hf_greedy(str(tiny_model_dir), prompt, max_tokens)
            tokens = tokenizer(prompt)["input_ids"] + result.output_ids
            expected = hf_hidden_states(tiny_model_dir, tokens[:-1], EXTRACT_LAYERS)
            assert result.hidden_layer_ids == EXTRACT_LAYERS and result.hidden_states.dtype == "float32"
            torch.testing.assert_close(torch.tensor(result.hidden_states), expected, rtol=1e-4, atol=1e-5)
            with safe_open(result.hidden_states_file, "pt") as f:
                assert f.metadata()["num_prompt_tokens"] == str(len(tokenizer(prompt)["input_ids"]))
                assert f.get_tensor("token_ids").tolist() == tokens
                assert f.get_tensor("layer_ids").tolist() == EXTRACT_LAYERS
                torch.testing.assert_close(f.get_tensor("hidden_states"), expected, rtol=1e-4, atol=1e-5)
        # Under a grammar (it drafts nothing; forced tokens are verified several a step): the
        # target's constrained output, and each position's states
        for result in check_served_constrained(server, tiny_model_dir, num_draft_tokens=None):
            tokens = tokenizer(CONSTRAINED_PROMPT)["input_ids"] + result.output_ids
            expected = hf_hidden_states(tiny_model_dir, tokens[:-1], EXTRACT_LAYERS)
            torch.testing.assert_close(torch.tensor(result.hidden_states), expected, rtol=1e-4, atol=1e-5)
        plain = grpc_generate(server.grpc_url, PROMPTS[0], max_tokens=4, num_draft_tokens=0)
        assert plain.hidden_states is None and tuple(plain.output_ids) == hf_greedy(str(tiny_model_dir), PROMPTS[0], 4)
    finally:
        server.stop()
