"""Resident memory of a served model's Python stubs, and how long the server took to start.

Starts a server on free ports (as the tests do), reads each stub's VmRSS once every model
is loaded and again after a few requests, then stops it. For a before/after comparison run
it on both checkouts in turn, on a quiet machine:

    .venv/bin/python scripts/server_memory.py --method ngram draft_model --repeats 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from backends.runtime.model_store import resolve_model  # noqa: E402
from client.api.triton import grpc_generate  # noqa: E402
from client.cli.launcher import RepositoryOverrides, TritonServer, pids_with_cmdline  # noqa: E402
from tests.fixtures.servers import free_ports  # noqa: E402

STUBS = ("speculative_0_0", "verifier_0_0", "drafter_0_0")
PROMPT = "def fib(n):\n    if n < 2:\n        return n\n    return"


def speculative_config(method: str, model: str) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if method == "draft_model":  # the target drafting for itself: a model-sized drafter
        return {"method": "draft_model", "model": model, "num_speculative_tokens": 4}
    raise SystemExit(f"--method: ngram or draft_model, not {method!r}")


def resident_mb(server: TritonServer) -> dict[str, int]:
    sizes = {}
    for stub in STUBS:
        for pid in pids_with_cmdline(server.shm_prefix, b"triton_python_backend_stub", b"\0" + stub.encode() + b"\0"):
            status = Path(f"/proc/{pid}/status").read_text()
            sizes[stub] = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) // 1024
    return sizes


def measure(model: str, method: str, dtype: str, log_dir: Path) -> None:
    http, grpc, metrics = free_ports(3)
    overrides = RepositoryOverrides(
        common={"model": model, "dtype": dtype},
        per_model={"drafter": {"speculative_config": json.dumps(speculative_config(method, model))}},
        instance_kinds={},
    )
    server = TritonServer(
        http_port=http, grpc_port=grpc, metrics_port=metrics, overrides=overrides, log_path=log_dir / "server.log"
    )
    start = time.perf_counter()
    server.start()
    started = time.perf_counter() - start
    try:
        loaded = resident_mb(server)
        for _ in range(3):
            grpc_generate(server.grpc_url, PROMPT, max_tokens=64)
        print(
            f"{method}: started in {started:.1f} s; MB resident after load {loaded}, after 3 requests {resident_mb(server)}"
        )
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--method", nargs="+", default=["ngram"])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    model = str(resolve_model(args.model))
    for _ in range(args.repeats):
        for method in args.method:
            measure(model, method, args.dtype, Path(tempfile.mkdtemp(prefix="server-memory-")))


if __name__ == "__main__":
    main()
