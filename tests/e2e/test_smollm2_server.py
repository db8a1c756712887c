"""The embedded default model, SmolLM2-135M-Instruct (fetched once from PyPI, SHA-256
checked), served in float32: ngram speculation reproduces its own greedy output."""

from __future__ import annotations

import pytest

from client.api.triton import http_generate
from tests.fixtures.helpers import hf_greedy, served_greedy_results
from tests.fixtures.servers import fixture_server

PROMPTS = [
    "Repeat the list exactly.\nList: apple, banana, cherry, date, elderberry, fig.\n"
    "Again: apple, banana, cherry, date, elderberry, fig.\nAgain:",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def factorial(n):\n",
    "<|im_start|>user\nWrite one sentence about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def smollm2_server(smollm2_dir, tmp_path_factory):
    config = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
    yield from fixture_server(tmp_path_factory, "smollm2", smollm2_dir, config)


def test_ngram_greedy_equals_target_greedy(smollm2_server, smollm2_dir):
    results = served_greedy_results(smollm2_server, smollm2_dir, PROMPTS, 40)
    assert sum(r.total_accepted_draft_tokens for r in results) > 0


def test_plain_and_http_paths_agree(smollm2_server, smollm2_dir):
    prompt = PROMPTS[0]
    expected = hf_greedy(str(smollm2_dir), prompt, 24)
    plain = http_generate(smollm2_server.http_url, prompt, max_tokens=24, num_draft_tokens=0)
    assert tuple(plain.output_ids) == expected and plain.total_draft_tokens == 0
