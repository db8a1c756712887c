"""Building and loading the lean runtime's C kernels (``cpu_kernels.c``; their Python wrappers are
``cpu_kernels.py`` and, for the linear layers, ``linear_kernels.py``): compiled once per machine
with gcc at first use (about a second) into ``~/.cache/tritonspec/kernels/`` under a name that
hashes the source, the compiler, the flags and the CPU, written to a temporary name and renamed,
so concurrent model instances never load a half-written file; loaded only when this user owns
the file and no other user may write it; and the functions' ctypes signatures. Beside the build,
the weight shapes whose row invariance was probed and held.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from .model_store import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
# Extra compiler flags, e.g. "-mno-avx512f" to build (and test) the AVX2 kernels on an AVX-512 CPU
FLAGS_ENV = "TRITONSPEC_KERNEL_FLAGS"


class KernelUnavailable(RuntimeError):
    """The lean runtime's CPU kernels cannot be built or loaded on this machine."""


def _cpu_flags() -> str:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in cpuinfo.splitlines() if line.startswith("flags")), platform.processor())


def row_invariant_shapes() -> set[str]:
    """The weight shapes whose row invariance on this build of the kernels was probed and
    held (``lean_lm._PackedLinear.row_invariant``), kept beside the build: the probe is
    deterministic for one build on one CPU, and took 9 s for Qwen2.5-1.5B's LM head alone on
    the 2-core Zen 1 host, at every start."""
    try:
        return set(_record().read_text().splitlines())
    except OSError:
        return set()


def remember_row_invariant(shape: str) -> None:
    try:
        with open(_record(), "a") as record:  # one short appended line: concurrent loads do not mix
            record.write(shape + "\n")
    except OSError as e:  # a read-only cache: the next start probes again
        log.info("row invariance of %s not remembered: %s", shape, e)


def _record() -> Path:
    return _built(SOURCE).with_suffix(".row-invariant")


@cache
def library() -> ctypes.CDLL:
    """The kernels, built once per source, compiler, flags and CPU into the cache, loaded with
    their signatures."""
    lib = ctypes.CDLL(str(_built(SOURCE)))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.attend.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64]
    lib.attend.argtypes += [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.attend.restype = ctypes.c_int
    lib.attend_bf16_dots.argtypes = []
    lib.attend_bf16_dots.restype = ctypes.c_int
    lib.rms_norm.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.rms_norm.restype = ctypes.c_int
    lib.rope_store.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    lib.rope_store.restype = ctypes.c_int
    lib.silu_mul.argtypes = [ptr, i64, ptr, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    lib.silu_mul.restype = ctypes.c_int
    lib.packed_linear_available.argtypes = []
    lib.packed_linear_available.restype = ctypes.c_int
    lib.pack_linear.argtypes = [ptr, i64, i64, ptr]
    lib.pack_linear.restype = None
    lib.packed_linear.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_int]
    lib.packed_linear.restype = ctypes.c_int
    lib.int8_linear_available.argtypes = []
    lib.int8_linear_available.restype = ctypes.c_int
    lib.int8_linear.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_int]
    lib.int8_linear.restype = ctypes.c_int
    lib.int4_linear_available.argtypes = []
    lib.int4_linear_available.restype = ctypes.c_int
    lib.int4_linear.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_int]
    lib.int4_linear.restype = ctypes.c_int
    f32 = ctypes.c_float
    lib.run_layers.argtypes = [ptr, i64, i64, i64, i64, i64, i64, f32, f32, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr]
    lib.run_layers.argtypes += [ptr, ptr, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.run_layers.restype = ctypes.c_int
    lib.run_layer_attn_in.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, i64, i64, f32, f32, ptr, ptr, ptr, ptr, ptr]
    lib.run_layer_attn_in.argtypes += [ptr, ptr, ptr, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.run_layer_attn_in.restype = ctypes.c_int
    lib.eagle_chain.argtypes = [ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, i64, f32, f32, ptr, ptr, ptr]
    lib.eagle_chain.argtypes += [ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr]
    lib.eagle_chain.argtypes += [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.eagle_chain.restype = ctypes.c_int
    lib.argmax_rows.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr]
    lib.argmax_rows.restype = None
    lib.markov_greedy.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.markov_greedy.restype = ctypes.c_int
    return lib


@cache
def _built(path: Path) -> Path:
    """The shared library of the C source at `path`, built into the cache if not there yet."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise KernelUnavailable("no C compiler (gcc) on PATH to build the lean runtime's CPU kernels")
    if not path.is_file():
        raise KernelUnavailable(
            f"the CPU kernels' C source {path} is missing from this installation "
            "(a package built without its package data): reinstall tritonspec from a complete wheel or checkout"
        )
    source = path.read_bytes()
    flags = (*FLAGS, *os.environ.get(FLAGS_ENV, "").split())
    # -march=native: a cache shared by machines of other CPUs must not hand them this build
    digest = hashlib.sha256(source + " ".join((compiler, *flags, _cpu_flags())).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"cpu_kernels-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        log.info("building the lean runtime's CPU kernels: %s", target)
        with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
            partial = Path(tmp.name)
        try:
            # Bytes, decoded here: gcc quotes names in UTF-8 (and warns on AVX2-only CPUs),
            # and the Triton stub's locale decodes text as ASCII, which failed the model's load.
            done = subprocess.run([compiler, *flags, str(path), "-o", str(partial), "-lm"], capture_output=True)
            if done.returncode != 0:
                errors = done.stderr.decode("utf-8", errors="replace").strip()
                raise KernelUnavailable(f"building {path.name} failed:\n{errors}")
            partial.chmod(0o755)  # whatever the umask: no other user may write what is loaded
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    _check_trusted(target)
    return target


def _check_trusted(library: Path) -> None:
    """Refuse a cached library that someone else could have put there: its name is computable
    from public inputs, so only a file (and folder) owned by this user and writable by no other
    user may be loaded into the serving process."""
    for path in (library, library.parent):
        st = path.stat()
        # Group-writable only for this process's own group (a umask of 002 with a group per user).
        others_write = st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != os.getgid())
        if st.st_uid != os.getuid() or others_write:
            raise KernelUnavailable(
                f"refusing to load {library}: {path} is owned by uid {st.st_uid} with mode {st.st_mode & 0o777:o} "
                f"(this process runs as uid {os.getuid()}; only its own files, writable by no other user, are loaded). "
                "Remove the file, or fix its owner and mode"
            )
