"""Shared by the tests: the target's own greedy output, server state probes, the target's
hidden states as the verifier delivers them to a drafter, and ragged batches of drafts."""
from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
import urllib.request
from functools import lru_cache

import torch

from backends.serving.proposer import DraftRequest
from backends.serving.target import VerifyRequest


@lru_cache(maxsize=None)
def _load(model_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@lru_cache(maxsize=None)
def hf_greedy(model_dir: str, prompt: str, max_tokens: int) -> tuple[int, ...]:
    """Hugging Face `generate` (greedy, float32): the ids the server must reproduce."""
    model, tokenizer = _load(model_dir)
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, top_k=None, top_p=None)
    return tuple(out[0, ids.shape[1]:].tolist())


def served_greedy_results(server, model_dir, prompts, max_tokens: int, num_draft_tokens: int | None = None) -> list:
    """Generate each prompt through the server and assert its ids are exactly the target's
    own greedy ids; the results, for the caller's acceptance checks (a fixed
    `num_draft_tokens` makes those independent of the adaptive policy's step timings)."""
    from client.api.triton import grpc_generate

    fixed = {} if num_draft_tokens is None else {"num_draft_tokens": num_draft_tokens}
    results = []
    for prompt in prompts:
        result = grpc_generate(server.grpc_url, prompt, max_tokens=max_tokens, **fixed)
        assert tuple(result.output_ids) == hf_greedy(str(model_dir), prompt, max_tokens), prompt
        results.append(result)
    return results


def metrics_text(server) -> str:
    with urllib.request.urlopen(f"http://{server.host}:{server.metrics_port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric_values(server, name: str) -> dict[str, float]:
    """{label text: value} for one metric family on /metrics."""
    return {m.group(1): float(m.group(2))
            for m in re.finditer(re.escape(name) + r'\{([^}]*)\} (\S+)', metrics_text(server))}


def active_sequences(server) -> dict[str, float]:
    return server.active_sequences()


def wait_for_no_active_sequences(server, timeout_s: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        active = active_sequences(server)
        if not any(active.values()) or time.monotonic() > deadline:
            return active
        time.sleep(0.2)


def coarse_total_variation(samples: list[int], exact: dict[int, float], top: int = 3) -> float:
    """Total variation between the sample frequencies and `exact` over the `top` most likely
    tokens plus one cell for everything else. Few cells keep sampling noise small (600
    samples: p99.99 below 0.09), while a sampler that skips recovery or ignores q is off by
    0.2 or more."""
    keep = sorted(exact, key=exact.get, reverse=True)[:top]
    cells = {t: exact[t] for t in keep}
    cells[-1] = 1.0 - sum(cells.values())
    counts = {t: 0 for t in cells}
    for token in samples:
        counts[token if token in cells else -1] += 1
    return 0.5 * sum(abs(counts[t] / len(samples) - p) for t, p in cells.items())


def target_hidden(runner, ids: list[int], layer_ids: tuple[int, ...]) -> torch.Tensor:
    """The target's hidden states [len(ids), layers, H] at every position of `ids`."""
    result = runner.verify(VerifyRequest(31337, ids, [], hidden_layer_ids=layer_ids))
    runner.release(31337)
    return result.hidden_states


def request(runner, head, seq_id: int, context: list[int], k: int, delivered: int = 0) -> DraftRequest:
    """A draft request for `context` carrying the hidden states of positions delivered..n-2."""
    return DraftRequest(seq_id, context, k, target_hidden(runner, context[:-1], head.hidden_layer_ids)[delivered:])


def check_ragged_batches(batched, alone, prompts: list[list[int]], make_request: Callable[..., DraftRequest],
                         steps: int, first_k: int, vocab_size: int) -> dict[int, list[int]]:
    """Fresh, running and rolled-back sequences with ragged lengths and draft counts in one
    batch, for `steps` rounds: sequences 0 and 1 start from prompts[0] and [1], sequence 2
    joins at step 1 from prompts[2]; each asks for first_k + (seq + step) % 3 tokens, a random
    number of them is accepted and a random token follows. Every draft of `batched` must be
    what `alone` drafts for the request alone. make_request(seq, ids, k, delivered) builds a
    request whose hidden rows start at position `delivered`. Returns the final contexts."""
    contexts, delivered = {0: prompts[0], 1: prompts[1]}, {0: 0, 1: 0}
    rng = random.Random(0)
    for step in range(steps):
        if step == 1:
            contexts[2], delivered[2] = prompts[2], 0  # a fresh sequence joins running ones
        requests = [make_request(seq, ids, first_k + (seq + step) % 3, delivered[seq]) for seq, ids in contexts.items()]
        for req, draft in zip(requests, batched.propose(requests)):
            assert draft.token_ids == alone.propose([req])[0].token_ids
            assert len(draft.token_ids) == req.num_tokens
            accepted = rng.randrange(req.num_tokens + 1)
            delivered[req.seq_id] = len(req.token_ids) - 1
            contexts[req.seq_id] = req.token_ids + draft.token_ids[:accepted] + [rng.randrange(1, vocab_size)]
    return contexts


def assert_same_caches(alone, batched, seqs, atol: float) -> None:
    """Each sequence's tokens and KV cache (keys and values) in `batched` are those in `alone`."""
    for seq in seqs:
        a, b = alone._seqs[seq], batched._seqs[seq]
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.cache.layers, b.cache.layers):
            torch.testing.assert_close(la.keys, lb.keys, rtol=1e-4, atol=atol)
            torch.testing.assert_close(la.values, lb.values, rtol=1e-4, atol=atol)
