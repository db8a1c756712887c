"""Which thread of a server process runs parallel CPU work: the one that runs the forwards.

GNU OpenMP (what torch and the runtime's C kernels use) keeps a team of worker threads for
every thread that starts a parallel region, and once the process holds more such threads than
there are cores, every team's workers stop spinning between regions and sleep: each of a
forward's hundreds of regions then waits for a wake-up. One parallel torch op on any other
thread (a request thread concatenating hidden states, the thread that builds responses) is
enough, and it lasts for the life of the process. Measured on the 2-core host, SmolLM2-135M
bf16: a forward of 9 tokens on a worker thread took 8.3-8.8 ms, and 16.4-21.2 ms once the main
thread had run one parallel op; EAGLE-3 tree steps through `generate` verified in 15.4-19.7 ms
instead of 8.4-10.2 (and drafted in 4.1-6.1 ms instead of 3.2-4.3).

So the thread that runs a process's forwards keeps every core torch would use, and every other
thread runs torch single-threaded. torch applies its process-wide thread count to a thread the
first time that thread uses it; `serial_elsewhere` sets that count to 1, and `own_cores` gives the
calling thread its own count back afterwards through OpenMP's per-thread setting.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@functools.cache
def cores() -> int:
    """The threads torch would use in this process (OMP_NUM_THREADS, else the CPUs it may
    run on), as it was before `serial_elsewhere`."""
    return torch.get_num_threads()


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime torch loaded (the copy in torch's own directory first), or None
    where there is none: then nothing here changes torch's threads, as a thread's own count
    could not be given back."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "/libgomp" in line}
    mine = str(Path(torch.__file__).parent)
    ordered = sorted(paths, key=lambda path: (not path.startswith(mine), path))
    return ctypes.CDLL(ordered[0]) if ordered else None


def serial_elsewhere() -> None:
    """From now on a thread that has not used torch yet runs its ops on one thread, and so
    does the calling thread."""
    cores()
    if _openmp() is not None:
        torch.set_num_threads(1)


def own_cores() -> int:
    """Make the calling thread the process's one parallel thread: its torch ops and kernels
    use `cores()` threads, every other thread's one. Returns the threads it got."""
    wanted = cores()
    torch.get_num_threads()  # torch's setup of this thread on first use, which would undo ours
    serial_elsewhere()
    openmp = _openmp()
    name = threading.current_thread().name
    if openmp is None:
        log.info("%s runs this process's forwards; no GNU OpenMP runtime, torch's threads left as set", name)
        return torch.get_num_threads()
    openmp.omp_set_num_threads(wanted)  # this thread's own setting, after torch's
    got = torch.get_num_threads()
    if got != wanted:
        log.warning("%s runs the forwards on %d thread(s), not %d", name, got, wanted)
    else:
        log.info("%s runs this process's forwards on %d threads; torch on its other threads on one", name, got)
    return got


def forward_thread(prefix: str) -> ThreadPoolExecutor:
    """A one-thread executor for this process's forwards, the only thread whose CPU work runs
    in parallel (the calling thread's runs on one from now on)."""
    serial_elsewhere()
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=prefix, initializer=own_cores)
