"""What several `tritonspec` subcommands share: the ready-made target + drafter profiles, the
flags for where the models run, the trained heads' lookup and the error exit."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from backends.config.verify import TOKEN_MAP_METHODS
from backends.runtime.model_store import ModelNotFoundError
from backends.training import TOKEN_MAP_FILE, head_dir
from backends.triton_models.topology import VERIFIER_IN_PROCESS_CHOICES

# The subparsers action `build_parser` hands each subcommand's `add_*_parser`.
Subcommands = argparse._SubParsersAction

# Ready-made target + drafter pairs: `tritonspec serve --profile NAME`.
# The smollm2-* profiles draft with the heads `tritonspec train METHOD` writes (no `model`).
PROFILES: dict[str, dict] = {
    "smollm2-eagle": {"model": "smollm2-135m", "speculative_config": {"method": "eagle", "num_speculative_tokens": 3}},
    "smollm2-eagle3": {
        "model": "smollm2-135m",
        # The head's fc and LM head on the int8 kernel (its decoder layer stays bf16 on the
        # runtime): a greedy chain of 3 drafts in 15-16% of a plain step against bf16's 18-21%,
        # at 1.808 against 1.814 held-out acceptance length (docs/measurements.md, "The heads'
        # drafting cost").
        "speculative_config": {"method": "eagle3", "num_speculative_tokens": 3, "quantization": "int8"},
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
BATCH_INVARIANT_HELP = (
    "the target's batch invariance (speculative output == plain output in bf16): auto (on where the lean "
    "runtime runs, on a GPU on its Triton kernels; the default), on (refuse to start where it cannot be) "
    "or off (on a GPU: transformers)"
)


def error(e: Exception | str, code: int = 1) -> int:
    """Say what went wrong on stderr and give the command's exit code (1; 2 for bad input)."""
    print(f"error: {e}", file=sys.stderr)
    return code


def add_in_process_flag(parser: argparse.ArgumentParser) -> None:
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


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=_thread_count,
        metavar="N",
        help="threads for each model's forwards (default: the CPUs the server may use: its affinity mask and "
        "cgroup CPU quota; the server logs what it chose and why). A team starved by other work on its "
        "cores still shrinks while it lasts (docs/serving-under-load.md)",
    )


def in_process(args: argparse.Namespace) -> dict[str, str]:
    """The `speculative` model's verifier_in_process and drafter_in_process as the command line
    sets them (nothing: its config's)."""
    flags = {"verifier_in_process": args.verifier_in_process, "drafter_in_process": args.drafter_in_process}
    return {name: value for name, value in flags.items() if value}


def trained_head(target: str, method: str) -> Path:
    path = head_dir(target, method)
    if not (path / "config.json").exists():
        raise ModelNotFoundError(
            f"no trained {method} head for {target} at {path}: train it first with "
            f"`tritonspec train {method} --target {target}`"
        )
    return path


def draft_with_trained_head(config: dict, target: str, method: str) -> None:
    """Set `config` to draft with the head `tritonspec train` made for `target`, and with the
    token map written beside it (a reduced draft vocabulary) unless the config names one."""
    path = trained_head(target, method)
    config["model"] = str(path)
    if method in TOKEN_MAP_METHODS and (path / TOKEN_MAP_FILE).exists():
        config.setdefault("speculative_token_map", str(path / TOKEN_MAP_FILE))
