"""backends/runtime/threads.py: only the thread that runs a process's forwards starts OpenMP
teams; how many threads it gets (affinity, cgroup quota, an explicit count); and how its team
shrinks while another process starves it.

Cases that change OpenMP settings run in a fresh interpreter: the settings are per process
and would leak into the rest of the suite."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from backends.runtime import threads

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import json, os, threading, torch
from backends.runtime import threads

def thread_count():
    return len(os.listdir("/proc/self/task"))

if MODE == "no openmp":  # a torch on another OpenMP runtime (or none): threads left as they are
    threads._openmp = lambda: None
if MODE in ("executor", "no openmp"):
    forward = threads.forward_thread("forward")
    on_forward = lambda f: forward.submit(f).result()
else:  # the calling thread runs the forwards (the verifier and drafter models' main thread)
    threads.own_cores()
    on_forward = lambda f: f()
seen = {"forward": on_forward(torch.get_num_threads)}
if MODE in ("executor", "no openmp"):
    seen["caller"] = torch.get_num_threads()

def other():  # a request thread: one op big enough for torch to run it in parallel
    before = thread_count()
    (torch.randn(4_000_000) * 2).sum()
    seen["other"] = torch.get_num_threads()
    seen["threads started by its op"] = thread_count() - before

t = threading.Thread(target=other)
t.start()
t.join()
on_forward(lambda: (torch.randn(4_000_000) * 2).sum())
seen["forward after"] = on_forward(torch.get_num_threads)
print(json.dumps(seen))
"""


@pytest.fixture(autouse=True)
def the_hosts_threads(monkeypatch):
    """These tests choose threads from the machine: not from the one thread each pytest-xdist
    worker asks for (tests/conftest.py)."""
    monkeypatch.delenv(threads.THREADS_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def run(mode: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", f"MODE = {mode!r}\n{CHECK}"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_a_forward_thread_alone_runs_parallel_work():
    assert run("executor") == {
        "forward": 2,
        "caller": 1,
        "other": 1,
        "threads started by its op": 0,  # no OpenMP team beside the forward thread's
        "forward after": 2,
    }


def test_the_calling_thread_can_own_the_cores():
    assert run("own") == {"forward": 2, "other": 1, "threads started by its op": 0, "forward after": 2}


def test_without_gnu_openmp_nothing_changes():
    # one team per thread as before, rather than a forward thread that could not get its cores back
    seen = run("no openmp")
    assert seen["forward"] == seen["caller"] == seen["other"] == seen["forward after"] == 2


# The CPUs a process may use: affinity, cgroup quota (v1 and v2) and an explicit count.

V1_MOUNT = "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
V2_MOUNT = "40 31 0:37 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def write(root: Path, path: str, text: str) -> None:
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text + "\n")


def v1_group(root: Path, path: str, quota_us: int, period_us: int = 100000) -> None:
    write(root, f"sys/fs/cgroup/cpu{path}/cpu.cfs_quota_us", str(quota_us))
    write(root, f"sys/fs/cgroup/cpu{path}/cpu.cfs_period_us", str(period_us))


def test_a_v1_quota_on_the_process_cgroup(tmp_path):
    v1_group(tmp_path, "", -1)
    v1_group(tmp_path, "/box", 100000)
    quota = threads.cgroup_quota("2:cpuacct,cpu:/box\n1:memory:/other\n", V1_MOUNT, tmp_path)
    assert quota.cpus == 1.0
    assert quota.source == str(tmp_path / "sys/fs/cgroup/cpu/box/cpu.cfs_quota_us")


def test_a_v1_quota_on_an_ancestor_limits_too(tmp_path):
    v1_group(tmp_path, "/outer", 150000)
    v1_group(tmp_path, "/outer/inner", -1)
    assert threads.cgroup_quota("2:cpu,cpuacct:/outer/inner\n", V1_MOUNT, tmp_path).cpus == 1.5
    v1_group(tmp_path, "/outer/inner", 50000, 200000)  # the tightest of the two
    assert threads.cgroup_quota("2:cpu,cpuacct:/outer/inner\n", V1_MOUNT, tmp_path).cpus == 0.25


def test_a_container_sees_its_cgroup_as_the_mount_root(tmp_path):
    # docker without a cgroup namespace: /proc/self/cgroup names the host path, the mount shows only that group
    v1_group(tmp_path, "", 200000)
    mount = "32 31 0:29 /docker/abc /sys/fs/cgroup/cpu ro - cgroup cgroup rw,cpu,cpuacct\n"
    assert threads.cgroup_quota("2:cpu,cpuacct:/docker/abc\n", mount, tmp_path).cpus == 2.0
    # with a cgroup namespace the process sees "/" (or a path outside the mount's root): the mount is its group
    assert threads.cgroup_quota("2:cpu,cpuacct:/\n", mount, tmp_path).cpus == 2.0


def test_a_v2_cpu_max(tmp_path):
    write(tmp_path, "sys/fs/cgroup/cpu.max", "max 100000")
    write(tmp_path, "sys/fs/cgroup/app/cpu.max", "50000 100000")
    quota = threads.cgroup_quota("0::/app\n", V2_MOUNT, tmp_path)
    assert quota.cpus == 0.5 and quota.source.endswith("app/cpu.max")
    write(tmp_path, "sys/fs/cgroup/app/cpu.max", "max 100000")
    assert threads.cgroup_quota("0::/app\n", V2_MOUNT, tmp_path) is None


def test_no_cpu_controller_no_quota(tmp_path):
    # a hybrid host whose v2 hierarchy has no cpu controller (no cpu.max), v1 cpu not mounted
    (tmp_path / "sys/fs/cgroup/app").mkdir(parents=True)
    mounts = V2_MOUNT + "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    assert threads.cgroup_quota("4:memory:/x\n0::/app\n", mounts, tmp_path) is None
    assert threads.cgroup_quota("", "", tmp_path) is None


def test_the_tightest_of_v1_and_v2(tmp_path):
    v1_group(tmp_path, "/box", 300000)
    write(tmp_path, "sys/fs/cgroup/app/cpu.max", "120000 100000")
    mounts = V2_MOUNT.replace("/sys/fs/cgroup ", "/sys/fs/cgroup/unified ") + V1_MOUNT
    write(tmp_path, "sys/fs/cgroup/unified/app/cpu.max", "120000 100000")
    assert threads.cgroup_quota("1:cpu,cpuacct:/box\n0::/app\n", mounts, tmp_path).cpus == 1.2


def quota(cpus: float) -> threads.CpuQuota:
    return threads.CpuQuota(cpus, "/sys/fs/cgroup/cpu.max")


def test_the_choice_takes_the_fewest_cpus():
    assert threads.choose_threads({0, 1}, None) == threads.ThreadChoice(2, "2 threads: affinity 0-1, no cgroup quota")
    one = threads.choose_threads({0, 1}, quota(1.0))
    assert one == threads.ThreadChoice(1, "1 thread: affinity 0-1, cgroup quota 1 CPU (/sys/fs/cgroup/cpu.max)")
    assert threads.choose_threads({0, 1}, quota(1.5)).threads == 1  # a thread past the quota is throttled
    assert threads.choose_threads({0, 1}, quota(0.5)).threads == 1
    assert threads.choose_threads({0, 1}, quota(4)).threads == 2
    assert threads.choose_threads({0, 2, 3, 4, 7}, None).reason == "5 threads: affinity 0,2-4,7, no cgroup quota"
    # torch's default where fewer: its physical cores, on a host whose CPUs are hyperthreads
    assert threads.choose_threads(set(range(16)), None, torch_default=8) == threads.ThreadChoice(
        8, "8 threads: torch's default (affinity 0-15, no cgroup quota)"
    )
    assert threads.choose_threads(set(range(16)), quota(2), torch_default=8).threads == 2


def test_an_explicit_count_wins_and_is_checked():
    assert threads.choose_threads({0, 1}, quota(1), asked="3").threads == 3
    assert threads.choose_threads({0, 1}, None, asked="1", omp_num_threads="2").reason.startswith(
        "1 thread: TRITONSPEC_THREADS=1 (affinity 0-1"
    )
    assert threads.choose_threads({0, 1}, None, omp_num_threads="4,2").threads == 4  # nested levels: the first
    for bad in ("0", "two", "-1"):
        with pytest.raises(threads.ThreadCountError, match="TRITONSPEC_THREADS must be a positive"):
            threads.choose_threads({0, 1}, None, asked=bad)


def v1_cpu_hierarchy() -> Path | None:
    """Where this host's v1 cpu controller is mounted, if this process may make groups in it."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if " - cgroup " in line and "cpu" in line.split(" - ")[1].split()[-1].split(","):
            point = Path(fields[4])
            if os.access(point, os.W_OK):
                return point
    return None


def test_a_process_in_a_one_cpu_cgroup_chooses_one_thread():
    """A real cgroup: a child of the v1 cpu hierarchy granted 1 CPU (what `docker run --cpus 1`
    sets), and a Python process started inside it."""
    hierarchy = v1_cpu_hierarchy()
    if hierarchy is None:
        pytest.skip("no writable cgroup v1 cpu hierarchy here (not root, or cgroups v2 only / read-only, as in CI)")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("this process may run on one CPU only: a 1-CPU quota would change nothing")
    group = hierarchy / f"tritonspec-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
    except OSError as e:
        pytest.skip(f"cannot make a cgroup with a quota in {hierarchy}: {e}")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", threads.THREADS_ENV)}
    env["PYTHONPATH"] = str(ROOT)
    code = "from backends.runtime import threads; print(threads.decided().reason)"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
        )
        assert out.returncode == 0, out.stderr
        reason = out.stdout.strip()
        assert reason.startswith("1 thread: affinity "), reason
        assert f"cgroup quota 1 CPU ({group}/cpu.cfs_quota_us)" in reason
        outside = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert outside.stdout.startswith(f"{len(os.sched_getaffinity(0))} threads: affinity "), outside.stdout
    finally:
        group.rmdir()


# A team starved by other work on its cores shrinks, and grows back when a CPU is spare.


def test_a_starved_team_shrinks_and_a_quiet_one_keeps_its_size():
    sizes = threads.TeamSize(full=2, size=2)
    assert sizes.update(waited=0.02, idle_cpus=None, now=0.0) is None and sizes.size == 2
    assert sizes.update(waited=0.3, idle_cpus=None, now=0.1) is None and sizes.size == 2  # one window: a blip
    assert sizes.update(waited=0.02, idle_cpus=None, now=0.2) is None and sizes.size == 2
    assert sizes.update(waited=0.3, idle_cpus=None, now=0.3) is None
    assert "waited 40% of their forward time" in sizes.update(waited=0.4, idle_cpus=None, now=0.4)
    assert sizes.size == 1
    assert sizes.update(waited=0.9, idle_cpus=None, now=0.2) is None and sizes.size == 1  # never below one


def test_a_shrunk_team_tries_a_thread_more_when_a_cpu_is_spare():
    sizes = threads.TeamSize(full=2, size=2)
    sizes.update(waited=0.5, idle_cpus=None, now=9.95)
    sizes.update(waited=0.5, idle_cpus=None, now=10.0)
    assert not sizes.try_due(10.4) and sizes.try_due(10.5)
    assert sizes.update(waited=0.0, idle_cpus=0.1, now=10.5) is None and sizes.size == 1  # the other core still busy
    assert not sizes.try_due(10.9)  # idle is looked at again half a second later
    assert "0.9 CPUs idle" in sizes.update(waited=0.0, idle_cpus=0.9, now=11.0)
    assert sizes.size == 2 and sizes.trying


def test_a_try_that_starves_at_once_waits_twice_as_long_for_the_next():
    sizes = threads.TeamSize(full=2, size=1)
    for wait in (1.0, 2.0, 4.0, 8.0, 16.0, 16.0):
        now = sizes.next_probe
        sizes.update(waited=0.0, idle_cpus=0.9, now=now)
        assert sizes.size == 2
        sizes.update(waited=0.5, idle_cpus=None, now=now + 0.05)
        assert sizes.size == 1 and sizes.next_probe == now + 0.05 + wait
    sizes.update(waited=0.0, idle_cpus=0.9, now=sizes.next_probe)
    sizes.update(waited=0.01, idle_cpus=None, now=sizes.next_probe + 0.05)  # the try holds: back to the first wait
    assert sizes.size == 2 and not sizes.trying and sizes.probe_every_s == threads.PROBE_MIN_S


def test_a_team_of_four_steps_down_and_up_one_thread_at_a_time():
    sizes = threads.TeamSize(full=4, size=4)
    for size in (3, 2):
        sizes.update(waited=0.3, idle_cpus=None, now=0.0)
        sizes.update(waited=0.3, idle_cpus=None, now=0.0)
        assert sizes.size == size
    sizes.update(waited=0.0, idle_cpus=1.5, now=sizes.next_probe)
    assert sizes.size == 3


GOVERNED = """
import json, logging, os, subprocess, sys, threading, time, torch
logging.basicConfig(level=logging.INFO)
from backends.runtime import threads
threads.own_cores()
team = threads._teams.team
members = len(team.tids)
# The worker on the busy CPU (as a thread-binding runtime or a cpuset would place it): left free,
# the scheduler may move it next to the forward thread, where the team shares one CPU instead.
for tid in team.tids:
    os.sched_setaffinity(tid, {0} if tid == threading.get_native_id() else {1})
# At nice -20 the busy process keeps its CPU when the worker wakes (on a quiet host a busy loop at
# the same priority yields to a waking thread at once, and the team hardly waits).
busy = subprocess.Popen(["nice", "-n", "-20", "taskset", "-c", "1", sys.executable, "-c", "while True: pass"])
try:
    x = torch.randn(512, 512)
    start = time.monotonic()
    while team.sizes.size > 1 and time.monotonic() - start < 60:
        with threads.governed(True):  # parallel work, as a forward's: short, as the team is looked at after it
            for _ in range(5):
                x = (x @ x).clamp(-1, 1)
    with threads.governed(False):  # an engine whose bits could change: never resized
        pass
finally:
    busy.kill()
print(json.dumps({"members": members, "size": team.sizes.size, "torch": torch.get_num_threads(), "team": team.tids}))
"""


def test_a_team_sharing_a_core_with_a_busy_process_shrinks_to_one_thread():
    """A real starved team: 2 threads, the worker on the second CPU beside a busy process that
    outranks it (the forwards then ran ~15x slower here, the collapse a shared core causes)."""
    if not {0, 1} <= os.sched_getaffinity(0) or not shutil.which("taskset"):
        pytest.skip("needs CPUs 0 and 1, and taskset")
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the busy process at nice -20")
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT), "GOMP_SPINCOUNT": "10000"}
    env.pop(threads.ADAPT_ENV, None)
    out = subprocess.run(  # on CPUs 0 and 1 alone, so the busy one is half of what the team may use
        ["taskset", "-c", "0,1", sys.executable, "-c", GOVERNED], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["members"] == 2  # the forward thread and its one worker, named by a region of our own
    assert seen["size"] == seen["torch"] == 1 and len(seen["team"]) == 1
    assert "forwards on 1 thread(s), not 2: its threads waited" in out.stderr


def test_adapting_can_be_turned_off():
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT), threads.ADAPT_ENV: "0"}
    code = "from backends.runtime import threads; threads.own_cores(); print(threads._teams.team)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr


def test_a_started_pool_holds_all_its_threads_from_the_start():
    pool = threads.started_pool(6, "started-pool-test")
    try:
        named = [t for t in threading.enumerate() if t.name.startswith("started-pool-test")]
        assert len(named) == 6
        # Work submitted later runs on those threads: none is added however many wait at once.
        gate = threading.Event()
        futures = [pool.submit(gate.wait) for _ in range(12)]
        gate.set()
        assert all(f.result(timeout=10) for f in futures)
        assert len([t for t in threading.enumerate() if t.name.startswith("started-pool-test")]) == 6
    finally:
        pool.shutdown()
