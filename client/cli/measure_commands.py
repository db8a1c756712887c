"""The measuring subcommands: `tritonspec bench` (methods against plain decoding through a real
server), `soak` (many streams for a while), `verify-cost` (one batched verify step, in process)
and `perf` (a perf_analyzer concurrency sweep)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from backends.runtime import BATCH_INVARIANT_MODES
from backends.runtime.model_store import DEFAULT_MODEL, ModelNotFoundError, local_model
from backends.serving.parameters import stream_interval
from backends.training import TRAINERS
from client.cli import common

if TYPE_CHECKING:  # the launcher finds tritonserver's wheel on import: only when serving
    from client.cli.launcher import RepositoryOverrides


def add_bench_parser(sub: common.Subcommands) -> None:
    bench = sub.add_parser(
        "bench", help="speculative methods vs plain decoding (and Hugging Face) through a real server"
    )
    _add_bench_server_flags(bench)
    _add_bench_workload_flags(bench)
    bench.add_argument("--hf", action="store_true", help="also run Hugging Face greedy / assisted / prompt lookup")
    bench.add_argument(
        "--sweep",
        type=int,
        nargs="+",
        metavar="C",
        help="also a perf_analyzer concurrency sweep per method at these concurrencies",
    )
    _add_server_flags(bench, port=18800, out="bench-results")
    bench.set_defaults(func=_bench)


def _add_bench_server_flags(bench: argparse.ArgumentParser) -> None:
    """The methods, the target and drafter, and how the bench's servers run them."""
    from client.cli.bench import METHOD_CONFIGS

    bench.add_argument(
        "--methods",
        nargs="+",
        default=["ngram", "suffix"],
        choices=list(METHOD_CONFIGS),
        help="trainable head methods (eagle, eagle3, ...) use the head `tritonspec train METHOD --target MODEL` wrote; "
        "METHOD+tree drafts trees (compare it with METHOD's chains in one run)",
    )
    bench.add_argument("--model", default=DEFAULT_MODEL, help="target (named, HF directory or GGUF)")
    bench.add_argument("--draft-model", help="drafter for draft_model (named, HF directory or GGUF)")
    bench.add_argument("--profile", choices=sorted(common.PROFILES), help="target + drafter pair, e.g. qwen-coder")
    bench.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    _add_engine_flags(bench)
    bench.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="prefix caching in the bench's servers (off by default: each prompt runs plain, then "
        "speculative, and the second run would find the first one's prompt cached)",
    )
    common.add_in_process_flag(bench)
    common.add_threads_flag(bench)


def _add_bench_workload_flags(bench: argparse.ArgumentParser) -> None:
    """The prompts, how long each run is, and k."""
    bench.add_argument(
        "--prompt-set",
        choices=("short", "long", "json"),
        help="the versioned prompts: short (code, chat, rag, multi-turn; 80-340 tokens; the default), long "
        "(rag-2k, rag-8k, code-edit, chat-30: 1.9k-7.6k tokens; the servers' context window must cover them) "
        "or json (schema-constrained extraction and tool calls; the default with --structured)",
    )
    bench.add_argument(
        "--structured",
        action="store_true",
        help="constrain each output to its prompt's JSON schema (structured outputs; the json prompt set): "
        "plain runs without forced drafts (as the peers decode), speculative runs with them, and a `forced` row "
        "of plain runs with forced tokens as their only drafts; runs end where the output does",
    )
    bench.add_argument("--categories", nargs="+", help="prompt categories of the set (default: all)")
    bench.add_argument(
        "--prompt-file",
        help="your own prompts: a JSON list or {category: [prompts]} (e.g. a "
        "trained head's validation_prompts.json), or one per line in a file not named *.json",
    )
    bench.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="end each run at the model's end of answer (default: always --max-tokens tokens)",
    )
    bench.add_argument("--num-speculative-tokens", type=int, help="k for every method")
    bench.add_argument(
        "--spec-overrides",
        type=_json_object,
        default={},
        metavar="JSON",
        help="keys merged into every method's speculative config, e.g. '{\"suffix_decoding_max_tree_depth\": 64}'",
    )
    bench.add_argument(
        "--fixed-k",
        action="store_true",
        help="draft k tokens every step (requests ask for "
        "num_draft_tokens=k; no adaptive draft length): per-position acceptance at every position",
    )
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--repeats", type=int, default=1)


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The target's engine and batch invariance, as serve sets them (default auto)."""
    parser.add_argument(
        "--runtime", default="auto", choices=common.RUNTIMES, help="the target's forward engine (see serve)"
    )
    parser.add_argument(
        "--batch-invariant", default="auto", choices=BATCH_INVARIANT_MODES, help=common.BATCH_INVARIANT_HELP
    )


def _add_server_flags(parser: argparse.ArgumentParser, port: int, out: str) -> None:
    """The port of the server the command starts, and where its results go."""
    parser.add_argument("--port", type=int, default=port, help="HTTP port; gRPC and metrics follow")
    parser.add_argument("--out", default=out)


def _bench(args: argparse.Namespace) -> int:
    from client.cli.bench import compare, format_report, hf_comparison, load_constraints, load_prompts, plot_report

    if args.profile:
        args.model = common.PROFILES[args.profile]["model"]
        args.draft_model = args.draft_model or common.PROFILES[args.profile]["speculative_config"].get("model")
    prompt_set = args.prompt_set or ("json" if args.structured else "short")
    try:
        if args.structured and args.prompt_file:
            raise ValueError("--structured runs a prompt set's schemas (--prompt-set json), not --prompt-file")
        version, prompts = load_prompts(
            args.categories, Path(args.prompt_file) if args.prompt_file else None, prompt_set
        )
        constraints = load_constraints(prompts, prompt_set) if args.structured else None
    except ValueError as e:
        return common.error(e, 2)
    target = local_model(args.model)
    draft = None
    if args.draft_model:
        draft = local_model(args.draft_model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "prompt_set": version,
        "model": args.model,
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "fixed_k": args.fixed_k,
        "structured": args.structured,
        "methods": {},
    }
    for name in args.methods:
        try:
            config = _bench_config(args, name, draft)
        except ModelNotFoundError as e:
            return common.error(e, 2)
        overrides = _bench_overrides(args, target, config)
        runs = _bench_method(args, name, config, overrides, (prompts, constraints), out, report)
        report["methods"][name] = compare(runs)
    if args.hf:
        report["huggingface"] = hf_comparison(
            str(target), str(draft) if draft else None, prompts, args.max_tokens, args.dtype
        )
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    plot_report(report, out / "bench.png")
    print(format_report(report))
    print(f"written: {out / 'bench.json'}, {out / 'bench.png'}")
    return 0


def _bench_config(args: argparse.Namespace, name: str, draft: Path | None) -> dict:
    """The speculative config the bench serves for `name`: a profile's settings, the draft
    model or the trained head, --num-speculative-tokens."""
    from client.cli.bench import base_method, method_config

    method = base_method(name)
    config = method_config(name, common.PROFILES[args.profile]["speculative_config"] if args.profile else None)
    if method == "draft_model":
        if draft is None:
            raise ModelNotFoundError("the draft_model method needs --draft-model (or --profile)")
        config["model"] = str(draft)
    elif method in TRAINERS:
        common.draft_with_trained_head(config, args.model, method)
    if args.num_speculative_tokens:
        config["num_speculative_tokens"] = args.num_speculative_tokens
    return {**config, **args.spec_overrides}


def _json_object(text: str) -> dict:
    """An argparse type: a JSON object, or an error that says what it got."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of speculative config keys, got {text!r}")
    return value


def _bench_overrides(args: argparse.Namespace, target: Path, config: dict) -> RepositoryOverrides:
    from client.cli.launcher import RepositoryOverrides

    return RepositoryOverrides(
        common={
            "model": str(target),
            "dtype": args.dtype,
            "runtime": args.runtime,
            "batch_invariant": args.batch_invariant,
        },
        per_model={
            "drafter": {"speculative_config": json.dumps(config)},
            "verifier": {"enable_prefix_caching": str(args.enable_prefix_caching).lower()},
            "speculative": common.in_process(args),
        },
    )


def _bench_method(
    args: argparse.Namespace,
    name: str,
    config: dict,
    overrides: RepositoryOverrides,
    workload: tuple[dict[str, list[str]], dict[str, list[dict]] | None],
    out: Path,
    report: dict,
) -> dict:
    """Every prompt plain and speculative through a server of `config`, with its output
    constraint where the workload has them (--structured), and with --sweep its concurrency
    sweep, into `report`; the runs."""
    prompts, constraints = workload
    from client.cli.bench import engine_from_log, measure, verified_in_process_from_log
    from client.cli.launcher import TritonServer

    with TritonServer.on_port(args.port, overrides, out / f"server-{name}.log", args.threads) as server:
        report.setdefault("engine", engine_from_log(out / f"server-{name}.log"))
        report.setdefault("verifier_in_process", verified_in_process_from_log(out / f"server-{name}.log"))
        runs = measure(
            server.grpc_url,
            prompts,
            args.max_tokens,
            args.repeats,
            name,
            config["num_speculative_tokens"] if args.fixed_k else None,
            not (args.stop_at_eos or args.structured),  # a constrained output ends where its grammar does
            constraints,
        )
        if args.sweep:
            from client.cli.perf import plot_sweep, run_sweep

            sweep = run_sweep(server.grpc_url, out / f"sweep-{name}", tuple(args.sweep), args.max_tokens)
            plot_sweep(sweep, out / f"sweep-{name}.png")
            report.setdefault("sweeps", {})[name] = sweep
    return runs


def add_soak_parser(sub: common.Subcommands) -> None:
    soak = sub.add_parser("soak", help="many concurrent greedy streams for a while: correctness, memory, leaks")
    soak.add_argument("--model", default=DEFAULT_MODEL)
    soak.add_argument(
        "--dtype",
        default="float32",
        choices=["bfloat16", "float32"],
        help="float32 (default) makes every response exactly checkable; bfloat16 can flip near-ties",
    )
    common.add_in_process_flag(soak)
    soak.add_argument("--seconds", type=float, default=180)
    soak.add_argument("--concurrency", type=int, default=16)
    soak.add_argument("--max-tokens", type=int, default=32)
    soak.add_argument("--port", type=int, default=18600, help="HTTP port; gRPC and metrics follow")
    soak.add_argument("--log", default="soak-server.log")
    soak.add_argument(
        "--chaos",
        action="store_true",
        help="also cancel ~20%% of requests mid-stream, mix in bad requests, make the drafter fail "
        "every --fault-every seconds (a custom_class proposer, client/cli/chaos_proposer.py) and, through an "
        "OpenAI front end on --port + 3, send oversized bodies and non-streamed requests whose client leaves",
    )
    soak.add_argument("--fault-every", type=float, default=60.0, help="seconds between drafter faults (--chaos)")
    soak.add_argument(
        "--kv-sequences",
        type=int,
        default=0,
        help="size the verifier's KV pool for this many of the soak's sequences (default: the repository's "
        "kv_cache_memory_gb): with fewer than --concurrency, requests queue for room and are preempted",
    )
    soak.add_argument(
        "--warmup-s", type=float, help="RSS must stay flat after this (default: a third of --seconds, at most 300)"
    )
    soak.set_defaults(func=_soak)


def _soak(args: argparse.Namespace) -> int:
    from client.cli.launcher import RepositoryOverrides, TritonServer
    from client.cli.soak import kv_budget_gb, run_soak

    model_dir = local_model(args.model)
    overrides = RepositoryOverrides(
        common={"model": args.model, "dtype": args.dtype}, per_model={"speculative": common.in_process(args)}
    )
    if args.kv_sequences:
        budget = kv_budget_gb(model_dir, args.dtype, args.kv_sequences, args.max_tokens)
        overrides.per_model["verifier"] = {"kv_cache_memory_gb": repr(budget)}  # exact: a whole number of blocks
        print(f"KV pool: {budget * 2**10:.1f} MiB, room for {args.kv_sequences} sequences")
    if args.chaos:
        return _chaos_soak(args, overrides)
    with TritonServer.on_port(args.port, overrides, Path(args.log)) as server:
        result = run_soak(server, args.seconds, args.concurrency, args.max_tokens)
        time.sleep(1)
        active = server.active_sequences()
        ready = server.is_ready()
    memory = result["memory_mb"]
    print(
        f"{result['requests']} requests in {result['seconds']:.0f}s from {args.concurrency} streams: "
        f"{result['wrong']} wrong, {result['errors']} errors; server ready: {ready}; "
        f"sequence state left: {active}"
    )
    print("server memory (MB) over time: " + ", ".join(f"{t:.0f}s {m:.0f}" for t, m in memory))
    return 0 if not result["wrong"] and not result["errors"] and ready and not any(active.values()) else 1


def _chaos_soak(args: argparse.Namespace, overrides: RepositoryOverrides) -> int:
    """The soak with cancellations, bad requests, drafter faults and, through an OpenAI front
    end of its own, oversized bodies and non-streamed clients that leave (client/cli/soak.py)."""
    import os
    import tempfile

    from client.cli.launcher import TritonServer, openai_front_end
    from client.cli.soak import CHAOS_SPECULATIVE_CONFIG, ChaosMix, rss_growth_mb, run_chaos_soak

    overrides.per_model["drafter"] = {"speculative_config": json.dumps(CHAOS_SPECULATIVE_CONFIG)}
    with tempfile.TemporaryDirectory(prefix="tritonspec-chaos-") as tmp:
        trigger = Path(tmp) / "fault"
        os.environ["TRITONSPEC_CHAOS_TRIGGER"] = str(trigger)  # the server's stubs inherit it
        with TritonServer.on_port(args.port, overrides, Path(args.log)) as server:
            mix = ChaosMix(openai_url=f"127.0.0.1:{args.port + 3}", body_limit=65536)
            limits = ("--model", args.model, "--max-body-bytes", str(mix.body_limit))
            with openai_front_end(server.grpc_url, args.port + 3, Path(tmp) / "openai.log", *limits):
                r = run_chaos_soak(
                    server, args.seconds, args.concurrency, trigger, args.max_tokens, args.fault_every, mix
                )
                active = server.wait_until_idle()
                r["kv_usage_end"] = sum(server.metric_values("vllm:kv_cache_usage_perc").values())
                r["preemptions"] = sum(server.metric_values("vllm:num_preemptions_total").values())
            ready = server.is_ready()
    warmup = args.warmup_s if args.warmup_s is not None else min(300.0, args.seconds / 3)
    _print_chaos(args, r, ready, active, warmup)
    failures = _chaos_failures(r, ready, active, rss_growth_mb(r["memory_mb"], warmup))
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


# RSS may rise this far after warm-up (allocator noise), the front end's /health take this long.
RSS_FLAT_MB = 64.0
HEALTH_LIMIT_MS = 100.0


def _chaos_failures(r: dict, ready: bool, active: dict, rss_growth: float) -> list[str]:
    """What the chaos soak's outcome breaks of what must hold (issue: no wrong output, no
    request lost, nothing left held, memory flat, the front end responsive)."""
    checks = [
        (r["wrong"] or r["cancelled_wrong"], f"{r['wrong'] + r['cancelled_wrong']} wrong outputs"),
        (r["errors"], f"{r['errors']} requests lost (failed without a retryable status)"),
        (r["bad_misjudged"] or r["oversized_misjudged"], "bad requests or oversized bodies misjudged"),
        (any(active.values()), f"sequence state left: {active}"),
        (r["kv_usage_end"], f"KV blocks still held at the end (usage {r['kv_usage_end']:.3f})"),
        (rss_growth > RSS_FLAT_MB, f"server RSS rose {rss_growth:.0f} MB after warm-up"),
        (r["health_ms_max"] > HEALTH_LIMIT_MS, f"the front end's /health took {r['health_ms_max']:.0f} ms"),
        (not ready, "the server is not ready at the end"),
    ]
    return [message for failed, message in checks if failed]


def _print_chaos(args: argparse.Namespace, r: dict, ready: bool, active: dict, warmup: float) -> None:
    from client.cli.soak import process_growth

    print(f"chaos soak: {r['seconds']:.0f}s, {args.concurrency} streams, a drafter fault every {args.fault_every:.0f}s")
    print(
        f"completed {r['completed']} ({r['wrong']} wrong); cancelled mid-stream {r['cancelled']} "
        f"({r['cancelled_wrong']} not a prefix of their reference); refused as retryable "
        f"{r['refused_retryable']}; lost (failed otherwise) {r['errors']}; preemptions {r['preemptions']:.0f}"
    )
    print(
        f"bad requests refused by name {r['bad_refused']}, misjudged {r['bad_misjudged']}; drafter faults "
        f"injected {r['faults_injected']}, taken {r['faults_taken']}"
    )
    print(
        f"oversized bodies refused with 413 {r['oversized_refused']}, misjudged {r['oversized_misjudged']}; "
        f"non-streamed clients that left {r['left_early']}; front end /health at most {r['health_ms_max']:.0f} ms"
    )
    print(f"server ready: {ready}; sequence state left: {active}")
    print("server memory (MB) over time: " + ", ".join(f"{t:.0f}s {m:.0f}" for t, m in r["memory_mb"]))
    print(
        f"front end /health p99 {r['health_ms_p99']:.0f} ms, slowest "
        + ", ".join(f"{ms:.0f} ms at {when:.0f} s" for when, ms in r["health_slowest"])
        + "; RSS growth after warm-up by process (MB): "
        + ", ".join(f"{name} {growth:+.0f}" for name, growth in process_growth(r["memory_by_process"], warmup).items())
    )
    for problem in r["problems"]:
        print(f"  {problem}")


def add_verify_cost_parser(sub: common.Subcommands) -> None:
    cost = sub.add_parser("verify-cost", help="cost of one batched verify step vs a single sequence (in process)")
    cost.add_argument("--model", default=DEFAULT_MODEL)
    cost.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    _add_engine_flags(cost)
    cost.add_argument("--batch", type=int, default=8)
    cost.add_argument("--drafts", type=int, default=4)
    cost.add_argument("--context", type=int, default=200, help="tokens each sequence has cached before the step")
    cost.set_defaults(func=_verify_cost)


def _verify_cost(args: argparse.Namespace) -> int:
    from client.cli.bench import verify_batch_cost

    model = local_model(args.model)
    try:
        cost = verify_batch_cost(
            model,
            args.dtype,
            args.batch,
            args.drafts,
            args.context,
            runtime=args.runtime,
            batch_invariant=args.batch_invariant,
        )
    except ValueError as e:
        return common.error(e, 2)
    print(
        f"{cost['engine']}, {args.context} cached tokens: one verify step ({args.drafts} drafts each): "
        f"1 sequence {cost['one_ms']:.1f} ms, "
        f"{args.batch} sequences {cost['batch_ms']:.1f} ms ({cost['ratio']:.2f}x); a plain 1-token step "
        f"{cost['plain_ms']:.1f} ms (verifying {args.drafts} drafts costs {cost['drafts_ratio']:.2f}x)"
    )
    return 0


def add_perf_parser(sub: common.Subcommands) -> None:
    perf = sub.add_parser("perf", help="perf_analyzer concurrency sweep, plain vs speculative, with a chart")
    perf.add_argument("--url", help="gRPC url of a running server (default: start one)")
    perf.add_argument("--model", default=DEFAULT_MODEL)
    perf.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    perf.add_argument("-sc", "--speculative-config")
    common.add_in_process_flag(perf)
    common.add_threads_flag(perf)
    perf.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    perf.add_argument("--max-tokens", type=int, default=64)
    perf.add_argument(
        "--requests-per-window",
        type=int,
        default=16,
        help="finished requests per measurement window (3 windows per point; at least 2x concurrency)",
    )
    perf.add_argument(
        "--stream-interval",
        type=int,
        metavar="N",
        help="each request asks for responses of at least N tokens (default: the server's setting)",
    )
    _add_server_flags(perf, port=18700, out="perf-results")
    perf.set_defaults(func=_perf)


def _perf(args: argparse.Namespace) -> int:
    from client.cli.launcher import RepositoryOverrides, TritonServer
    from client.cli.perf import format_sweep, plot_sweep, run_sweep, speedup_table

    if args.stream_interval is not None:
        try:  # the check the `speculative` model applies to a request's own
            stream_interval(str(args.stream_interval))
        except ValueError as e:
            return common.error(f"--stream-interval: {e}", 2)
    out = Path(args.out)
    server = None
    url = args.url
    if url is None:
        local_model(args.model)
        overrides = RepositoryOverrides(common={"model": args.model, "dtype": args.dtype})
        if args.speculative_config:
            overrides.per_model["drafter"] = {"speculative_config": args.speculative_config}
        overrides.per_model["speculative"] = common.in_process(args)
        out.mkdir(parents=True, exist_ok=True)
        server = TritonServer.on_port(args.port, overrides, out / "server.log", args.threads).start()
        url = server.grpc_url
    try:
        results = run_sweep(
            url, out, tuple(args.concurrency), args.max_tokens, args.requests_per_window, args.stream_interval
        )
    finally:
        if server:
            server.stop()
    (out / "perf.json").write_text(json.dumps(results, indent=2))
    plot_sweep(results, out / "perf.png")
    print(format_sweep(results))
    print("speculative / plain throughput:", {c: round(v, 2) for c, v in speedup_table(results).items()})
    print(f"written: {out / 'perf.json'}, {out / 'perf.png'}")
    return 0
