"""Start and stop a real `tritonserver` (2.51, from the nvidia-pytriton wheel) serving a
model repository, bound to loopback, with this virtualenv's Python in the stubs.

What the launcher does that a bare `tritonserver` call does not:
- assembles the backend directory (libtriton_python.so, triton_python_backend_utils.py and
  the stub for this Python version) as symlinks into the wheel;
- puts the venv's bin/ first on PATH so the stubs embed this venv (numpy<2, torch, backends);
- gives the stubs' shared-memory regions a unique prefix, so stopping the server can kill
  leftover stubs and delete their /dev/shm files without touching anyone else's;
- optionally copies the repository with config.pbtxt parameters overridden (--model,
  --dtype, --speculative-config) the way `vllm serve -sc` configures vLLM, and instance
  kinds (KIND_GPU for the verifier and drafter on a GPU host);
- stops it gracefully (`drain`): new requests are refused as retryable at once, those in flight
  may finish within a grace period and are then cut with an error, and Triton's readiness
  turns false at once. tritonserver's own stop (SIGINT) alone crashed with streams open: a
  decoupled model's request stops counting as in flight once execute() has handed it to a
  worker thread, so Triton found "0 model versions that have in-flight inferences" and began
  unloading `speculative` under its streams; its finalize waited for them, the exit timeout
  ran out ("Exit timeout expired. Exiting immediately.") and the process died of SIGSEGV, or
  hung (SmolLM2, 3 streams of 1500 tokens: one SIGSEGV, one hang over 60 s; drained: exit 0
  after 2.8 s). Drained, the streams end by the grace period's end, before Triton's exit
  timeout (the grace period + EXIT_MARGIN_S). Triton's stop unloads the verifier and drafter
  models at once all the same: where requests call them over BLS, the SIGINT waits until those
  requests have ended (client/cli/tritonserver.py, `stop_gracefully`).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from backends.runtime import THREADS_ENV
from backends.runtime.model_store import cache_dir
from backends.triton_models.admission import DRAIN_ENV
from backends.triton_models.pbtxt import get_parameter, set_parameter
from client.cli.tritonserver import stop_gracefully

log = logging.getLogger("tritonspec.server")
# Found without importing pytriton: its package pulls in its own client and many packages.
WHEEL = Path(importlib.util.find_spec("pytriton").origin).parent / "tritonserver"
INSTANCE_KINDS = ("KIND_CPU", "KIND_GPU", "KIND_AUTO")
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_REPOSITORY = REPO_ROOT / "model_repository"
# How long an idle OpenMP thread spins before it sleeps (GNU OpenMP, which torch and the lean
# runtime's kernels use), unless GOMP_SPINCOUNT is set: ~0.2 ms instead of libgomp's default of
# several ms. A forward's parallel regions follow each other within microseconds either way, but
# after the last one its threads kept one core busy for milliseconds: the next forward of the
# other process (the draft_model drafter, or the target after it) then ran on one core.
OPENMP_SPIN_COUNT = "10000"
# How long requests in flight may go on after a graceful stop begins (`--shutdown-grace-s`).
DEFAULT_SHUTDOWN_GRACE_S = 30.0
# Triton waits this much longer than the grace period before it unloads models under requests
# still in flight: the models cut theirs at the grace period's end.
EXIT_MARGIN_S = 10


def pids_with_cmdline(*fragments: str | bytes) -> list[int]:
    """Processes whose command line contains every fragment (a server's stubs carry its
    shared-memory prefix): the one /proc scan the launcher, soak and tests share."""
    wanted = [f.encode() if isinstance(f, str) else f for f in fragments]
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if all(f in cmdline for f in wanted):
            found.append(int(proc.name))
    return found


class ServerStartError(RuntimeError):
    """tritonserver exited or never became ready; the message carries the log tail."""


def backend_directory() -> Path:
    """A backend dir whose python/ holds symlinks to the wheel's files for this Python."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = WHEEL / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise ServerStartError(f"the nvidia-pytriton wheel has no Python backend stub for Python {version}")
    root = cache_dir() / "backends" / f"py{version}"
    python = root / "python"
    python.mkdir(parents=True, exist_ok=True)
    for src in (
        WHEEL / "backends/python/libtriton_python.so",
        WHEEL / "backends/python/triton_python_backend_utils.py",
        stub,
    ):
        link = python / src.name
        if not (link.is_symlink() and os.readlink(link) == str(src)):
            link.unlink(missing_ok=True)
            link.symlink_to(src)
    return root


def needs_auto_complete(repository: Path) -> bool:
    """Whether some model's config.pbtxt leaves its inputs, outputs or batch size to the backend
    to fill in (an ONNX model's, say). When none does, the server starts without auto-completion:
    it would start one Python stub per model only to ask it (~8 s of a 20 s start on 2 cores)."""
    for config in repository.glob("*/config.pbtxt"):
        text = config.read_text()
        if not all(re.search(rf"^\s*{field}\s*[\[:]", text, re.M) for field in ("input", "output", "max_batch_size")):
            return True
    return False


def set_instance_kind(pbtxt: str, kind: str) -> str:
    """Set the kind of every instance group in a config.pbtxt text."""
    if kind not in INSTANCE_KINDS:
        raise ValueError(f"instance kind must be one of {', '.join(INSTANCE_KINDS)}, got {kind!r}")
    text, count = re.subn(r"\bkind:\s*KIND_[A-Z]+", f"kind: {kind}", pbtxt)
    if not count:
        raise ValueError("the config has no instance_group kind to set")
    return text


@dataclass
class RepositoryOverrides:
    """Parameters to force in every model of the repository that declares them, plus
    per-model ones ({model_name: {key: value}}) and instance kinds ({model_name: KIND_GPU})."""

    common: dict[str, str] = field(default_factory=dict)
    per_model: dict[str, dict[str, str]] = field(default_factory=dict)
    instance_kinds: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.common or self.per_model or self.instance_kinds)


def patched_repository(source: Path, overrides: RepositoryOverrides, dest: Path) -> Path:
    """Copy `source` to `dest` with the overrides written into each config.pbtxt."""
    shutil.copytree(source, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    for config in sorted(dest.glob("*/config.pbtxt")):
        text = config.read_text(encoding="utf-8")
        for key, value in overrides.common.items():
            if get_parameter(text, key) is not None:
                text = set_parameter(text, key, value)
        for key, value in overrides.per_model.get(config.parent.name, {}).items():
            text = set_parameter(text, key, value)
        if config.parent.name in overrides.instance_kinds:
            text = set_instance_kind(text, overrides.instance_kinds[config.parent.name])
        config.write_text(text, encoding="utf-8")
    return dest


def _terminate_with_parent() -> None:
    """In the child before exec: SIGTERM tritonserver if this launcher dies (even by
    SIGKILL), so a crashed launcher or test run leaves no server holding the ports.
    Linux ties this to the thread that called start(): keep that thread alive meanwhile."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def family_values(text: str, name: str) -> dict[str, float]:
    """{label text: value} for one metric family in Prometheus' text format (labels as written)."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(re.escape(name) + r"\{([^}]*)\} (\S+)", text)}


class TritonServer:
    def __init__(
        self,
        model_repository: Path = DEFAULT_REPOSITORY,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        host: str = "127.0.0.1",
        overrides: RepositoryOverrides | None = None,
        log_path: Path | None = None,
        log_verbose: int = 0,
        graceful_stop: bool = True,
        threads: int | None = None,
        shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
    ) -> None:
        """`threads`: how many threads each model's forwards use (`--threads`), else what the CPUs
        the server may use allow (its affinity and cgroup quota: backends/runtime/threads.py).
        `shutdown_grace_s`: how long requests in flight may go on once a graceful stop begins."""
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        if shutdown_grace_s < 0:
            raise ValueError(f"the shutdown grace period must be at least 0 s, got {shutdown_grace_s}")
        self.threads = threads
        self.shutdown_grace_s = shutdown_grace_s
        self.source_repository = Path(model_repository).resolve()
        # False for a throwaway server (the tests'): stop() kills it at once. A graceful stop
        # takes ~3 s however small the models: Triton unloads each model's stub and checks
        # once a second whether any is left.
        self.graceful_stop = graceful_stop
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.host = host
        self.overrides = overrides or RepositoryOverrides()
        self.log_path = log_path
        self.log_verbose = log_verbose
        self.shm_prefix = f"tritonspec_{os.getpid()}_{http_port}_"
        self.process: subprocess.Popen | None = None
        self.repository = self.source_repository  # what it serves: this, or a patched copy
        self._workdir: tempfile.TemporaryDirectory | None = None
        # Where drain() writes the end of the grace period for the models to read.
        self._control = tempfile.TemporaryDirectory(prefix="tritonspec-control-")
        self.drain_file = Path(self._control.name) / "drain"

    @classmethod
    def on_port(
        cls, http_port: int, overrides: RepositoryOverrides, log_path: Path, threads: int | None = None
    ) -> TritonServer:
        """A server for a measuring command: HTTP on `http_port`, gRPC and metrics right after."""
        return cls(
            http_port=http_port,
            grpc_port=http_port + 1,
            metrics_port=http_port + 2,
            overrides=overrides,
            log_path=log_path,
            threads=threads,
        )

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def command(self, repository: Path) -> list[str]:
        addr = [f"--{kind}-address={self.host}" for kind in ("http", "grpc", "metrics")]
        return [
            str(WHEEL / "bin" / "tritonserver"),
            f"--model-repository={repository}",
            f"--backend-directory={backend_directory()}",
            *addr,
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--exit-timeout-secs={int(self.shutdown_grace_s) + EXIT_MARGIN_S}",
            *([] if needs_auto_complete(repository) else ["--disable-auto-complete-config"]),
            # A model that fails to load (say, a bad speculative_config) is reported, and
            # the other models keep serving; start() checks each model's state itself.
            "--exit-on-error=false",
            "--strict-readiness=false",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            # Room for long prompts between models without growing the region per call.
            "--backend-config=python,shm-default-byte-size=16777216",
            f"--log-verbose={self.log_verbose}",
        ]

    @staticmethod
    def environment(threads: int | None = None) -> dict[str, str]:
        env = dict(os.environ)
        if threads is not None:  # every model reads it (threads.py); the stubs inherit this environment
            env[THREADS_ENV] = str(threads)
        # The stub embeds the Python found first on PATH and honours its pyvenv.cfg.
        env["PATH"] = f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
        env.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)
        return env

    def start(self, timeout_s: float = 300.0, require_all_models: bool = True) -> TritonServer:
        """Start and wait until ready. Models that failed to load raise ServerStartError
        (with Triton's reason for each) unless require_all_models is False."""
        return self.launch().wait_started(timeout_s, require_all_models)

    def launch(self) -> TritonServer:
        """Start the process and return at once: several servers launched before any is
        waited for load their models side by side (each load is mostly one stub's imports,
        on one core). The calling thread must outlive the server (_terminate_with_parent)."""
        if self.overrides:
            self._workdir = tempfile.TemporaryDirectory(prefix="tritonspec-repo-")
            self.repository = patched_repository(self.source_repository, self.overrides, Path(self._workdir.name))
        out = open(self.log_path, "ab") if self.log_path else None
        log.info("starting tritonserver on %s (HTTP), %s (gRPC)", self.http_url, self.grpc_url)
        self.process = subprocess.Popen(
            self.command(self.repository),
            env={**self.environment(self.threads), DRAIN_ENV: str(self.drain_file)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # our own process group: stop() can reach every stub
            preexec_fn=_terminate_with_parent,
        )
        if out:
            out.close()
        return self

    def wait_started(self, timeout_s: float = 300.0, require_all_models: bool = True) -> TritonServer:
        """Wait until the launched server is ready; as start() for the models that failed."""
        self._wait_ready(timeout_s)
        failed = {name: reason for name, (state, reason) in self.model_states().items() if state != "READY"}
        for name, reason in failed.items():
            log.error("model %r is not serving: %s", name, reason)
        if failed and require_all_models:
            self.stop()
            raise ServerStartError("models failed to load:\n" + "\n".join(f"  {n}: {r}" for n, r in failed.items()))
        return self

    def metric_values(self, name: str) -> dict[str, float]:
        """{label text: value} for one metric family on /metrics (labels as written there)."""
        with urllib.request.urlopen(f"http://{self.host}:{self.metrics_port}/metrics", timeout=5) as r:
            return family_values(r.read().decode(), name)

    def active_sequences(self) -> dict[str, float]:
        """{model: sequences holding state} from the `tritonspec_active_sequences` gauge."""
        values = self.metric_values("tritonspec_active_sequences")
        return {labels.removeprefix('model="').removesuffix('"'): v for labels, v in values.items()}

    def wait_until_idle(self, timeout_s: float = 30.0) -> dict[str, float]:
        """The active-sequence gauges once they read 0, or as they are after `timeout_s`
        (requests cancelled last may still be ending)."""
        deadline = time.monotonic() + timeout_s
        while True:
            active = self.active_sequences()
            if not any(active.values()) or time.monotonic() > deadline:
                return active
            time.sleep(0.2)

    def model_states(self) -> dict[str, tuple[str, str]]:
        """{model: (state, reason)} from the repository index."""
        request = urllib.request.Request(f"http://{self.http_url}/v2/repository/index", data=b"{}")
        with urllib.request.urlopen(request, timeout=10) as r:
            index = json.loads(r.read())
        return {m["name"]: (m.get("state", ""), m.get("reason", "")) for m in index}

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise ServerStartError(f"tritonserver exited with code {self.process.returncode}\n{tail}")
            if self.is_ready():
                return
            time.sleep(0.25)
        tail = self.log_tail()
        self.stop()
        raise ServerStartError(f"tritonserver was not ready after {timeout_s:.0f}s\n{tail}")

    def log_tail(self, lines: int = 60) -> str:
        if not self.log_path or not Path(self.log_path).exists():
            return ""
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])

    def drain(self) -> None:
        """Begin a graceful stop: the models refuse new requests from now on and cut those in
        flight when the grace period ends (backends/triton_models/admission.py); tritonserver
        reports not ready and exits once no request is left. Where requests call a peer over
        BLS, it returns once they have ended and tritonserver is stopping (`stop_gracefully`)."""
        if self.process is not None:
            stop_gracefully(self.process, self.drain_file, self.shutdown_grace_s, [self.repository])

    def stop(self) -> None:
        """drain() and wait (unless not graceful_stop), then SIGKILL for whatever is left; then
        stray stubs and shm regions."""
        if self.graceful_stop and self.process is not None and self.process.poll() is None:
            self.drain()
            # Unloading the models takes a few seconds once the last request has ended.
            limit = self.shutdown_grace_s + EXIT_MARGIN_S + 20
            try:
                self.process.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver did not stop in %.0fs; killing it", limit)
                self._kill_group()
                self.process.wait(timeout=10)
        self._kill_group()
        self._kill_stray_stubs()
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            region.unlink(missing_ok=True)
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None
        self._control.cleanup()

    def _kill_group(self) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _kill_stray_stubs(self) -> None:
        # A hung stub can outlive the server (and leave its group): find it by our prefix.
        for pid in pids_with_cmdline(self.shm_prefix, b"triton_python_backend_stub"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def openai_front_end(
    grpc_url: str, port: int, log_path: Path, *options: str, start_timeout_s: float = 120.0
) -> Iterator[subprocess.Popen]:
    """`tritonspec openai` (with its flags `options`) on `port` in front of the Triton server at
    `grpc_url`, logging to `log_path`: its process once /health answers (any status: 503 while
    Triton is unreachable is an answer), stopped when the block ends."""
    command = [sys.executable, "-m", "client.cli.main", "openai", "--url", grpc_url, "--port", str(port), *options]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise ServerStartError(
                        f"the OpenAI front end did not start; its log ({log_path}):\n{tail}"
                    ) from None
                time.sleep(0.3)
        yield process
    finally:
        process.terminate()
        process.wait(timeout=30)
