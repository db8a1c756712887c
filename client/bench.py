"""`tritonspec bench`: plain vs speculative decoding through a real server, batch 1.

Runs are interleaved (plain, speculative, plain, ...) and medians reported, since this
kind of machine is noisy. Time per request is split into drafting, the verifier's forward
passes and everything else (BLS hops, accept/reject, detokenization, streaming): the
orchestration overhead.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from tqdm import tqdm

from client.api import grpc_generate

PROMPT_SET_VERSION = "spine-1"
PROMPTS = {
    "repetitive": (
        "Repeat the following list exactly three times.\n"
        "List: apple, banana, cherry, date, elderberry, fig, grape.\n"
        "1. apple, banana, cherry, date, elderberry, fig, grape.\n2."
    ),
    "free-form": "Write a short story about a robot who learns to paint.",
}


def run_bench(grpc_url: str, max_tokens: int = 128, repeats: int = 3,
              modes: dict[str, int | None] | None = None) -> dict:
    """{prompt: {mode: summary}}; a mode maps to num_draft_tokens (None = configured k)."""
    modes = modes or {"plain": 0, "speculative": None}
    grpc_generate(grpc_url, "warm up", max_tokens=8)
    runs: dict[str, dict[str, list]] = {p: {m: [] for m in modes} for p in PROMPTS}
    jobs = [(p, m) for _ in range(repeats) for p in PROMPTS for m in modes]
    for prompt, mode in tqdm(jobs, desc="bench", unit="request"):
        extra = {} if modes[mode] is None else {"num_draft_tokens": modes[mode]}
        runs[prompt][mode].append(grpc_generate(grpc_url, PROMPTS[prompt], max_tokens=max_tokens,
                                                ignore_eos=True, **extra))
    report = {"prompt_set": PROMPT_SET_VERSION, "max_tokens": max_tokens, "repeats": repeats, "results": {}}
    for prompt, by_mode in runs.items():
        report["results"][prompt] = {mode: _summary(results) for mode, results in by_mode.items()}
        plain = report["results"][prompt].get("plain")
        for summary in report["results"][prompt].values():
            if plain:
                summary["speedup_vs_plain"] = summary["tokens_per_s"] / plain["tokens_per_s"]
    return report


def _summary(results: list) -> dict:
    def med(key: str) -> float:
        return statistics.median(r.perf_metrics[key] or 0.0 for r in results)

    steps = med("num_steps")
    return {
        "tokens_per_s": statistics.median(r.tokens_per_second for r in results),
        "mean_acceptance_length": med("mean_acceptance_length") or 1.0,
        "tokens_per_step": med("tokens_per_step"),
        "acceptance_rate": med("acceptance_rate"),
        "accepted_per_position": results[0].perf_metrics["accepted_per_position"],
        "steps": steps,
        "draft_ms_per_step": med("draft_ms") / steps,
        "verify_ms_per_step": med("verify_ms") / steps,
        "overhead_ms_per_step": med("overhead_ms") / steps,
        "overhead_share": med("overhead_ms") / med("total_ms"),
    }


def format_report(report: dict) -> str:
    lines = [f"prompt set {report['prompt_set']}, {report['max_tokens']} tokens, median of {report['repeats']}",
             f"{'prompt':12} {'mode':12} {'tok/s':>7} {'speedup':>8} {'MAL':>5} {'accept':>7} "
             f"{'draft':>7} {'verify':>7} {'overhead':>9} {'share':>6}  (ms per step)"]
    for prompt, by_mode in report["results"].items():
        for mode, s in by_mode.items():
            lines.append(
                f"{prompt:12} {mode:12} {s['tokens_per_s']:7.1f} {s.get('speedup_vs_plain', 1):7.2f}x "
                f"{s['mean_acceptance_length']:5.2f} {s['acceptance_rate']:7.2f} {s['draft_ms_per_step']:7.2f} "
                f"{s['verify_ms_per_step']:7.2f} {s['overhead_ms_per_step']:9.2f} {s['overhead_share']:6.1%}"
            )
    return "\n".join(lines)


def save_report(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=2))
