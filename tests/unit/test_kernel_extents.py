"""The C kernels trust their extents: a slot past the KV pool, a query with no key or a weight
packed for another K reads or writes out of bounds (a SIGSEGV of the serving process) or
gives NaN. cpu_kernels.py must refuse each such call by name before any C runs. The calls run
in a subprocess, one after another (one torch import for all: 14 processes took 56 s on 2
cores), so a crash or a hang shows as its own case's failure rather than pytest's; the cases
after it run in a fresh process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

# Reads [(case, call)] on stdin and runs each call on fresh inputs, each case's output after
# a line "### case: <case>".
_WORKER = """
import dataclasses, json, sys, torch
from backends.runtime import cpu_kernels as ck
from backends.runtime import linear_kernels as lk
from backends.runtime.lean_lm import LeanCausalLM, Row
from tests.fixtures.lean_models import build
def inputs():
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(64, 2, 2, 16, generator=gen).bfloat16()  # one layer: 64 slots, 2 kv heads of 16
    q = torch.randn(3, 4 * 16, generator=gen).bfloat16()  # 3 queries, 4 heads
    return {"kv": kv, "q": q, "out": None}
def keys(slots, start, length):
    return ck.KeyLists(torch.tensor(slots), torch.tensor(start), torch.tensor(length))
def step_of_tiny_model():
    lm = LeanCausalLM.from_hf(build("llama").to(torch.bfloat16), batch_invariant=True)
    pool = lm.new_pool(capacity_tokens=64)
    pool.admit("s", 3)
    return lm, pool, lm.plan(pool, [Row("s", [1, 2, 3])])
for case, call in json.load(sys.stdin):
    print("### case:", case, flush=True)
    scope = {**globals(), **inputs()}
    try:
        exec(call, scope)
    except ck.KernelArgumentError as e:
        print("refused:", e, flush=True)
    else:
        out = scope["out"]
        print("ran; NaN in the output:", out is not None and bool(out.isnan().any()), flush=True)
"""


BAD_CALLS = {
    "a key slot past the pool": (
        "out = ck.attend(q, kv, keys([0, 1, 10**9], [0, 0, 0], [1, 2, 3]), 4)",
        "slot 1000000000",
    ),
    "no key for any query": ("out = ck.attend(q, kv, keys([0, 1, 2], [0, 0, 0], [0, 0, 0]), 4)", "key_len 0"),
    "no key for one query": ("out = ck.attend(q, kv, keys([0, 1, 2], [0, 0, 0], [1, 0, 3]), 4)", "key_len 0"),
    "a key list past its slots": (
        "out = ck.attend(q, kv, keys([0, 1], [0, 0, 1 << 40], [1, 2, 3]), 4)",
        "key_start \\+ key_len",
    ),
    "a negative key slot": ("out = ck.attend(q, kv, keys([0, 1, -(1 << 40)], [0, 0, 0], [1, 2, 3]), 4)", "slot -"),
    "more queries than key lists": ("out = ck.attend(q, kv, keys([0, 1], [0, 0], [1, 2]), 4)", "2 queries"),
    "rope_store writing past the pool": (
        "ck.rope_store(torch.zeros(3, 8 * 16).bfloat16(), torch.ones(3, 16).bfloat16(), torch.zeros(3, 16).bfloat16(),"
        " kv, torch.tensor([0, 1, 1 << 40]), 4)",
        "slot 1099511627776",
    ),
    "rope tables shorter than the tokens": (
        "ck.rope_store(torch.zeros(3, 8 * 16).bfloat16(), torch.ones(1, 16).bfloat16(), torch.zeros(1, 16).bfloat16(),"
        " kv, torch.tensor([0, 1, 2]), 4)",
        "cos of shape \\[1, 16\\]",
    ),
    "run_layers writing past the pool": (
        "lm, pool, step = step_of_tiny_model()\n"
        "step = dataclasses.replace(step, slots=torch.tensor([0, 1, 1 << 40]))\n"
        "lm.run_layers(0, 2, torch.zeros(3, 64).bfloat16(), pool, step)",
        "slot 1099511627776",
    ),
    "run_layers reading keys past the pool": (
        "lm, pool, step = step_of_tiny_model()\n"
        "bad = step.keys.slots.clone()\n"
        "bad[-1] = 1 << 40\n"
        "step = dataclasses.replace(step, keys=ck.KeyLists(bad, step.keys.start, step.keys.length))\n"
        "lm.run_layers(0, 2, torch.zeros(3, 64).bfloat16(), pool, step)",
        "key slots: slot 1099511627776",
    ),
    "run_layers over more tokens than planned": (
        "lm, pool, step = step_of_tiny_model()\nlm.run_layers(0, 2, torch.zeros(4000, 64).bfloat16(), pool, step)",
        "3\\] slots for 4000 tokens",
    ),
    "run_layers past the model's layers": (
        "lm, pool, step = step_of_tiny_model()\nlm.run_layers(1, 9, torch.zeros(3, 64).bfloat16(), pool, step)",
        "layers 1 to 9 of 2",
    ),
    "a packed weight of another K": (
        "packed = lk.pack_linear(torch.randn(64, 32).bfloat16())\n"
        "out = lk.packed_linear(torch.randn(2, 1 << 20).bfloat16(), packed, 64)",
        "64 outputs x K 1048576",
    ),
    "a bias shorter than the outputs": (
        "packed = lk.pack_linear(torch.randn(64, 32).bfloat16())\n"
        "out = lk.packed_linear(torch.randn(2, 32).bfloat16(), packed, 64, bias=torch.zeros(1).bfloat16())",
        "bias of 1 values for 64 outputs",
    ),
}


def _run_cases(cases: list[str]) -> dict[str, tuple[str, str]]:
    """{case: (how the worker fared, the case's stdout)} for the cases one worker started; a
    case that crashed or hung the worker is the last it started."""
    stdin = json.dumps([(case, BAD_CALLS[case][0]) for case in cases])
    try:  # a call past its extents may also hang (a thread waiting on memory it never gets)
        done = subprocess.run(
            [sys.executable, "-c", _WORKER], input=stdin, cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        stdout, failed = done.stdout, done.returncode != 0
        ending = f"exit {done.returncode}: {done.stderr[-2000:]}"
    except subprocess.TimeoutExpired as hung:
        stdout, failed, ending = (hung.stdout or b"").decode(), True, "hung for 120 s"
    runs = re.split(r"^### case: (.*)\n", stdout, flags=re.M)[1:]  # case, stdout, case, ...
    outcomes = {case: ("ok", out) for case, out in zip(runs[::2], runs[1::2])}
    if failed or not runs:
        outcomes[runs[-2] if runs else cases[0]] = (ending, runs[-1] if runs else "")
    return outcomes


@pytest.fixture(scope="module")
def outcomes() -> dict[str, tuple[str, str]]:
    """Every case's outcome: the cases after one that crashed or hung run in a fresh worker."""
    results: dict[str, tuple[str, str]] = {}
    while todo := [case for case in BAD_CALLS if case not in results]:
        results |= _run_cases(todo)
    return results


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_a_call_the_kernels_would_run_out_of_bounds_is_refused_by_name(case, outcomes):
    ending, stdout = outcomes[case]
    assert ending == "ok", f"the bad call crashed or hung the process ({ending})"
    assert stdout.startswith("refused:"), f"the bad call ran: {stdout}"
    assert re.search(BAD_CALLS[case][1], stdout), stdout
