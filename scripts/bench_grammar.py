"""Grammar backends for structured outputs, measured on SmolLM2-135M's tokenizer (49152 tokens):
compile time of a tool-call JSON schema (cold: a new compiler; warm: the cache), and the cost
per output token of a mask (fill the bitmask from the matcher's state, apply it to one logits
row, advance by the token). llguidance always; xgrammar when it is installed (it is not a
dependency: `pip install xgrammar` to compare).

    .venv/bin/python scripts/bench_grammar.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from backends.runtime.model_store import fetch, load_tokenizer
from backends.serving.proposer import Draft
from backends.structured.grammar import GrammarCompiler
from backends.structured.mask import apply_token_mask
from backends.structured.spec import StructuredOutputs

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "search_flights", "send_email"]},
        "arguments": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "include_hourly": {"type": "boolean"},
            },
            "required": ["location", "unit", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
OUTPUT = '{"name":"get_weather","arguments":{"location":"Paris, France","unit":"celsius","days":3}}'


def ms(seconds: list[float]) -> str:
    return (
        f"median {statistics.median(seconds) * 1e3:.3f} ms (min {min(seconds) * 1e3:.3f}, max {max(seconds) * 1e3:.3f})"
    )


def bench_llguidance(tokenizer, vocab: int, eos: set[int], token_ids: list[int], repeats: int) -> dict:
    spec = StructuredOutputs("json", json.dumps(TOOL_SCHEMA))  # properties in the order given
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab, eos)
    tokenizer_s = time.perf_counter() - start
    cold, warm, per_token = [], [], []
    for _ in range(repeats):
        compiler._cache.clear()
        start = time.perf_counter()
        matcher = compiler.matcher(spec)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        matcher = compiler.matcher(spec)
        warm.append(time.perf_counter() - start)
        logits = torch.randn(1, vocab)
        start = time.perf_counter()
        for token in token_ids:
            masked = apply_token_mask(logits, matcher.masks(Draft()))
            assert masked[0, token] > float("-inf"), token
            matcher.advance([token])
        per_token.append((time.perf_counter() - start) / len(token_ids))
    return {"tokenizer": [tokenizer_s], "compile cold": cold, "compile warm": warm, "per token": per_token}


def bench_xgrammar(tokenizer, vocab: int, token_ids: list[int], repeats: int) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    schema = json.dumps(TOOL_SCHEMA)
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    tokenizer_s = time.perf_counter() - start
    cold, warm, per_token = [], [], []
    for _ in range(repeats):
        compiler = xgr.GrammarCompiler(info, max_threads=1)
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        matcher = xgr.GrammarMatcher(compiled)
        warm.append(time.perf_counter() - start)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        logits = torch.randn(1, vocab)
        start = time.perf_counter()
        for token in token_ids:
            matcher.fill_next_token_bitmask(bitmask, 0)
            masked = logits.clone()
            xgr.apply_token_bitmask_inplace(masked, bitmask)
            assert masked[0, token] > float("-inf"), token
            assert matcher.accept_token(token), token
        per_token.append((time.perf_counter() - start) / len(token_ids))
    return {"tokenizer": [tokenizer_s], "compile cold": cold, "compile warm": warm, "per token": per_token}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(fetch("smollm2-135m"))
    vocab = len(tokenizer)
    token_ids = tokenizer(OUTPUT, add_special_tokens=False)["input_ids"]
    eos = {tokenizer.eos_token_id}
    print(f"tokenizer: {vocab} tokens; output: {len(token_ids)} tokens; torch threads 1")
    for name, bench in (
        ("llguidance", lambda: bench_llguidance(tokenizer, vocab, eos, token_ids, args.repeats)),
        ("xgrammar", lambda: bench_xgrammar(tokenizer, vocab, token_ids, args.repeats)),
    ):
        figures = bench()
        if figures is None:
            print(f"{name}: not installed")
            continue
        for what, seconds in figures.items():
            print(f"{name:10s} {what:13s} {ms(seconds)}", flush=True)


if __name__ == "__main__":
    main()
