"""perf_analyzer for this machine. Its wheels (2.58+) are built for glibc 2.38 and pip on
Debian 12 (glibc 2.36) refuses them; the binary runs under Debian 13's dynamic loader and
libc, unpacked into a private folder (no system change). Installed once into the cache."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from backends.runtime.model_store import cache_dir

log = logging.getLogger("tritonspec.perf_analyzer")
VERSION = "2.60.0"
TRIXIE_PACKAGES = ("libc6", "libstdc++6", "libgcc-s1")


def _root() -> Path:
    return cache_dir() / "perf_analyzer"


def install() -> list[str]:
    """The command prefix that runs perf_analyzer (installing it first when needed)."""
    root = _root()
    binary = root / "wheel" / "perf_analyzer" / "bin" / "perf_analyzer"
    libs = root / "trixie" / "root"
    loader = libs / "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
    if not binary.exists():
        log.info("downloading perf-analyzer %s (manylinux_2_38 wheel)", VERSION)
        download = root / "download"
        subprocess.check_call(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--platform",
                "manylinux_2_38_x86_64",
                "-d",
                str(download),
                f"perf-analyzer=={VERSION}",
            ]
        )
        wheel = next(download.glob("perf_analyzer-*.whl"))
        zipfile.ZipFile(wheel).extractall(root / "wheel")
        binary.chmod(0o755)
    if not loader.exists():
        _install_trixie_libs(root / "trixie")
    return [str(loader), "--library-path", f"{libs}/usr/lib/x86_64-linux-gnu:/lib/x86_64-linux-gnu", str(binary)]


def _install_trixie_libs(where: Path) -> None:
    log.info("fetching Debian 13 libc/libstdc++ for perf_analyzer into %s", where)
    for sub in ("lists/partial", "cache/archives/partial", "debs", "root"):
        (where / sub).mkdir(parents=True, exist_ok=True)
    sources = where / "sources.list"
    sources.write_text(
        "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main\n"
    )
    apt = [
        "apt-get",
        "-q",
        "-o",
        "APT::Sandbox::User=root",
        "-o",
        f"Dir::Etc::SourceList={sources}",
        "-o",
        "Dir::Etc::SourceParts=/dev/null",
        "-o",
        f"Dir::State::Lists={where / 'lists'}",
        "-o",
        f"Dir::Cache={where / 'cache'}",
    ]
    subprocess.check_call([*apt, "update"], stdout=subprocess.DEVNULL)
    subprocess.check_call([*apt, "download", *TRIXIE_PACKAGES], cwd=where / "debs", stdout=subprocess.DEVNULL)
    for deb in (where / "debs").glob("*.deb"):
        subprocess.check_call(["dpkg", "-x", str(deb), str(where / "root")])


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*install(), *args], **kwargs)


def _option(args: list[str], *names: str) -> str | None:
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(name + "="):
                return arg[len(name) + 1 :]
    return None


def takes_text(args: list[str]) -> bool:
    """Whether the model perf_analyzer is pointed at has a `text_input` input (an LLM
    interface like `speculative`'s), asked from the server it names."""
    model, url = _option(args, "-m"), _option(args, "-u", "--url")
    grpc = _option(args, "-i", "--protocol") == "grpc"
    try:
        if grpc:
            import tritonclient.grpc as client

            metadata = client.InferenceServerClient(url or "localhost:8001").get_model_metadata(model, as_json=True)
        else:
            import tritonclient.http as client

            metadata = client.InferenceServerClient(url or "localhost:8000").get_model_metadata(model)
    except Exception:  # noqa: BLE001 - perf_analyzer itself reports an unreachable server
        return False
    return any(i["name"] == "text_input" for i in metadata.get("inputs", []))


def default_input(args: list[str]) -> list[str]:
    """perf_analyzer fills every input it is not given data for, optional ones included, with
    random bytes (a max_tokens of 1936311911, NaN temperatures) and cannot fill the
    variable-length ones at all, so an LLM model needs --input-data. Without one, the
    benchmark prompts are sent (64 tokens each, streamed) and perf_analyzer says so."""
    if _option(args, "-m") is None or _option(args, "--input-data") is not None or not takes_text(args):
        return []
    from client.cli.bench import load_prompts

    rows = [
        {"text_input": [p], "max_tokens": [64], "stream": ["--streaming" in args], "ignore_eos": [True]}
        for category in load_prompts()[1].values()
        for p in category
    ]
    path = _root() / "default_input.json"
    path.write_text(json.dumps({"data": rows}))
    print(f"tritonspec: no --input-data given; sending the {len(rows)} benchmark prompts from {path}", file=sys.stderr)
    return ["--input-data", str(path)]


def main(args: list[str]) -> int:
    command = install()
    os.execv(command[0], [*command, *args, *default_input(args)])
