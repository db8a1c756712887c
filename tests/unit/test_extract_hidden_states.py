"""extract_hidden_states: plain decoding that returns the target's hidden states of the
configured layers; they must equal a plain Hugging Face forward over prompt + output (all
but the last token, which never goes through the target), in process (through the real
server: tests/e2e/test_extract_hidden_states_server.py)."""

from __future__ import annotations

import random

import pytest
import torch

from backends.config import SpeculativeConfig
from backends.methods.extract_hidden_states import ExtractHiddenStatesProposer
from backends.runtime.model_store import load_tokenizer
from backends.serving.detokenize import TextStream
from backends.serving.drafting import DraftService
from backends.serving.local import LocalVerifier
from backends.serving.orchestrator import Generation, ServingContext, generate
from backends.serving.proposer import build_proposer, describe_drafter
from backends.serving.request import GenerationRequest
from backends.serving.target import TargetRunner
from tests.fixtures.helpers import EXTRACT_LAYERS, EXTRACT_SPEC, hf_greedy, hf_hidden_states

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The"]


def test_config_and_proposer(tiny_model_dir):
    config = SpeculativeConfig.from_json(EXTRACT_SPEC, target_model=str(tiny_model_dir))
    proposer = build_proposer(config, max_model_len=512, target_model=tiny_model_dir)
    assert isinstance(proposer, ExtractHiddenStatesProposer) and proposer.hidden_layer_ids == tuple(EXTRACT_LAYERS)
    assert DraftService(proposer, config).num_speculative_tokens == 0  # it never drafts
    with pytest.raises(
        ValueError,
        match=r"eagle_aux_hidden_state_layer_ids \[0, 3\] must be distinct layer ids "
        r"in \[0, 2\]",
    ):
        build_proposer(
            SpeculativeConfig.from_json(
                {**EXTRACT_SPEC, "eagle_aux_hidden_state_layer_ids": [0, 3]}, target_model=str(tiny_model_dir)
            ),
            max_model_len=512,
            target_model=tiny_model_dir,
        )


def test_in_process_hidden_states_equal_a_plain_forward(tiny_model_dir):
    runner, tokenizer = TargetRunner(tiny_model_dir, dtype="float32"), load_tokenizer(tiny_model_dir)
    config = SpeculativeConfig.from_json(EXTRACT_SPEC, target_model=str(tiny_model_dir))
    service = DraftService(build_proposer(config, max_model_len=512, target_model=tiny_model_dir), config)
    info = describe_drafter(config, tiny_model_dir)  # what the orchestrator learns at load
    assert not info.proposes_drafts and info.hidden_layer_ids == service.proposer.hidden_layer_ids
    for prompt in PROMPTS:
        prompt_ids = tokenizer(prompt)["input_ids"]
        seq_id, out, parts = random.getrandbits(32), [], []
        # Extraction is a verifier option: no drafter is called.
        ctx = ServingContext({0}, runner.max_model_len, extract_layer_ids=info.hidden_layer_ids)
        req = GenerationRequest(prompt=prompt, max_tokens=12)
        gen = Generation(req, prompt_ids, seq_id, LocalVerifier(runner), None, TextStream(tokenizer), ctx)
        for step in generate(gen):
            out += step.token_ids
            parts.append(step.hidden_states)
        runner.release(seq_id)
        stats = gen.stats
        assert tuple(out) == hf_greedy(str(tiny_model_dir), prompt, 12)
        assert stats.acceptance.num_draft_tokens == 0 and stats.num_steps == len(out)
        hidden, tokens = torch.cat(parts), prompt_ids + out
        assert hidden.shape == (len(tokens) - 1, len(EXTRACT_LAYERS), 64)
        torch.testing.assert_close(
            hidden, hf_hidden_states(tiny_model_dir, tokens[:-1], EXTRACT_LAYERS), rtol=1e-4, atol=1e-5
        )
