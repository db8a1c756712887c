"""Decoding through a real server on a shared or a limited CPU: tokens/s quiet, with a busy
process pinned to one core, and (`--cgroup`) inside a cgroup granted 1 CPU.

    .venv/bin/python scripts/bench_shared_core.py [--repeats 3] [--prompts 2]
        [--max-tokens 128] [--speculative ngram] [--fixed] [--cgroup]

On a host shared with other jobs, run it under the lock they share (`flock LOCKFILE ...`).

Through a server rather than in process: what a busy core costs depends on every process that
serves a request (tritonserver, the `speculative` model's, the verifier's), not on the forward
alone. Each point decodes the first `--prompts` benchmark prompts (client/data/bench_prompts.json,
one per category) with `ignore_eos`, `--max-tokens` each, greedy; tokens/s is their tokens over
their seconds (prefill included), as `tritonspec bench` counts them.

- adaptive (the server as it is): quiet and busy points, `--repeats` times. Busy:
  `taskset -c LAST python -c 'while True: pass'`, LAST the last CPU this process may use (on
  a bigger host, `taskset -c 0,1 python scripts/bench_shared_core.py ...` is the 2-core case).
- `--fixed`: beside it, a server with TRITONSPEC_ADAPT_THREADS=0, its team never shrinking
  (the server before backends/runtime/threads.py's Team).
- `--cgroup`: then three servers, each started inside its own child of the cgroup v1 cpu
  hierarchy with a 1-CPU quota (what `docker run --cpus 1` sets; needs root and a writable
  hierarchy): one choosing its threads, one with `--threads 1`, one with `--threads 2`, quiet.

The servers of a block are up together (an idle one takes no CPU) and each point measures
them one after the other, so their ratios compare measurements minutes apart at most.

Every point's outputs, speculative ones included, are checked against the first quiet plain
point's: a team that changed size must not change a bit (the lean runtime's bf16 path is
thread invariant, and batch invariant, so speculative output is plain output). The machine may be
shared: hold the lock, and read the spread (min-max over the repeats) beside the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from backends.runtime.threads import ADAPT_ENV  # noqa: E402
from client.api.triton import grpc_generate  # noqa: E402
from client.cli.bench import load_prompts, method_config  # noqa: E402
from client.cli.launcher import RepositoryOverrides, TritonServer  # noqa: E402

# the servers in 1-CPU cgroups: label suffix, --threads
CGROUP_SERVERS = (("", None), ("-threads-1", 1), ("-threads-2", 2))


def busy_core() -> subprocess.Popen:
    cpu = max(os.sched_getaffinity(0))
    return subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c", "while True: pass"])


@contextlib.contextmanager
def one_cpu_cgroup(name: str) -> Iterator[tuple[Path, Path]]:
    """A fresh child of the v1 cpu hierarchy with a quota of 1 CPU (100 ms every 100 ms), and
    the group this process is in there (to go back to)."""
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    points = [line.split()[4] for line in mounts if " - cgroup " in line and "cpu" in line.split()[-1].split(",")]
    if not points:
        raise SystemExit("--cgroup: no cgroup v1 cpu hierarchy is mounted here")
    mine = next(line.split(":", 2)[2] for line in open("/proc/self/cgroup") if "cpu" in line.split(":")[1].split(","))
    home = Path(points[0]) / mine.strip().lstrip("/")
    group = Path(points[0]) / f"tritonspec-bench-{os.getpid()}-{name}"
    try:
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
    except OSError as e:
        raise SystemExit(f"--cgroup: cannot make a cgroup with a quota in {points[0]}: {e}") from e
    try:
        yield group, home
    finally:
        for _ in range(50):  # the server's processes may take a moment to leave it
            with contextlib.suppress(OSError):
                group.rmdir()
                break
            time.sleep(0.2)


@contextlib.contextmanager
def server(
    args, label: str, port: int, threads: int | None = None, adapt: bool = True, in_cgroup: bool = False
) -> Iterator[TritonServer]:
    """A server of the target (and `--speculative`'s drafter) with `threads` / `adapt`, or
    inside a 1-CPU cgroup of its own."""
    with contextlib.ExitStack() as stack:
        groups = stack.enter_context(one_cpu_cgroup(label)) if in_cgroup else None
        yield stack.enter_context(_started(args, label, port, threads, adapt, groups))


@contextlib.contextmanager
def _started(args, label: str, port: int, threads: int | None, adapt: bool, groups: tuple[Path, Path] | None):
    overrides = RepositoryOverrides(common={"model": args.model, "dtype": "bfloat16"})
    if args.speculative:
        config = method_config(args.speculative)
        overrides.per_model["drafter"] = {"speculative_config": json.dumps(config)}
    log_path = args.out / f"server-{label}.log"
    log_path.unlink(missing_ok=True)
    srv = TritonServer.on_port(port, overrides, log_path, threads)
    saved = dict(os.environ)
    os.environ[ADAPT_ENV] = "1" if adapt else "0"  # the launcher hands the server this environment
    try:
        if groups is not None:  # the server's processes are born in the group; this one leaves it after
            (groups[0] / "cgroup.procs").write_text(str(os.getpid()))
        print(f"[{label}] starting the server (log {log_path})", flush=True)
        srv.start()
    finally:
        if groups is not None:
            (groups[1] / "cgroup.procs").write_text(str(os.getpid()))
        os.environ.clear()
        os.environ.update(saved)
    try:
        chosen = sorted(set(re.findall(r"\d+ threads?: [^\n]*", log_path.read_text())))
        for line in chosen:
            print(f"[{label}] server: {line}", flush=True)
        yield srv
        changes = re.findall(r"forwards on \d+ thread\(s\), not \d+: [^\n]*", log_path.read_text())
        print(f"[{label}] the team changed size {len(changes)} times" + (f", e.g. {changes[0]}" if changes else ""))
    finally:
        srv.stop()


def decode(url: str, prompts: list[str], max_tokens: int, draft: bool) -> tuple[float, list[list[int]]]:
    """tokens/s over the prompts, and their output ids."""
    extra = {} if draft else {"num_draft_tokens": 0}
    runs = [grpc_generate(url, p, max_tokens=max_tokens, ignore_eos=True, timeout_s=600, **extra) for p in prompts]
    return sum(r.num_output_tokens for r in runs) / sum(r.seconds for r in runs), [r.output_ids for r in runs]


class Points:
    """tokens/s per (server, condition, mode), every output checked against the first quiet one's."""

    def __init__(self, args, prompts: list[str]) -> None:
        self.args, self.prompts = args, prompts
        self.modes = ["plain"] + ([args.speculative] if args.speculative else [])
        self.rates: dict[tuple, list[float]] = {}
        self.reference: list[list[int]] | None = None  # the first point's outputs
        self.differs: set[tuple] = set()

    def measure(self, servers: list[tuple[str, TritonServer]], condition: str) -> None:
        """One point of every server, one after the other, under `condition` (quiet or busy)."""
        busy = busy_core() if condition == "busy" else None
        try:
            time.sleep(3.0)
            for label, srv in servers:
                # ~1 s of decoding first: a team shrunk in a busy point grows back within ~1 s of it ending
                grpc_generate(srv.grpc_url, "warm up", max_tokens=128, ignore_eos=True, num_draft_tokens=0)
                for mode in self.modes:
                    rate, outputs = decode(srv.grpc_url, self.prompts, self.args.max_tokens, mode != "plain")
                    self.rates.setdefault((label, condition, mode), []).append(rate)
                    self.reference = self.reference or outputs
                    if outputs != self.reference:  # speculative ones too: lossless is the same bits
                        self.differs.add((label, condition, mode))
                    print(f"[{label}] {condition:5s} {mode:6s} {rate:6.1f} tok/s", flush=True)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()

    def cell(self, key: tuple) -> str:
        rates = self.rates.get(key)
        if not rates:
            return "-"
        return f"{statistics.median(rates):.1f} ({min(rates):.1f}-{max(rates):.1f})"

    def ratio(self, key: tuple, base: tuple) -> str:
        if not self.rates.get(key) or not self.rates.get(base):
            return "-"
        ratios = sorted(a / b for a, b in zip(self.rates[key], self.rates[base]))  # repeat by repeat
        return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2, help="benchmark prompts per point (one per category)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--speculative", metavar="METHOD", help="also decode with this method (e.g. ngram)")
    parser.add_argument("--fixed", action="store_true", help=f"also the server with {ADAPT_ENV}=0")
    parser.add_argument("--cgroup", action="store_true", help="also servers inside a 1-CPU cgroup quota")
    parser.add_argument("--port", type=int, default=18600)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_shared_core"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    _, by_category = load_prompts()
    points = Points(args, [ps[0] for ps in list(by_category.values())[: args.prompts]])
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(
        f"{cpu}, CPUs {sorted(os.sched_getaffinity(0))}; {args.model} bf16, {len(points.prompts)} prompts x "
        f"{args.max_tokens} tokens a point, {args.repeats} repeats",
        flush=True,
    )

    blocks = [[("adaptive", {})] + ([("fixed", {"adapt": False})] if args.fixed else [])]
    conditions = [("quiet", "busy")]
    if args.cgroup:
        blocks.append([(f"cgroup{n}", {"threads": threads, "in_cgroup": True}) for n, threads in CGROUP_SERVERS])
        conditions.append(("quiet",))
    for block, block_conditions in zip(blocks, conditions):
        with contextlib.ExitStack() as stack:
            servers = [
                (label, stack.enter_context(server(args, label, args.port + 10 * i, **kw)))
                for i, (label, kw) in enumerate(block)
            ]
            for _ in range(args.repeats):
                for condition in block_conditions:
                    points.measure(servers, condition)

    print(f"\ntokens/s, median (min-max) of {args.repeats} repeats; ratios repeat by repeat")
    for mode in points.modes:
        for label, _ in blocks[0]:
            quiet, busy = (label, "quiet", mode), (label, "busy", mode)
            print(
                f"{mode:6s} {label:9s} quiet {points.cell(quiet)}  busy core {points.cell(busy)}  "
                f"busy/quiet {points.ratio(busy, quiet)}"
            )
        if args.fixed:
            adaptive, fixed = ("adaptive", "quiet", mode), ("fixed", "quiet", mode)
            print(f"{mode:6s} quiet adaptive/fixed {points.ratio(adaptive, fixed)}")
        if args.cgroup:
            one = ("cgroup-threads-1", "quiet", mode)
            for label, _ in blocks[1]:
                key = (label, "quiet", mode)
                print(f"{mode:6s} 1-CPU quota {label:16s} {points.cell(key)}  vs --threads 1 {points.ratio(key, one)}")
    same = (
        "every output the same as the first quiet plain point's"
        if not points.differs
        else f"DIFFERENT: {points.differs}"
    )
    print(same)


if __name__ == "__main__":
    main()
