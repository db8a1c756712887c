"""Shared by the server tests: the target's own greedy output, and server state probes."""
from __future__ import annotations

import re
import time
import urllib.request
from functools import lru_cache

import torch


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


def served_greedy_results(server, model_dir, prompts, max_tokens: int) -> list:
    """Generate each prompt through the server and assert its ids are exactly the target's
    own greedy ids; the results, for the caller's acceptance checks."""
    from client.api import grpc_generate

    results = []
    for prompt in prompts:
        result = grpc_generate(server.grpc_url, prompt, max_tokens=max_tokens)
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
