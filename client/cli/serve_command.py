"""`tritonspec serve`: a model repository in tritonserver, in the foreground, with the
target and the drafter the flags (or a profile) name."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from backends.config import SpeculativeConfig
from backends.runtime import BATCH_INVARIANT_MODES
from backends.runtime.model_store import DEFAULT_MODEL, NAMED_MODELS, ModelNotFoundError, fetch, local_model
from backends.serving.parameters import DEFAULT_PREFILL_CHUNK, max_queue_time_s, prefill_chunk_tokens, stream_interval
from backends.training import TRAINERS, head_dir
from client.cli import common

if TYPE_CHECKING:  # the launcher finds tritonserver's wheel on import: only when serving
    from client.cli.launcher import RepositoryOverrides, TritonServer

# vLLM's shorthands for `-sc` keys: (attribute, flag, key).
SPEC_SHORTHANDS = (
    ("spec_method", "--spec-method", "method"),
    ("spec_model", "--spec-model", "model"),
    ("spec_tokens", "--spec-tokens", "num_speculative_tokens"),
)


def add_serve_parser(sub: common.Subcommands) -> None:
    serve = sub.add_parser("serve", help="serve a model repository with tritonserver (foreground)")
    _add_server_flags(serve)
    _add_drafter_flags(serve)
    serve.set_defaults(func=_serve)


def _add_server_flags(serve: argparse.ArgumentParser) -> None:
    """Where the server listens, the target and how it runs."""
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
        choices=sorted(common.PROFILES),
        help="a ready target + drafter pair (fetched when needed), e.g. qwen-coder",
    )
    serve.add_argument("--dtype", choices=["bfloat16", "float32"], help="target dtype (default bfloat16)")
    serve.add_argument(
        "--runtime",
        choices=common.RUNTIMES,
        help="the target's forward engine: the lean runtime where "
        "it runs, else transformers (auto, the default), lean, or hf (transformers)",
    )
    serve.add_argument("--batch-invariant", choices=BATCH_INVARIANT_MODES, help=common.BATCH_INVARIANT_HELP)
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
        "--max-queue-time-s",
        type=float,
        metavar="S",
        help="how long a request may wait for room in the KV pool before it fails with 'KV cache budget full' "
        "(the OpenAI front end: 503 with Retry-After; default 60)",
    )
    serve.add_argument(
        "--device",
        help="verifier and drafter device: auto, cpu, cuda or cuda:N (default: the "
        "instance_group kind; see docs/gpu.md)",
    )


def _add_drafter_flags(serve: argparse.ArgumentParser) -> None:
    """The drafter (vLLM's -sc and its shorthands), where each model runs, and the start's limit."""
    serve.add_argument("-sc", "--speculative-config", help="vLLM --speculative-config JSON for the drafter")
    serve.add_argument("--spec-method", metavar="METHOD", help="shorthand for the -sc key `method` (vLLM's flag)")
    serve.add_argument("--spec-model", metavar="MODEL", help="shorthand for the -sc key `model` (vLLM's flag)")
    serve.add_argument(
        "--spec-tokens", type=int, metavar="K", help="shorthand for the -sc key `num_speculative_tokens` (vLLM's flag)"
    )
    serve.add_argument("--no-speculation", action="store_true", help="serve plain decoding only")
    common.add_in_process_flag(serve)
    common.add_threads_flag(serve)
    serve.add_argument("--startup-timeout", type=float, default=600)
    serve.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=30.0,
        help="at SIGTERM / Ctrl-C: new requests are refused and readiness turns false at once; requests "
        "in flight may finish for this long, then end with an error (default %(default)s)",
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
        common.draft_with_trained_head(config, target, method)
    return json.dumps(config)


def _serve(args: argparse.Namespace) -> int:
    from client.cli.launcher import DEFAULT_REPOSITORY, ServerStartError, TritonServer

    repository = Path(args.model_repository or DEFAULT_REPOSITORY)
    if args.profile:
        profile = common.PROFILES[args.profile]
        args.model = profile["model"]
        args.speculative_config = args.speculative_config or json.dumps(profile["speculative_config"])
    try:
        target = _local_models(args)
    except ModelNotFoundError as e:
        return common.error(e, 2)
    except ValueError as e:
        return common.error(f"--speculative-config: {e}", 2)
    try:
        overrides = _serve_overrides(args, target)
    except ValueError as e:
        return common.error(e, 2)
    if args.shutdown_grace_s < 0:
        return common.error("--shutdown-grace-s must be at least 0", 2)
    server = TritonServer(
        repository,
        args.http_port,
        args.grpc_port,
        args.metrics_port,
        args.host,
        overrides,
        threads=args.threads,
        shutdown_grace_s=args.shutdown_grace_s,
    )
    try:
        server.start(timeout_s=args.startup_timeout, require_all_models=False)
    except ServerStartError as e:
        return common.error(e)
    _print_welcome(repository, server, args.host, args.metrics_port)
    return _serve_until_stopped(server)


def _local_models(args: argparse.Namespace) -> Path:
    """The target's local path, and -sc with its draft's (checked as the drafter will read it).
    A named model is fetched once (later starts find it in the cache); a path must exist."""
    target = local_model(args.model)
    if args.speculative_config:
        args.speculative_config = _local_speculative_config(args.speculative_config, args.model)
        SpeculativeConfig.from_json(args.speculative_config, target_model=str(target))
    return target


def _serve_overrides(args: argparse.Namespace, target: Path) -> RepositoryOverrides:
    """The repository's parameters as the flags set them (the rest: each config.pbtxt's);
    ValueError naming the flag for a value the `speculative` model would refuse."""
    from client.cli.launcher import RepositoryOverrides

    overrides = RepositoryOverrides()
    overrides.common["model"] = args.model if args.model in NAMED_MODELS else str(target)
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
    for name, check in (
        ("prefill_chunk_tokens", prefill_chunk_tokens),
        ("stream_interval", stream_interval),
        ("max_queue_time_s", max_queue_time_s),
    ):
        value = getattr(args, name)
        if value is None:
            continue
        try:  # the check the `speculative` model applies to the parameter
            check(str(value))
        except ValueError as e:
            raise ValueError(f"--{name.replace('_', '-')}: {e}") from None
        overrides.per_model.setdefault("speculative", {})[name] = str(value)
    if args.speculative_config:
        overrides.per_model.setdefault("drafter", {})["speculative_config"] = args.speculative_config
    if args.no_speculation:
        overrides.per_model.setdefault("speculative", {})["drafter_model_name"] = ""
    overrides.per_model.setdefault("speculative", {}).update(common.in_process(args))
    return overrides


def _print_welcome(repository: Path, server: TritonServer, host: str, metrics_port: int) -> None:
    print(
        f"\ntritonspec is serving {repository}\n"
        f"  HTTP    http://{server.http_url}   (generate: /v2/models/speculative/generate[_stream])\n"
        f"  gRPC    {server.grpc_url}\n"
        f"  metrics http://{host}:{metrics_port}/metrics\n\n"
        "Try:\n"
        f"  curl -s -X POST http://{server.http_url}/v2/models/speculative/generate \\\n"
        '       -d \'{"text_input": "The capital of France is", "max_tokens": 32}\'\n'
        f'  tritonspec generate --stream --url {server.grpc_url} "Write a haiku about rivers."\n\n'
        "Ctrl-C stops the server.\n",
        flush=True,
    )


def _serve_until_stopped(server: TritonServer) -> int:
    """Wait for tritonserver; its exit code, or once Ctrl-C or SIGTERM stopped it gracefully
    (launcher.TritonServer.stop), 0 unless tritonserver's exit failed."""

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
        print(
            f"\nstopping tritonserver: new requests are refused, requests in flight have "
            f"{server.shutdown_grace_s:g} s to finish...",
            file=sys.stderr,
        )
        server.stop()
        code = server.process.returncode
        if code:
            print(f"tritonserver exited with code {code}", file=sys.stderr)
        return 1 if code else 0
    finally:
        server.stop()
