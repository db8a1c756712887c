"""How many threads a server process computes with, and which of its threads runs parallel CPU
work: the one that runs the forwards.

How many: the CPUs the process may really use, not the host's core count. `choose_threads`
takes the smallest of the affinity mask (taskset, a cpuset) and the cgroup's CPU quota (v2
`cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`: what `docker run --cpus 1` sets), and an
explicit count first (`tritonspec serve --threads N`, which the launcher hands every model as
TRITONSPEC_THREADS, else OMP_NUM_THREADS). A team larger than the CPUs granted is throttled or
time-shared, and every parallel region then waits for its slowest thread.

Which thread: GNU OpenMP (what torch and the runtime's C kernels use) keeps a team of worker threads for
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

import contextlib
import ctypes
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from . import THREADS_ENV

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuQuota:
    cpus: float  # quota / period: CPUs' worth of time per period
    source: str  # the file that set it


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str  # what was chosen and why, for the log: "1 thread: affinity 0-1, cgroup quota 1 CPU (...)"


class ThreadCountError(ValueError):
    """A thread count that is not a positive integer (TRITONSPEC_THREADS, OMP_NUM_THREADS)."""


def _cpu_list(cpus: Collection[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5", as taskset and cpuset files write it."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def _quota_in(directory: Path, v2: bool) -> CpuQuota | None:
    """The quota one cgroup directory sets, None where it sets none (or cannot be read)."""
    try:
        if v2:  # "max 100000" or "QUOTA PERIOD"
            quota, period = (directory / "cpu.max").read_text().split()[:2]
            source = directory / "cpu.max"
        else:  # -1: no quota
            quota = (directory / "cpu.cfs_quota_us").read_text().strip()
            period = (directory / "cpu.cfs_period_us").read_text().strip()
            source = directory / "cpu.cfs_quota_us"
    except (OSError, ValueError):
        return None
    if quota in ("max", "-1") or int(period) <= 0:
        return None
    return CpuQuota(int(quota) / int(period), str(source))


def cgroup_quota(proc_cgroup: str, mountinfo: str, root: Path = Path("/")) -> CpuQuota | None:
    """The tightest CPU quota on this process's cgroup and its ancestors, v1 and v2 both.

    `proc_cgroup` and `mountinfo`: the text of /proc/self/cgroup and /proc/self/mountinfo;
    `root`: where the paths they name are read from (a test's fake tree). A cgroup's path is
    relative to its hierarchy's root, and a mount may show only part of the hierarchy (a
    container sees its own cgroup as the mount's root), so the path is taken relative to the
    mount's own root."""
    paths: dict[str, str] = {}  # "v2" or a v1 controller -> this process's cgroup in it
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            paths["v2"] = parts[2]
        for controller in parts[1].split(","):
            paths.setdefault(controller, parts[2])
    found: list[CpuQuota] = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        mount_root, mount_point = fields[3], fields[4]
        fstype, *rest = line.split(" - ", 1)[1].split()
        options = rest[1].split(",") if len(rest) > 1 else []
        if fstype == "cgroup2" and "v2" in paths:
            path, v2 = paths["v2"], True
        elif fstype == "cgroup" and "cpu" in options and "cpu" in paths:
            path, v2 = paths["cpu"], False
        else:
            continue
        relative = os.path.relpath(path, mount_root)
        top = root / mount_point.lstrip("/")
        directory = top if relative.startswith("..") else top / relative
        while True:  # a quota on any ancestor up to the mount limits this cgroup too
            quota = _quota_in(directory, v2)
            if quota is not None:
                found.append(quota)
            if directory == top:
                break
            directory = directory.parent
    return min(found, key=lambda q: q.cpus, default=None)


def _positive(name: str, value: str) -> int:
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ThreadCountError(f"{name} must be a positive whole number of threads, got {value!r}")
    return count


def choose_threads(
    affinity: Collection[int],
    quota: CpuQuota | None,
    asked: str | None = None,
    omp_num_threads: str | None = None,
    torch_default: int | None = None,
) -> ThreadChoice:
    """The team size for this process's forwards: `asked` (TRITONSPEC_THREADS) or OMP_NUM_THREADS
    where set, else the CPUs of the affinity mask, fewer where the cgroup quota grants fewer
    (rounded down, at least 1: a thread beyond the quota is throttled, and the team's other
    threads wait for it at every region) or where torch's own default is fewer (its physical
    cores on a host whose CPUs are hyperthreads)."""
    cpus = f"affinity {_cpu_list(affinity)}"
    limit = f"cgroup quota {quota.cpus:g} CPU ({quota.source})" if quota else "no cgroup quota"
    for name, value in ((THREADS_ENV, asked), ("OMP_NUM_THREADS", omp_num_threads)):
        if value:
            count = _positive(name, value.split(",")[0])  # OMP_NUM_THREADS may list nested levels
            return ThreadChoice(count, f"{count} thread{'s' * (count > 1)}: {name}={value} ({cpus}, {limit})")
    count = len(affinity)
    if quota is not None:
        count = min(count, max(1, math.floor(quota.cpus + 1e-6)))
    reason = f"{cpus}, {limit}"
    if torch_default is not None and torch_default < count:
        count, reason = torch_default, f"torch's default ({reason})"
    return ThreadChoice(count, f"{count} thread{'s' * (count > 1)}: {reason}")


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


@functools.cache
def decided() -> ThreadChoice:
    """This process's choice (logged once): `choose_threads` on what it may really use. First
    called before `serial_elsewhere` changes torch's count, which it reads."""
    quota = cgroup_quota(_read("/proc/self/cgroup"), _read("/proc/self/mountinfo"))
    env = os.environ
    choice = choose_threads(
        os.sched_getaffinity(0), quota, env.get(THREADS_ENV), env.get("OMP_NUM_THREADS"), torch.get_num_threads()
    )
    log.info("%s", choice.reason)
    return choice


def cores() -> int:
    """The threads this process's forwards run on (`decided`)."""
    return decided().threads


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
    decided()  # torch's own count first, before it is 1
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
        log.info("%s runs this process's forwards; no GNU OpenMP runtime: torch on %d threads everywhere", name, wanted)
        torch.set_num_threads(wanted)
        return torch.get_num_threads()
    openmp.omp_set_num_threads(wanted)  # this thread's own setting, after torch's
    got = torch.get_num_threads()
    if got != wanted:
        log.warning("%s runs the forwards on %d thread(s), not %d", name, got, wanted)
    else:
        log.info("%s runs this process's forwards on %d threads; torch on its other threads on one", name, got)
    if got > 1 and os.environ.get(ADAPT_ENV, "1") != "0":
        _teams.team = Team(openmp, got)
    return got


# Shared cores. With another process busy on one of the team's cores, that core's team thread
# runs only part of the time, and every parallel region (hundreds a forward) waits for it at
# its barrier: measured on the 2-core host (SmolLM2-135M bf16, 1-token steps), one busy
# process pinned to a core slowed a step from 21 ms to a median of 71-266 ms, where one
# thread alone takes ~30 ms. So the forward thread watches its team: the time its threads
# spent runnable but waiting for a CPU (the run-queue wait, /proc/<tid>/schedstat's second
# field, which a sleeping thread does not accumulate). When they wait more than STARVED of
# their forward time in two windows running, the team shrinks by a thread; while it is smaller
# than it may be, it grows back by one once the CPUs it may use had half a CPU idle over the
# last PROBE_MIN_S (/proc/stat), and a try that starves at once doubles the wait before the
# next (up to PROBE_MAX_S). Only engines whose every step is the same bits on any number of
# threads (lean_lm's thread_invariant: each thread computes whole rows or outputs, the same
# way) are governed, so the output never depends on what else ran.
ADAPT_ENV = "TRITONSPEC_ADAPT_THREADS"  # "0": keep the team at its size whatever else runs
WINDOW_S = 0.05  # forward time one look at the run-queue wait covers
# Run-queue wait per team thread and second of forward time that counts as starved. A wait w
# of each of 2 threads stretches a barrier-bound step to about T2 / (1 - 2w), and one thread
# alone takes T1 <= 2 T2, so past w = 0.25 one thread is faster even for a team that scales
# perfectly. A busy process pinned to a core, or another's test suite, made it 0.26-1.9.
STARVED = 0.25
SPARE_CPU = 0.5  # idle CPUs' worth that lets the team try a thread more
PROBE_MIN_S, PROBE_MAX_S = 0.5, 16.0


@dataclass
class TeamSize:
    """The team size decision alone (the readings are handed in), so it can be tested."""

    full: int
    size: int
    probe_every_s: float = PROBE_MIN_S
    next_probe: float = 0.0
    trying: bool = False  # the last change was a try at a thread more
    starved: int = 0  # windows in a row whose wait was past STARVED

    def update(self, waited: float, idle_cpus: float | None, now: float) -> str | None:
        """`waited`: the team's run-queue wait per thread and second of forward time over the
        last window; `idle_cpus`: the CPUs' worth idle since the last call (None: not read,
        as no try is due). Returns why the size changed, or None."""
        self.starved = self.starved + 1 if waited > STARVED else 0
        if self.size > 1 and (self.starved >= 2 or self.starved and self.trying):  # one window may be a blip
            if self.trying:  # the try starved at once: wait longer before the next
                self.probe_every_s = min(2 * self.probe_every_s, PROBE_MAX_S)
            self.size, self.trying, self.starved = self.size - 1, False, 0
            self.next_probe = now + self.probe_every_s
            return f"its threads waited {waited:.0%} of their forward time for a CPU"
        if self.trying and not self.starved:  # a window at the new size without starving: it holds
            self.trying, self.probe_every_s = False, PROBE_MIN_S
        if self.size < self.full and now >= self.next_probe and idle_cpus is not None:
            self.next_probe = now + PROBE_MIN_S
            if idle_cpus >= SPARE_CPU:
                self.size, self.trying, self.starved = self.size + 1, True, 0
                return f"{idle_cpus:.1f} CPUs idle since the last look"
        return None

    def try_due(self, now: float) -> bool:
        return self.size < self.full and now >= self.next_probe


def _run_queue_s(tids: Collection[int]) -> float:
    """Seconds these threads of this process have spent runnable but not running."""
    total = 0
    for tid in tids:
        try:
            total += int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended
    return total / 1e9


def _idle_s(cpus: Collection[int]) -> float:
    """Seconds these CPUs have been idle since boot (/proc/stat: idle + iowait, in clock ticks)."""
    ticks = 0
    for line in _read("/proc/stat").splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks += int(values[3]) + int(values[4])
    return ticks / os.sysconf("SC_CLK_TCK")


class Team:
    """The forward thread's OpenMP team, resized between forwards as `TeamSize` decides."""

    def __init__(self, openmp: ctypes.CDLL, full: int) -> None:
        self.openmp, self.sizes = openmp, TeamSize(full, full)
        self.cpus = os.sched_getaffinity(0)
        self.tids = self._members()
        self._start_window()
        self._start_idle(time.monotonic())

    def _members(self) -> list[int]:
        """The native ids of this thread's team at its current size: libgomp keeps the same
        worker threads for a thread's regions, so one region of our own names them."""
        seen: set[int] = set()
        record = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: seen.add(threading.get_native_id()))
        self.openmp.GOMP_parallel(record, None, self.sizes.size, 0)
        return sorted(seen)

    def _start_window(self) -> None:
        self.forward_s, self.waited_s = 0.0, _run_queue_s(self.tids)

    def _start_idle(self, now: float) -> None:
        self.idle_at, self.idle_s = now, _idle_s(self.cpus)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.forward_s += time.perf_counter() - start
        if self.forward_s >= WINDOW_S or self.sizes.try_due(time.monotonic()):
            self._look()

    def _look(self) -> None:
        now = time.monotonic()
        waited = (_run_queue_s(self.tids) - self.waited_s) / (max(self.forward_s, 1e-6) * self.sizes.size)
        idle_cpus = None
        if self.sizes.try_due(now) and now - self.idle_at >= PROBE_MIN_S:
            idle = _idle_s(self.cpus)
            idle_cpus = (idle - self.idle_s) / (now - self.idle_at)
            self.idle_at, self.idle_s = now, idle
        before = self.sizes.size
        why = self.sizes.update(waited, idle_cpus, now)
        if why is not None:
            self.openmp.omp_set_num_threads(self.sizes.size)
            self.tids = self._members()
            self._start_idle(now)  # idle time at the old size says nothing about the new one
            log.info("forwards on %d thread(s), not %d: %s", self.sizes.size, before, why)
        self._start_window()


class _Teams(threading.local):
    team: Team | None = None


_teams = _Teams()


@contextlib.contextmanager
def governed(thread_invariant: bool) -> Iterator[None]:
    """Around a forward: on a thread `own_cores` set up, resize its team as the CPUs allow
    between forwards; elsewhere, or for an engine whose bits could depend on the thread count,
    nothing."""
    team = _teams.team if thread_invariant else None
    if team is None:
        yield
        return
    with team.step():
        yield


def started_pool(workers: int, prefix: str) -> ThreadPoolExecutor:
    """A thread pool with all `workers` threads started now rather than one by one as load
    peaks: a server's thread count (and each thread's stack and allocator arena) is then set
    at load, and its memory does not climb for hours after warm-up (measured: ~2 MB each new
    thread, threads still starting 30 minutes into a soak)."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=prefix)
    all_started = threading.Barrier(workers + 1)
    for _ in range(workers):  # no thread is idle until all wait here, so each submit starts one
        pool.submit(all_started.wait)
    all_started.wait()
    return pool


def forward_thread(prefix: str) -> ThreadPoolExecutor:
    """A one-thread executor for this process's forwards, the only thread whose CPU work runs
    in parallel (the calling thread's runs on one from now on)."""
    serial_elsewhere()
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=prefix, initializer=own_cores)
