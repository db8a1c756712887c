"""Structured outputs in process on SmolLM2-135M: what a grammar costs per token, and what the
tokens it forces buy as free drafts. Modes, interleaved over the repeats:

  free         unconstrained plain decoding, as many tokens as the constrained output
  masked       constrained plain decoding, forced tokens not drafted (the peers' way)
  forced       constrained plain decoding, forced tokens as drafts (no drafter)
  ngram/suffix constrained speculative decoding with forced tokens after the drafter's

    .venv/bin/python scripts/bench_structured.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from backends.config import SpeculativeConfig
from backends.runtime.model_store import fetch, load_tokenizer
from backends.serving.drafting import DraftService
from backends.serving.local import generate_local
from backends.serving.proposer import build_proposer
from backends.serving.target import TargetRunner
from backends.structured.grammar import GrammarCompiler
from backends.structured.spec import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "enum": ["France", "Germany", "Japan", "United States", "Brazil"]},
        "subscribed": {"type": "boolean"},
        "interests": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "email", "age", "city", "country", "subscribed", "interests"],
    "additionalProperties": False,
}
TEXT = (
    "Hi, I'm Marie Dupont, 34, from Lyon in France. Reach me at marie.dupont@example.com. "
    "I'd like the newsletter; I love hiking, jazz and cooking."
)
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}


def prompt(tokenizer) -> str:
    message = (
        f"Extract the customer record from this message as JSON with the keys {list(SCHEMA['properties'])}.\n\n{TEXT}"
    )
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )


def run(mode: str, text: str, tokenizer, runner, grammars: GrammarCompiler, max_tokens: int) -> dict:
    spec = StructuredOutputs("json", json.dumps(SCHEMA))  # properties in the order given
    service = None
    if mode in SPECS:
        config = SpeculativeConfig.from_json(SPECS[mode])
        service = DraftService(build_proposer(config, max_model_len=runner.max_model_len), config)
    constraint = {} if mode == "free" else {"grammars": grammars, "structured": spec, "forced_drafts": mode != "masked"}
    start = time.perf_counter()
    ids, stats = generate_local(
        text, tokenizer, runner, service, max_tokens=max_tokens, ignore_eos=mode == "free", **constraint
    )
    seconds = time.perf_counter() - start
    return {"tokens": len(ids), "s": seconds, "grammar_s": stats.grammar_s, "steps": stats.num_steps, "ids": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = fetch("smollm2-135m")
    tokenizer, runner = load_tokenizer(path), TargetRunner(path, dtype="bfloat16")
    eos = {2}
    grammars = GrammarCompiler(tokenizer, runner.logits_size, eos)
    text = prompt(tokenizer)
    length = run("masked", text, tokenizer, runner, grammars, 200)["tokens"]  # warm-up; the free runs match it
    results: dict[str, list[dict]] = {m: [] for m in ("free", "masked", "forced", *SPECS)}
    for _ in range(args.repeats):
        for mode in results:
            results[mode].append(run(mode, text, tokenizer, runner, grammars, length if mode == "free" else 200))
    print(
        f"SmolLM2-135M bf16, {args.threads} threads, {length} output tokens; ms/token median (min-max) over {args.repeats}"
    )
    masked = statistics.median(r["s"] / r["tokens"] for r in results["masked"])
    for mode, runs in results.items():
        per_token = [r["s"] / r["tokens"] * 1e3 for r in runs]
        grammar = statistics.median(r["grammar_s"] / r["tokens"] * 1e3 for r in runs)
        steps = statistics.median(r["tokens"] / r["steps"] for r in runs)
        print(
            f"{mode:7s} {statistics.median(per_token):6.2f} ({min(per_token):.2f}-{max(per_token):.2f}) ms/token, "
            f"grammar {grammar:.3f} ms/token, {steps:.2f} tokens/step, "
            f"{masked * 1e3 / statistics.median(per_token):.2f}x masked"
        )
    same = {mode: runs[0]["ids"] == results["masked"][0]["ids"] for mode, runs in results.items() if mode != "free"}
    print("same output as masked plain:", same)
    print("output:", tokenizer.decode(results["forced"][0]["ids"]))


if __name__ == "__main__":
    main()
