"""How long `tritonspec serve` takes to become ready, and the CPU its processes spent getting there.

Launches the command line given after `--` (in its own session), polls /v2/health/ready on
--port, then sums user + system time over every process of the tree (/proc/<pid>/stat) and
prints the total and each process's share, then kills the tree. For a before/after comparison
run it alternately from both checkouts (PYTHONPATH=<checkout> makes the other one's code the
one imported), alone on a quiet machine:

    .venv/bin/python scripts/server_start.py --port 18000 -- .venv/bin/tritonspec serve \
        --http-port 18000 --grpc-port 18001 --metrics-port 18002 [--model DIR --dtype float32]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

TICK = os.sysconf("SC_CLK_TCK")


def children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = open(f"/proc/{name}/stat").read()
            except OSError:
                continue
            kids.setdefault(int(stat[stat.rfind(")") + 2 :].split()[1]), []).append(int(name))
    return kids


def tree(root: int) -> list[int]:
    kids, found, todo = children(), [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += kids.get(pid, [])
    return found


def cpu_s(pid: int) -> tuple[float, str]:
    """utime + stime (+ waited-for children's) of a process, and its command line."""
    stat = open(f"/proc/{pid}/stat").read()
    command = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    return sum(int(x) for x in stat[stat.rfind(")") + 2 :].split()[11:15]) / TICK, command


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def ready(port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1).status == 200
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8000, help="the server's HTTP port")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- and the server's command line")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if port_open(args.port):
        sys.exit(f"port {args.port} is taken: stop what holds it first")
    start = time.monotonic()
    server = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not ready(args.port):
            if server.poll() is not None or time.monotonic() - start > args.timeout:
                sys.exit(f"the server did not become ready (exit code {server.poll()})")
            time.sleep(0.05)
        wall = time.monotonic() - start
        rows = []
        for pid in tree(server.pid):
            try:
                rows.append(cpu_s(pid))
            except OSError:
                continue  # ended meanwhile
        print(f"ready after {wall:.2f} s, {sum(c for c, _ in rows):.2f} s of CPU")
        for cpu, cmd in sorted(rows, reverse=True):
            if cpu >= 0.05:
                print(f"  {cpu:6.2f} s  {cmd[:120]}")
    finally:
        stop(server)
        while port_open(args.port):
            time.sleep(0.1)


def stop(server: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM, as a process manager stops it (the launcher frees Triton's shared memory), then
    SIGKILL to every process of the tree still there after `grace_s`."""
    pids = tree(server.pid)
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(grace_s)
    except subprocess.TimeoutExpired:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        server.wait()


if __name__ == "__main__":
    main()
