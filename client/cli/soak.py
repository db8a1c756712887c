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


# -- `tritonspec soak --chaos` ---------------------------------------------------------------------------------------

CHAOS_SPECULATIVE_CONFIG = {"model": "client.cli.chaos_proposer.ChaosNgram", "num_speculative_tokens": 4}
# Requests that must be refused, each by a message that names its problem.
BAD_REQUESTS: list[tuple[str, dict, str]] = [
    ("top_k 1e19", {"sampling_parameters": {"top_k": 1e19, "temperature": 1}}, "top_k must be"),
    ("NaN temperature", {"sampling_parameters": {"temperature": float("nan")}}, "temperature must be a finite"),
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens must be at least 1"),
    ("33 stop strings", {"stop_words": [f"s{i}" for i in range(33)]}, "at most 32 stop strings"),
    ("unknown key", {"sampling_parameters": {"frobnicate": 1}}, "unknown key 'frobnicate'"),
    ("too many drafts", {"num_draft_tokens": 99}, "num_draft_tokens"),
    ("empty prompt", {"prompt": " "}, "text_input is empty"),
]


def _bad_request(server, rng) -> tuple[str, str]:
    """(what was sent, the error it got; "" when it was accepted)."""
    from client.api.triton import GenerationError

    if rng.random() < 0.15:
        return "a direct verifier request", _direct_verifier_request(server, rng)
    name, inputs, _ = rng.choice(BAD_REQUESTS)
    inputs = dict(inputs)
    try:
        grpc_generate(server.grpc_url, inputs.pop("prompt", "The quick brown fox"), **inputs)
    except GenerationError as e:
        return name, str(e)
    return name, ""


def _direct_verifier_request(server, rng) -> str:
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    tensors = []
    for name, value in (("input_ids", np.array([[1, 2, 3]], np.int64)), ("draft_ids", np.zeros((1, 0), np.int64))):
        tensor = grpcclient.InferInput(name, list(value.shape), "INT64")
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        try:
            client.infer(
                "verifier", tensors, sequence_id=rng.randrange(1, 2**63), sequence_start=True, sequence_end=True
            )
        except InferenceServerException as e:
            return str(e)
    return ""


def _expected_errors(name: str) -> tuple[str, ...]:
    """What the refusal of bad request `name` must say (any one of these)."""
    if name == "a direct verifier request":  # refused for its missing token, or by a standing-by verifier
        return ("only serves the `speculative` model", "standing by, the target is verified in the process of")
    return (next(message for n, _, message in BAD_REQUESTS if n == name),)


def run_chaos_soak(
    server,
    seconds: float,
    concurrency: int,
    trigger: Path,
    max_tokens: int = 32,
    fault_every_s: float = 60.0,
    cancel_share: float = 0.2,
    bad_share: float = 0.1,
    seed: int = 0,
) -> dict:
    """`concurrency` streams for `seconds`: a `cancel_share` of requests cancelled mid-stream
    (what they got so far must begin their reference), a `bad_share` of bad requests (each
    must be refused by name), the rest checked whole against their reference; every
    `fault_every_s` the drafter fails once (client/cli/chaos_proposer.py's faults, in turn,
    through the `trigger` file). Memory is sampled every 10 s."""
    import random

    from client.cli.chaos_proposer import FAULTS

    _, prompts = load_prompts()
    flat = [p for ps in prompts.values() for p in ps]
    reference = {p: grpc_generate(server.grpc_url, p, max_tokens=max_tokens).output_ids for p in flat}
    pids = server_pids(server)
    memory = [(0.0, _rss_mb(pids))]
    counts = {
        "completed": 0,
        "wrong": 0,
        "cancelled": 0,
        "cancelled_wrong": 0,
        "errors": 0,
        "bad_refused": 0,
        "bad_misjudged": 0,
        "faults_injected": 0,
        "faults_taken": 0,
    }
    problems: list[str] = []
    lock = threading.Lock()
    start = time.monotonic()
    deadline = start + seconds

    def count(key: str, problem: str = "") -> None:
        with lock:
            counts[key] += 1
            if problem and len(problems) < 20:
                problems.append(problem)

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        n = index
        while time.monotonic() < deadline:
            draw = rng.random()
            if draw < bad_share:
                name, error = _bad_request(server, rng)
                ok = bool(error) and any(message in error for message in _expected_errors(name))
                count("bad_refused" if ok else "bad_misjudged", "" if ok else f"bad request {name}: {error!r}")
                continue
            prompt = flat[n % len(flat)]
            n += concurrency
            cancel_after = rng.randint(1, 4) if draw < bad_share + cancel_share else None
            try:
                result = grpc_generate(
                    server.grpc_url, prompt, max_tokens=max_tokens, cancel_after_responses=cancel_after
                )
            except Exception as e:  # noqa: BLE001 - counted and reported
                count("errors", f"{prompt[:30]!r}: {e}")
                continue
            ids, want = result.output_ids, reference[prompt]
            if result.finish_reason:
                count("completed")
                if ids != want:
                    count("wrong", f"{prompt[:30]!r}: {ids} != {want}")
            else:
                count("cancelled")
                if ids != want[: len(ids)]:
                    count("cancelled_wrong", f"cancelled {prompt[:30]!r}: {ids} does not begin {want}")

    def faults() -> None:
        kind = 0
        while time.monotonic() + fault_every_s < deadline:
            time.sleep(fault_every_s)
            if trigger.exists():  # the last fault was never taken (no drafting happened)
                continue
            trigger.write_text(FAULTS[kind % len(FAULTS)])
            kind += 1
            count("faults_injected")

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    threads.append(threading.Thread(target=faults, daemon=True))
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads[:-1]):
        time.sleep(10)
        memory.append((time.monotonic() - start, _rss_mb(pids)))
    for t in threads:
        t.join(timeout=fault_every_s)
    counts["faults_taken"] = counts["faults_injected"] - trigger.exists()
    return {**counts, "seconds": time.monotonic() - start, "memory_mb": memory, "problems": problems}


def wait_until_idle(server, timeout_s: float = 30.0) -> dict[str, float]:
    """The active-sequence gauges once they read 0, or as they are after `timeout_s`
    (requests cancelled last may still be ending)."""
    deadline = time.monotonic() + timeout_s
    while True:
        active = server.active_sequences()
        if not any(active.values()) or time.monotonic() > deadline:
            return active
        time.sleep(0.5)
