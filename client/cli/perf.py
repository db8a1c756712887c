"""`tritonspec perf`: a concurrency sweep with perf_analyzer over gRPC streaming, plain vs
speculative decoding, against a real server.

For every (mode, concurrency) perf_analyzer exports each request's send time and response
times; from them: output tokens/s, time to first token, inter-token latency (a response
that carries n tokens counts its gap n times, each gap / n, so multi-token speculative
steps are weighed per token) and request latency, each at p50 and p99.

perf_analyzer runs a fixed number of requests (`--request-count`), so it never gives up on
a noisy machine for want of stable windows; the requests are split here into consecutive
windows instead, and each run reports the spread of tokens/s across them ("unstable" when
it is above perf_analyzer's default 10%) next to the figures of the whole run.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from tqdm import tqdm

from client.cli.bench import load_prompts
from client.cli.perf_analyzer import run as run_perf_analyzer

MODES = {"plain": 0, "speculative": None}  # mode -> num_draft_tokens (None = configured)
WINDOWS = 3
STABLE_SPREAD = 0.10  # perf_analyzer's default --stability-percentage


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def _num_tokens(output: dict) -> int:
    ids = output.get("output_ids", [])
    return 1 if isinstance(ids, int) else len(ids)


def window_spread(requests: list[dict], windows: int = WINDOWS) -> tuple[list[float], float]:
    """Output tokens/s of consecutive windows of requests (by send time) and their spread,
    (max - min) / median."""
    ordered = sorted((r for r in requests if r["response_timestamps"]), key=lambda r: r["timestamp"])
    size = len(ordered) // windows
    if size == 0:
        return [], 0.0
    rates = []
    for i in range(windows):
        part = ordered[i * size : (i + 1) * size]
        tokens = sum(_num_tokens(o) for r in part for o in r.get("response_outputs", []))
        seconds = (max(r["response_timestamps"][-1] for r in part) - min(r["timestamp"] for r in part)) / 1e9
        rates.append(tokens / seconds if seconds else 0.0)
    median = statistics.median(rates)
    return rates, (max(rates) - min(rates)) / median if median else 0.0


def summarize_export(export: dict) -> dict:
    """Latency and throughput figures from one perf_analyzer profile export, with the
    tokens/s of its windows and their spread."""
    requests = export["experiments"][0]["requests"]
    ttft, itl, latency, tokens = [], [], [], 0
    start = min(r["timestamp"] for r in requests)
    end = max(r["response_timestamps"][-1] for r in requests if r["response_timestamps"])
    for r in requests:
        stamps = r["response_timestamps"]
        counts = [_num_tokens(o) for o in r.get("response_outputs", [])]
        if not stamps:
            continue
        ttft.append((stamps[0] - r["timestamp"]) / 1e6)
        latency.append((stamps[-1] - r["timestamp"]) / 1e6)
        tokens += sum(counts)
        for previous, now, n in zip(stamps, stamps[1:], counts[1:]):
            if n:
                itl += [(now - previous) / 1e6 / n] * n
    seconds = (end - start) / 1e9
    windows, spread = window_spread(requests)
    return {
        "requests": len(requests),
        "output_tokens_per_s": tokens / seconds if seconds else 0.0,
        "window_tokens_per_s": windows,
        "spread": spread,
        "stable": spread <= STABLE_SPREAD,
        "ttft_ms_p50": _percentile(ttft, 50),
        "ttft_ms_p99": _percentile(ttft, 99),
        "itl_ms_p50": _percentile(itl, 50),
        "itl_ms_p99": _percentile(itl, 99),
        "latency_ms_p50": _percentile(latency, 50),
        "latency_ms_p99": _percentile(latency, 99),
    }


def run_sweep(
    grpc_url: str,
    out_dir: Path,
    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16),
    max_tokens: int = 64,
    requests_per_window: int = 16,
) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"max_tokens": max_tokens, "concurrency": list(concurrencies), "modes": {}}
    jobs = [(mode, c) for mode in MODES for c in concurrencies]
    for mode, concurrency in tqdm(jobs, desc="perf sweep", unit="run"):
        data = out_dir / f"input_{mode}.json"
        rows = []
        for prompt in (p for category in load_prompts()[1].values() for p in category):
            row = {"text_input": [prompt], "max_tokens": [max_tokens], "stream": [True], "ignore_eos": [True]}
            if MODES[mode] is not None:
                row["num_draft_tokens"] = [MODES[mode]]
            rows.append(row)
        data.write_text(json.dumps({"data": rows}))
        export = out_dir / f"profile_{mode}_c{concurrency}.json"
        export.unlink(missing_ok=True)  # perf_analyzer refuses to overwrite
        requests_per_window = max(requests_per_window, 2 * concurrency)
        done = run_perf_analyzer(
            [
                "-m",
                "speculative",
                "-u",
                grpc_url,
                "-i",
                "grpc",
                "--streaming",
                "--input-data",
                str(data),
                "--concurrency-range",
                str(concurrency),
                # A fixed number of requests: one measurement, no stability to wait for (a noisy
                # machine would fail it); the windows are cut from the export afterwards.
                "--request-count",
                str(WINDOWS * requests_per_window),
                "--profile-export-file",
                str(export),
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"perf_analyzer failed ({mode}, c={concurrency}):\n{done.stdout}\n{done.stderr}")
        summary = summarize_export(json.loads(export.read_text()))
        results["modes"].setdefault(mode, {})[str(concurrency)] = summary
    return results


def format_sweep(results: dict) -> str:
    lines = [
        f"{'mode':12} {'conc':>4} {'tok/s':>8} {'spread':>8} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} "
        f"{'p99':>7} {'lat p50':>8} {'p99':>8}   (ms)"
    ]
    unstable = []
    for mode, by_c in results["modes"].items():
        for c, s in by_c.items():
            mark = "" if s.get("stable", True) else "*"
            if mark:
                unstable.append(f"{mode} c={c}: windows " + ", ".join(f"{r:.1f}" for r in s["window_tokens_per_s"]))
            lines.append(
                f"{mode:12} {c:>4} {s['output_tokens_per_s']:8.1f} {s.get('spread', 0):7.0%}{mark:1} "
                f"{s['ttft_ms_p50']:9.1f} {s['ttft_ms_p99']:7.1f} {s['itl_ms_p50']:8.2f} "
                f"{s['itl_ms_p99']:7.2f} {s['latency_ms_p50']:8.0f} {s['latency_ms_p99']:8.0f}"
            )
    if unstable:
        lines.append(
            f"* unstable: tokens/s of its {WINDOWS} windows differ by more than {STABLE_SPREAD:.0%} "
            "(a busy machine); the row is the whole run"
        )
        lines += [f"  {line}" for line in unstable]
    return "\n".join(lines)


def plot_sweep(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (
        ("output_tokens_per_s", "output tokens/s"),
        ("itl_ms_p50", "inter-token latency p50 (ms)"),
        ("ttft_ms_p50", "time to first token p50 (ms)"),
    )
    for ax, (key, label) in zip(axes, panels):
        for mode, by_c in results["modes"].items():
            cs = [int(c) for c in by_c]
            ax.plot(cs, [by_c[str(c)][key] for c in cs], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speedup_table(results: dict) -> dict[str, float]:
    plain, spec = results["modes"]["plain"], results["modes"]["speculative"]
    return {
        c: spec[c]["output_tokens_per_s"] / plain[c]["output_tokens_per_s"]
        for c in plain
        if plain[c]["output_tokens_per_s"]
    }


def median_itl(results: dict, mode: str) -> float:
    return statistics.median(s["itl_ms_p50"] for s in results["modes"][mode].values())
