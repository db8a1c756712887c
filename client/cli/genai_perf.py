"""genai-perf (NVIDIA's LLM benchmark on top of perf_analyzer) in a virtualenv of its own:
it needs numpy 2, which would break this Triton's Python stub in the project's venv. Its
perf_analyzer is ours (client.perf_analyzer), put first on its PATH by a small wrapper."""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

from backends.runtime.model_store import cache_dir
from client.cli.perf_analyzer import install as install_perf_analyzer

log = logging.getLogger("tritonspec.genai_perf")
VERSION = "0.0.16"


def install() -> tuple[Path, dict[str, str]]:
    """The genai-perf executable and the environment to run it in (installed once)."""
    root = cache_dir() / "genai-perf"
    venv = root / "venv"
    exe = venv / "bin" / "genai-perf"
    if not exe.exists():
        log.info("installing genai-perf %s into %s", VERSION, venv)
        subprocess.check_call([sys.executable, "-m", "venv", "--clear", str(venv)])
        # pip would compile all ~950 MB of its dependencies (half the install's time); what a
        # run imports is compiled once here instead, even where PYTHONDONTWRITEBYTECODE is set.
        subprocess.check_call([str(venv / "bin" / "pip"), "install", "-q", "--no-compile", f"genai-perf=={VERSION}"])
        warm = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        subprocess.check_call(
            [str(venv / "bin" / "python"), "-c", "import genai_perf.main; from transformers import AutoTokenizer"],
            env=warm,
        )
    wrapper_dir = root / "bin"
    wrapper_dir.mkdir(parents=True, exist_ok=True)
    wrapper = wrapper_dir / "perf_analyzer"
    wrapper.write_text("#!/bin/sh\nexec " + " ".join(shlex.quote(a) for a in install_perf_analyzer()) + ' "$@"\n')
    wrapper.chmod(0o755)
    env = dict(os.environ, PATH=f"{wrapper_dir}{os.pathsep}{os.environ.get('PATH', '')}", HF_HUB_OFFLINE="1")
    return exe, env


def main(args: list[str]) -> int:
    exe, env = install()
    os.execve(str(exe), [str(exe), *args], env)
