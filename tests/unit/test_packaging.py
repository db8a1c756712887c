"""The wheel carries everything the server reads at run time, and the image's smoke check
passes on the installed copy (deploy/Dockerfile runs it; Docker is not needed here)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.fixtures import ROOT


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The project's wheel, built as pip builds it (no network: the venv's setuptools) and
    unpacked into a folder, as `pip install` would lay it out in site-packages."""
    out = tmp_path_factory.mktemp("wheel")
    # From a copy of the sources: setuptools' build/ folder in a checkout keeps what an earlier
    # build put there, and a file the package data no longer names would still be packed.
    source = out / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "tests"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = out.glob("tritonspec-*.whl")
    site = out / "site-packages"
    zipfile.ZipFile(wheel).extractall(site)
    return site


def run_installed(site: Path, code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter that imports the project from `site` (not this checkout),
    from another folder, as in the image."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-c", code], cwd=site.parent, env=env, capture_output=True, text=True)


def test_the_wheel_carries_the_kernel_source_and_the_bench_prompts(installed):
    for path in ("backends/runtime/cpu_kernels.c", "client/data/bench_prompts.json"):
        assert (installed / path).read_bytes() == (ROOT / path).read_bytes(), path


def test_the_runtime_builds_its_cpu_kernels_from_the_installed_copy(installed):
    done = run_installed(
        installed,
        "from backends.runtime import cpu_kernels as k; print(k.__file__); print(k.unavailable_reason(64, 9, 3))",
    )
    assert done.returncode == 0, done.stderr
    where, reason = done.stdout.split()[0], done.stdout.strip().splitlines()[-1]
    assert where.startswith(str(installed)) and reason == "None"


def test_a_missing_kernel_source_is_named(installed, tmp_path):
    copy = tmp_path / "site-packages"
    subprocess.run(["cp", "-r", str(installed), str(copy)], check=True)
    (copy / "backends/runtime/cpu_kernels.c").unlink()
    done = run_installed(copy, "from backends.runtime import cpu_kernels as k; print(k.unavailable_reason(64, 9, 3))")
    assert done.returncode == 0, done.stderr
    assert "cpu_kernels.c is missing from this installation" in done.stdout


def test_the_images_smoke_check_passes_on_the_installed_copy(installed):
    """The `python3 -c` of the Dockerfile's install step, run as it is (an import of a module
    that moved broke the image build once, and only a docker build would have shown it)."""
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    (code,) = re.findall(r'^RUN python3 -m pip install .*python3 -c "([^"]+)"$', text, re.M)
    done = run_installed(installed, code)
    assert done.returncode == 0, done.stderr
