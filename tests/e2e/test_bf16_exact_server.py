"""Exact in bfloat16: through the real server, SmolLM2 served in bf16 (the default dtype) with a
batch-invariant target gives speculative output token for token equal to its own plain output,
one request at a time and 8 at once beside other traffic (the bench prompts, first of each
category, and the e2e prompts).

Without batch invariance these runs differ (this test fails with batch_invariant "off"), so
this is the check of the server's invariant mode end to end.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from client.api.triton import grpc_generate
from client.cli.bench import load_constraints, load_prompts
from tests.e2e.test_smollm2_server import PROMPTS as E2E_PROMPTS
from tests.fixtures.servers import fixture_servers

MAX_TOKENS = 40
CONFIGS = {
    "ngram": '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}',
    "suffix": '{"method": "suffix", "num_speculative_tokens": 8}',
}


def prompts() -> list[str]:
    _, by_category = load_prompts()
    return [texts[0] for texts in by_category.values()] + E2E_PROMPTS


@pytest.fixture(scope="module")
def bf16_servers(smollm2_dir, tmp_path_factory):
    """{config name: SmolLM2 served in bf16, batch-invariant}, launched together."""
    specs = {
        f"bf16-{name}": dict(model=str(smollm2_dir), speculative_config=config, dtype="bfloat16", batch_invariant="on")
        for name, config in CONFIGS.items()
    }
    yield from fixture_servers(tmp_path_factory, specs)


@pytest.fixture(params=list(CONFIGS))
def bf16_server(request, bf16_servers):
    return bf16_servers[f"bf16-{request.param}"]


def generate(server, prompt: str, num_draft_tokens: int | None) -> list[int]:
    fixed = {} if num_draft_tokens is None else {"num_draft_tokens": num_draft_tokens}
    return list(grpc_generate(server.grpc_url, prompt, max_tokens=MAX_TOKENS, **fixed).output_ids)


def test_speculative_equals_plain_alone_and_in_batches_of_8(bf16_server):
    assert "batch-invariant on" in (bf16_server.log_path.read_text())
    texts = prompts()
    plain = [generate(bf16_server, p, 0) for p in texts]
    alone = [generate(bf16_server, p, None) for p in texts]
    assert alone == plain
    # 8 streams at once: each prompt twice, speculative and plain interleaved, so every
    # verification step shares its forward with other sequences of other lengths
    jobs = [(p, k) for p in texts for k in (None, 0)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda job: generate(bf16_server, *job), jobs))
    assert together == [plain[i] for i in range(len(texts)) for _ in (None, 0)]


def test_constrained_speculative_equals_constrained_plain(bf16_server):
    """The json prompt set under its schemas (structured outputs): with the method's drafts and
    the forced tokens (SmolLM2 splits a forced `":"` both ways, so forced drafts alone go as a
    tree of both splits), forced tokens alone, and plain without forced drafts (as the peers
    decode constrained): the same tokens, in bf16."""
    _, by_category = load_prompts(prompt_set="json")
    schemas = load_constraints(by_category, "json")["json"]
    for prompt, fields in list(zip(by_category["json"], schemas))[:4]:
        runs = {}
        for name, k, forced in (("plain", 0, False), ("forced", 0, True), ("speculative", None, True)):
            sampling = {"structured_outputs": fields, "forced_drafts": forced}
            fixed = {} if k is None else {"num_draft_tokens": k}
            runs[name] = grpc_generate(
                bf16_server.grpc_url, prompt, max_tokens=MAX_TOKENS, sampling_parameters=sampling, **fixed
            )
        assert runs["speculative"].output_ids == runs["forced"].output_ids == runs["plain"].output_ids
        assert runs["plain"].total_draft_tokens == 0 and runs["forced"].total_accepted_draft_tokens > 0
