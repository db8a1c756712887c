"""The model-free drafters (`ngram_gpu`, `suffix`) through a real tritonserver on the tiny model:
greedy output is the target's own (also under a grammar), and drafts get accepted. `suffix` drafts in the
orchestrator's process (drafter_in_process), and also in the drafter model when that is off."""

from __future__ import annotations

import pytest

from client.api.triton import grpc_generate
from tests.fixtures.helpers import hf_greedy, metric_values, served_greedy_results
from tests.fixtures.servers import fixture_servers
from tests.fixtures.structured import check_served_constrained

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):\n    return a + b\ndef add(a, b):",
    "for i in range(10):\n    print(i, i * i)\nfor i in",
    "a b c a b c a b c a b c",
]
REPETITIVE = PROMPTS[1]
SUFFIX = '{"method": "suffix", "num_speculative_tokens": 4}'
CONFIGS = {
    "ngram_gpu": '{"method": "ngram_gpu", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}',
    "suffix": SUFFIX,
    "suffix-in-drafter-model": SUFFIX,
}
# suffix_decoding_use_tree_spec: drafts trees
SUFFIX_TREE = '{"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_use_tree_spec": true}'
PER_MODEL = {"suffix-in-drafter-model": {"speculative": {"drafter_in_process": "false"}}}


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    """{method: server}, one real server per method for the whole module, and the suffix
    tree's ("suffix-tree"), launched together."""
    specs = {
        method: dict(model=str(tiny_model_dir), speculative_config=config, per_model=PER_MODEL.get(method))
        for method, config in sorted(CONFIGS.items())
    }
    specs["suffix-tree"] = dict(model=str(tiny_model_dir), speculative_config=SUFFIX_TREE)
    yield from fixture_servers(tmp_path_factory, specs)


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_greedy_output_equals_target_greedy(servers, tiny_model_dir, method):
    served_greedy_results(servers[method], tiny_model_dir, PROMPTS, 40)


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_drafts_are_accepted_on_a_repetitive_prompt(servers, method):
    # A fixed k: with the adaptive length, a request starts from what the server's earlier
    # requests measured, and on this tiny target a drafter hop can cost more than a step
    # saves, so the request may rightly start paused.
    result = grpc_generate(servers[method].grpc_url, REPETITIVE, max_tokens=40, num_draft_tokens=4)
    assert 0 < result.total_accepted_draft_tokens <= result.total_draft_tokens


@pytest.mark.parametrize("method", ["ngram_gpu", "suffix", "suffix-tree"])
def test_constrained_greedy_equals_target_constrained_greedy(servers, tiny_model_dir, method):
    check_served_constrained(servers[method], tiny_model_dir)


def test_suffix_global_tree_helps_a_repeated_request(servers, tiny_model_dir):
    server = servers["suffix"]
    prompt = "Speculative decoding drafts tokens cheaply and"  # not sent to this server before
    # a fixed k: the adaptive length follows step timings, which a busy machine skews (seen: both
    # requests drafting so little that each had 1 accepted token)
    first = grpc_generate(server.grpc_url, prompt, max_tokens=40, num_draft_tokens=4)
    second = grpc_generate(server.grpc_url, prompt, max_tokens=40, num_draft_tokens=4)
    assert first.output_ids == second.output_ids == list(hf_greedy(str(tiny_model_dir), prompt, 40))
    assert second.total_accepted_draft_tokens > first.total_accepted_draft_tokens
    assert second.perf_metrics["mean_acceptance_length"] > first.perf_metrics["mean_acceptance_length"]
    print(
        "suffix, same prompt twice: accepted",
        first.total_accepted_draft_tokens,
        "then",
        second.total_accepted_draft_tokens,
    )


def test_suffix_tree_spec_output_equals_target_greedy(servers, tiny_model_dir):
    """suffix_decoding_use_tree_spec: the drafter sends trees (draft_parents) through the BLS
    hops and the verifier accepts any branch of them; the output is still the target's."""
    results = served_greedy_results(servers["suffix-tree"], tiny_model_dir, PROMPTS, 40)
    assert sum(r.total_accepted_draft_tokens for r in results) > 0


@pytest.mark.parametrize(
    ("method", "in_process"), [("suffix", True), ("suffix-in-drafter-model", False), ("ngram_gpu", False)]
)
def test_model_free_drafters_draft_in_the_orchestrator_unless_told_not_to(servers, method, in_process):
    """In process, a step makes no call to the drafter model (one BLS round trip instead of two)."""
    server = servers[method]

    def drafter_calls() -> float:
        return metric_values(server, "nv_inference_count").get('model="drafter",version="1"', 0.0)

    before = drafter_calls()
    result = grpc_generate(server.grpc_url, REPETITIVE, max_tokens=24, num_draft_tokens=4)
    assert result.total_draft_tokens > 0
    assert (drafter_calls() == before) is in_process
    assert ("drafts in this process" in server.log_tail(100_000)) is in_process
