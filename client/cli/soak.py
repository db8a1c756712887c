"""`tritonspec soak`: many concurrent greedy streams against a real server for a while.
Every response is checked against the same prompt's reference output (taken once, alone),
the server's processes' memory is sampled, and at the end no sequence state may be left."""
from __future__ import annotations

import threading
import time
from pathlib import Path

from client.api.triton import grpc_generate
from client.cli.bench import load_prompts
from client.cli.launcher import pids_with_cmdline


def _rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def server_pids(server) -> list[int]:
    """tritonserver and its stub processes (found by the server's shm prefix)."""
    return [server.process.pid, *pids_with_cmdline(server.shm_prefix)]


def run_soak(server, seconds: float, concurrency: int, max_tokens: int = 32) -> dict:
    _, prompts = load_prompts()
    flat = [p for ps in prompts.values() for p in ps]
    reference = {p: grpc_generate(server.grpc_url, p, max_tokens=max_tokens).output_ids for p in flat}
    pids = server_pids(server)
    memory = [(0.0, _rss_mb(pids))]
    counts = {"requests": 0, "wrong": 0, "errors": 0}
    lock = threading.Lock()
    start = time.monotonic()
    deadline = start + seconds

    def client(index: int) -> None:
        n = index
        while time.monotonic() < deadline:
            prompt = flat[n % len(flat)]
            n += concurrency
            try:
                ok = grpc_generate(server.grpc_url, prompt, max_tokens=max_tokens).output_ids == reference[prompt]
                with lock:
                    counts["requests"] += 1
                    counts["wrong"] += not ok
            except Exception:
                with lock:
                    counts["errors"] += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(10)
        memory.append((time.monotonic() - start, _rss_mb(pids)))
    for t in threads:
        t.join()
    return {**counts, "seconds": time.monotonic() - start, "memory_mb": memory}
