"""`tritonspec perf`: a concurrency sweep with perf_analyzer over gRPC streaming, plain vs
speculative decoding, against a real server.

For every (mode, concurrency) perf_analyzer exports each request's send time and response
times; from them: output tokens/s, time to first token, inter-token latency (a response
that carries n tokens counts its gap n times, each gap / n, so multi-token speculative
steps are weighed per token) and request latency, each at p50 and p99.

perf_analyzer runs a fixed number of requests (`--request-count`), so it never gives up on
a noisy machine for want of stable windows. Throughput is measured while all `concurrency`
streams run: from the first request's send to the last one's (perf_analyzer starts a request
as soon as one ends). After the last send the run drains with fewer and fewer streams, and the
drain is longer for a mode whose requests vary more in length (speculation's do), so the whole
run's figure, drain included, is reported beside it but not compared. That span is cut into
consecutive windows, and each run reports the spread of tokens/s across them ("unstable" when
it is above perf_analyzer's default 10%).
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


def _token_times(requests: list[dict]) -> list[tuple[int, int]]:
    """(response time in ns, output tokens it carries) for every response of the run."""
    return [
        (stamp, _num_tokens(output))
        for r in requests
        for stamp, output in zip(r["response_timestamps"], r.get("response_outputs", []))
    ]


def _rate(token_times: list[tuple[int, int]], start: int, end: int) -> float:
    """Output tokens/s of the responses received in [start, end) (ns)."""
    tokens = sum(n for stamp, n in token_times if start <= stamp < end)
    return tokens / ((end - start) / 1e9) if end > start else 0.0


def window_spread(
    token_times: list[tuple[int, int]], start: int, end: int, windows: int = WINDOWS
) -> tuple[float, list[float], float]:
    """Output tokens/s over [start, end) (ns), that of `windows` equal slices of it, and their
    spread, (max - min) / median."""
    width = (end - start) / windows
    rates = [_rate(token_times, int(start + i * width), int(start + (i + 1) * width)) for i in range(windows)]
    median = statistics.median(rates)
    return _rate(token_times, start, end), rates, (max(rates) - min(rates)) / median if median else 0.0


def summarize_export(export: dict) -> dict:
    """Latency and throughput figures from one perf_analyzer profile export: tokens/s while
    every stream runs (with its windows and their spread) and over the whole run."""
    sent = export["experiments"][0]["requests"]
    requests = [r for r in sent if r["response_timestamps"]]
    ttft, itl, latency = [], [], []
    for r in requests:
        stamps = r["response_timestamps"]
        counts = [_num_tokens(o) for o in r.get("response_outputs", [])]
        ttft.append((stamps[0] - r["timestamp"]) / 1e6)
        latency.append((stamps[-1] - r["timestamp"]) / 1e6)
        for previous, now, n in zip(stamps, stamps[1:], counts[1:]):
            if n:
                itl += [(now - previous) / 1e6 / n] * n
    token_times = _token_times(requests)
    start, last_send = min(r["timestamp"] for r in requests), max(r["timestamp"] for r in requests)
    end = max(r["response_timestamps"][-1] for r in requests) + 1  # the last response included
    # Every stream runs from the first send to the last (the whole run when all went at once).
    steady, windows, spread = window_spread(token_times, start, last_send if last_send > start else end)
    return {
        "requests": len(sent),
        "output_tokens_per_s": steady,
        "run_tokens_per_s": _rate(token_times, start, end),
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
    stream_interval: int | None = None,
) -> dict:
    """`stream_interval`: each request's own (None: the server's setting)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"max_tokens": max_tokens, "concurrency": list(concurrencies), "modes": {}}
    if stream_interval is not None:
        results["stream_interval"] = stream_interval
    jobs = [(mode, c) for mode in MODES for c in concurrencies]
    for mode, concurrency in tqdm(jobs, desc="perf sweep", unit="run"):
        data = out_dir / f"input_{mode}.json"
        rows = []
        for prompt in (p for category in load_prompts()[1].values() for p in category):
            row = {"text_input": [prompt], "max_tokens": [max_tokens], "stream": [True], "ignore_eos": [True]}
            if MODES[mode] is not None:
                row["num_draft_tokens"] = [MODES[mode]]
            if stream_interval is not None:
                row["stream_interval"] = [stream_interval]
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
        f"{'mode':12} {'conc':>4} {'tok/s':>8} {'spread':>8} {'run':>8} {'TTFT p50':>9} {'p99':>7} "
        f"{'ITL p50':>8} {'p99':>7} {'lat p50':>8} {'p99':>8}   (ms)"
    ]
    unstable = []
    for mode, by_c in results["modes"].items():
        for c, s in by_c.items():
            mark = "" if s.get("stable", True) else "*"
            if mark:
                unstable.append(f"{mode} c={c}: windows " + ", ".join(f"{r:.1f}" for r in s["window_tokens_per_s"]))
            lines.append(
                f"{mode:12} {c:>4} {s['output_tokens_per_s']:8.1f} {s.get('spread', 0):7.0%}{mark:1} "
                f"{s.get('run_tokens_per_s', 0):8.1f} {s['ttft_ms_p50']:9.1f} {s['ttft_ms_p99']:7.1f} "
                f"{s['itl_ms_p50']:8.2f} {s['itl_ms_p99']:7.2f} {s['latency_ms_p50']:8.0f} {s['latency_ms_p99']:8.0f}"
            )
    lines.append("tok/s: while every stream runs (first send to last send); run: the whole run, its drain included")
    if unstable:
        lines.append(
            f"* unstable: tokens/s of its {WINDOWS} windows differ by more than {STABLE_SPREAD:.0%} (a busy machine)"
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
