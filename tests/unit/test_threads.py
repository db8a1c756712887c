"""Only the thread that runs a process's forwards starts OpenMP teams (backends/runtime/threads.py).

Each case runs in a fresh interpreter with two OpenMP threads: the settings are per process
and would leak into the rest of the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
