"""extract_hidden_states: plain decoding that returns the target's hidden states of the
configured layers; they must equal a plain Hugging Face forward over prompt + output (all
but the last token, which never goes through the target), in process and through the real
server (as outputs of `speculative` and in the safetensors file it writes)."""
from __future__ import annotations

import json
import random

import pytest
import torch

from backends.config import SpeculativeConfig
from backends.serving.detokenize import TextStream
from backends.serving.drafting import DraftService
from backends.methods.extract_hidden_states import HiddenStateExtractor
from backends.runtime.model_store import load_tokenizer
from backends.serving.orchestrator import GenerationStats, generate
from backends.serving.proposer import build_proposer
from backends.serving.request import GenerationRequest
from backends.serving.target import TargetRunner
from tests.helpers import _load, hf_greedy

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The"]
LAYERS = [2, 0, 1]  # 2 = L: the final normed state (HF's last hidden_states entry); any order
SPEC = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}}}


def hf_hidden_states(model_dir, token_ids: list[int]) -> torch.Tensor:
    """HF's output_hidden_states over `token_ids`, the configured layers: [T, layers, H]."""
    model, _ = _load(str(model_dir))
    with torch.inference_mode():
        states = model(input_ids=torch.tensor([token_ids]), output_hidden_states=True).hidden_states
    return torch.stack([states[i][0] for i in LAYERS], dim=1)


def test_config_and_proposer(tiny_model_dir):
    config = SpeculativeConfig.from_json(SPEC, target_model=str(tiny_model_dir))
    proposer = build_proposer(config, max_model_len=512, target_model=tiny_model_dir)
    assert isinstance(proposer, HiddenStateExtractor) and proposer.hidden_layer_ids == tuple(LAYERS)
    assert DraftService(proposer, config).num_speculative_tokens == 0  # it never drafts
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids \[0, 3\] must be distinct layer ids "
                                         r"in \[0, 2\]"):
        build_proposer(SpeculativeConfig.from_json({**SPEC, "eagle_aux_hidden_state_layer_ids": [0, 3]},
                                                   target_model=str(tiny_model_dir)),
                       max_model_len=512, target_model=tiny_model_dir)


def test_in_process_hidden_states_equal_a_plain_forward(tiny_model_dir):
    from tests.test_orchestrator import LocalDrafter, LocalVerifier

    runner, tokenizer = TargetRunner(tiny_model_dir, dtype="float32"), load_tokenizer(tiny_model_dir)
    config = SpeculativeConfig.from_json(SPEC, target_model=str(tiny_model_dir))
    service = DraftService(build_proposer(config, max_model_len=512, target_model=tiny_model_dir), config)
    drafter = LocalDrafter(service)
    drafter.num_speculative_tokens = service.num_speculative_tokens  # what the drafter model reports: 0
    for prompt in PROMPTS:
        prompt_ids = tokenizer(prompt)["input_ids"]
        seq_id, out, parts, stats = random.getrandbits(32), [], [], GenerationStats()
        for step in generate(GenerationRequest(prompt=prompt, max_tokens=12), prompt_ids, seq_id,
                             LocalVerifier(runner), drafter, TextStream(tokenizer), {0}, runner.max_model_len, stats):
            out += step.token_ids
            parts.append(step.hidden_states)
        runner.release(seq_id)
        drafter.release(seq_id)
        assert tuple(out) == hf_greedy(str(tiny_model_dir), prompt, 12)
        assert stats.acceptance.num_draft_tokens == 0 and stats.num_steps == len(out)
        hidden, tokens = torch.cat(parts), prompt_ids + out
        assert hidden.shape == (len(tokens) - 1, len(LAYERS), 64)
        torch.testing.assert_close(hidden, hf_hidden_states(tiny_model_dir, tokens[:-1]), rtol=1e-4, atol=1e-5)


def test_served_hidden_states_and_files(tiny_model_dir, tmp_path):
    from safetensors import safe_open

    from client.api.triton import grpc_generate
    from tests.conftest import start_server

    server = start_server(tmp_path, str(tiny_model_dir), json.dumps(SPEC),
                          hidden_states_dir=str(tmp_path / "states"))
    try:
        tokenizer = load_tokenizer(tiny_model_dir)
        # Streamed and not; one token only: the prompt's states (the drafter is still asked).
        for prompt, stream, max_tokens in ((PROMPTS[0], True, 10), (PROMPTS[1], False, 10), (PROMPTS[1], True, 1)):
            result = grpc_generate(server.grpc_url, prompt, max_tokens=max_tokens, stream=stream)
            assert tuple(result.output_ids) == hf_greedy(str(tiny_model_dir), prompt, max_tokens)
            tokens = tokenizer(prompt)["input_ids"] + result.output_ids
            expected = hf_hidden_states(tiny_model_dir, tokens[:-1])
            assert result.hidden_layer_ids == LAYERS and result.hidden_states.dtype == "float32"
            torch.testing.assert_close(torch.tensor(result.hidden_states), expected, rtol=1e-4, atol=1e-5)
            with safe_open(result.hidden_states_file, "pt") as f:
                assert f.metadata()["num_prompt_tokens"] == str(len(tokenizer(prompt)["input_ids"]))
                assert f.get_tensor("token_ids").tolist() == tokens
                assert f.get_tensor("layer_ids").tolist() == LAYERS
                torch.testing.assert_close(f.get_tensor("hidden_states"), expected, rtol=1e-4, atol=1e-5)
        plain = grpc_generate(server.grpc_url, PROMPTS[0], max_tokens=4, num_draft_tokens=0)
        assert plain.hidden_states is None and tuple(plain.output_ids) == hf_greedy(str(tiny_model_dir),
                                                                                    PROMPTS[0], 4)
    finally:
        server.stop()
