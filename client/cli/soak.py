"""`tritonspec soak`: many concurrent greedy streams against a real server for a while.
Every response is checked against the same prompt's reference output (taken once, alone),
the server's processes' memory is sampled, and at the end no sequence state may be left."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from client.api.triton import grpc_generate
from client.cli.bench import load_prompts
from client.cli.launcher import pids_with_cmdline


def rss_by_process(pids: list[int]) -> dict[str, float]:
    """{process: resident memory in MB}: tritonserver, and each stub by its model's name."""
    rss = {}
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        model = next((Path(a.decode()).parts[-3] for a in argv if a.endswith(b"/model.py")), None)
        name = model or Path(argv[0].decode()).name
        rss[name] = rss.get(name, 0.0) + kb / 1024
    return rss


def _rss_mb(pids: list[int]) -> float:
    return sum(rss_by_process(pids).values())


def rss_growth_mb(memory: list[tuple[float, float]], warmup_s: float) -> float:
    """How far the servers' RSS rose after warm-up: the highest sample past `warmup_s` over
    the first one there (0 with fewer than two samples past it)."""
    after = [mb for t, mb in memory if t >= warmup_s]
    return max(after) - after[0] if len(after) > 1 else 0.0


def process_growth(samples: list[tuple[float, dict[str, float]]], warmup_s: float) -> dict[str, float]:
    """rss_growth_mb of each process over rss_by_process samples."""
    names = sorted({name for _, rss in samples for name in rss})
    return {name: rss_growth_mb([(t, rss.get(name, 0.0)) for t, rss in samples], warmup_s) for name in names}


def kv_budget_gb(model_dir: Path, dtype: str, sequences: int, max_tokens: int, draft_slack: int = 8) -> float:
    """A verifier KV budget (`kv_cache_memory_gb`) that holds `sequences` of the soak's longest
    prompt plus `max_tokens` (and the drafts of a step), each rounded up to whole blocks."""
    import math

    from transformers import AutoConfig

    from backends.runtime.kv_cache import BLOCK_SIZE
    from backends.runtime.model_store import load_tokenizer
    from backends.serving.target_engine import kv_bytes_per_token

    tokenizer = load_tokenizer(model_dir)
    _, prompts = load_prompts()
    longest = max(len(tokenizer(p)["input_ids"]) for ps in prompts.values() for p in ps)
    blocks = math.ceil((longest + max_tokens + draft_slack) / BLOCK_SIZE) + 1
    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(model_dir), dtype)
    return sequences * blocks * BLOCK_SIZE * per_token / 2**30


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


@dataclass
class ChaosMix:
    """What share of a chaos client's draws is which kind of request. The front end's kinds
    need `openai_url`: bodies over its --max-body-bytes (`body_limit`) must get 413 unread, and
    non-streamed clients that leave must cancel their generation (no sequence left at the end)."""

    cancel: float = 0.2  # streams cancelled mid-way (what they got must begin their reference)
    bad: float = 0.1  # bad requests (each refused by name)
    oversized: float = 0.05
    leaving: float = 0.05
    openai_url: str = ""  # host:port of `tritonspec openai` in front of the server ("" = none)
    body_limit: int = 0


class ChaosTally:
    """The counts of a chaos soak and its first problems, shared by its threads."""

    KEYS = (
        "completed wrong cancelled cancelled_wrong refused_retryable errors bad_refused bad_misjudged "
        "oversized_refused oversized_misjudged left_early faults_injected faults_taken"
    ).split()

    def __init__(self) -> None:
        self.counts = dict.fromkeys(self.KEYS, 0)
        self.problems: list[str] = []
        self.lock = threading.Lock()

    def count(self, key: str, problem: str = "") -> None:
        with self.lock:
            self.counts[key] += 1
            if problem and len(self.problems) < 20:
                self.problems.append(problem)


def _stream(server, tally: ChaosTally, prompt: str, want: list[int], max_tokens: int, cancel_after: int | None) -> None:
    """One stream, checked whole against its reference, or, cancelled, as a prefix of it."""
    try:
        result = grpc_generate(server.grpc_url, prompt, max_tokens=max_tokens, cancel_after_responses=cancel_after)
    except Exception as e:  # noqa: BLE001 - counted and reported
        if retryable(e):  # answered: the client is told to come back (a full KV pool, the server busy)
            tally.count("refused_retryable")
        else:
            tally.count("errors", f"{prompt[:30]!r}: {e}")
        return
    ids = result.output_ids
    if result.finish_reason:
        tally.count("completed")
        if ids != want:
            tally.count("wrong", f"{prompt[:30]!r}: {ids} != {want}")
    else:
        tally.count("cancelled")
        if ids != want[: len(ids)]:
            tally.count("cancelled_wrong", f"cancelled {prompt[:30]!r}: {ids} does not begin {want}")


def retryable(e: Exception) -> bool:
    """Whether a failed request was refused as retryable: what the OpenAI front end answers
    with 503 (a full KV pool past max_queue_time_s, the server at its limit or shutting down)."""
    from client.api.openai_frontend import generation_error

    return generation_error(e).status == 503


def _oversized(mix: ChaosMix, tally: ChaosTally) -> None:
    """A completions body one byte over the front end's limit: 413, before the body is parsed."""
    import http.client

    padding = "x" * (mix.body_limit + 1 - len('{"prompt": ""}'))
    connection = http.client.HTTPConnection(mix.openai_url, timeout=30)
    try:
        connection.request(
            "POST", "/v1/completions", f'{{"prompt": "{padding}"}}', {"Content-Type": "application/json"}
        )
        status = connection.getresponse().status
    except OSError as e:
        status = f"{type(e).__name__}: {e}"
    finally:
        connection.close()
    ok = status == 413
    tally.count("oversized_refused" if ok else "oversized_misjudged", "" if ok else f"oversized body: {status}")


def _leave_early(mix: ChaosMix, prompt: str, rng) -> None:
    """A non-streamed completion whose client hangs up before the answer (the generation
    must be cancelled: the soak's end finds no sequence left)."""
    import socket

    body = json.dumps({"prompt": prompt, "max_tokens": 256, "ignore_eos": True, "temperature": 0}).encode()
    host, port = mix.openai_url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(rng.uniform(0.05, 0.5))


def _chaos_client(
    server, tally: ChaosTally, mix: ChaosMix, references: dict, max_tokens: int, deadline: float, index: int, seed: int
) -> None:
    """One client's requests until `deadline`, each drawn from `mix`."""
    import random

    rng = random.Random(seed * 1000 + index)
    prompts = list(references)
    n = index
    while time.monotonic() < deadline:
        draw = rng.random()
        prompt = prompts[n % len(prompts)]
        if draw < mix.bad:
            name, error = _bad_request(server, rng)
            ok = bool(error) and any(message in error for message in _expected_errors(name))
            tally.count("bad_refused" if ok else "bad_misjudged", "" if ok else f"bad request {name}: {error!r}")
            continue
        draw -= mix.bad
        if mix.openai_url and draw < mix.oversized:
            _oversized(mix, tally)
            continue
        draw -= mix.oversized if mix.openai_url else 0
        if mix.openai_url and draw < mix.leaving:
            _leave_early(mix, prompt, rng)
            tally.count("left_early")
            continue
        n += 1
        cancel_after = rng.randint(1, 4) if rng.random() < mix.cancel else None
        _stream(server, tally, prompt, references[prompt], max_tokens, cancel_after)


def _inject_faults(trigger: Path, tally: ChaosTally, deadline: float, every_s: float) -> None:
    """Every `every_s` make the drafter fail once (client/cli/chaos_proposer.py's faults, in turn)."""
    from client.cli.chaos_proposer import FAULTS

    kind = 0
    while time.monotonic() + every_s < deadline:
        time.sleep(every_s)
        if trigger.exists():  # the last fault was never taken (no drafting happened)
            continue
        trigger.write_text(FAULTS[kind % len(FAULTS)])
        kind += 1
        tally.count("faults_injected")


# /health is asked from a process of its own: in the soak's process, with 32 client threads
# taking turns at the GIL, a probe measured that process's waits as well as the front end's.
_HEALTH_PROBE = """
import sys, time, urllib.request
url = sys.argv[1]
while True:
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            r.read()
    except OSError:
        pass
    print(round(time.monotonic(), 3), round((time.perf_counter() - start) * 1e3, 1), flush=True)
    time.sleep(1)
"""


class HealthProbe:
    """The front end's /health latency (ms), asked every second by a child process, with when
    it asked (time.monotonic(), the same clock in every process)."""

    def __init__(self, openai_url: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _HEALTH_PROBE, f"http://{openai_url}/health"], stdout=subprocess.PIPE, text=True
        )

    def stop(self) -> list[tuple[float, float]]:
        """(when, ms) of every answer."""
        self.process.terminate()
        out, _ = self.process.communicate(timeout=30)
        return [(float(when), float(ms)) for when, ms in (line.split() for line in out.splitlines() if line.strip())]


def run_chaos_soak(
    server,
    seconds: float,
    concurrency: int,
    trigger: Path,
    max_tokens: int = 32,
    fault_every_s: float = 60.0,
    mix: ChaosMix | None = None,
    seed: int = 0,
) -> dict:
    """`concurrency` clients for `seconds`, each drawing its requests from `mix` (streams,
    cancelled streams, bad requests; with a front end, oversized bodies and non-streamed
    clients that leave); a drafter fault every `fault_every_s`. Memory sampled every 10 s, the
    front end's /health latency every second (HealthProbe)."""
    mix = mix or ChaosMix()
    _, prompts = load_prompts()
    references = {
        p: grpc_generate(server.grpc_url, p, max_tokens=max_tokens).output_ids for ps in prompts.values() for p in ps
    }
    pids = server_pids(server)
    tally = ChaosTally()
    start = time.monotonic()
    deadline = start + seconds
    threads = [
        threading.Thread(
            target=_chaos_client, args=(server, tally, mix, references, max_tokens, deadline, i, seed), daemon=True
        )
        for i in range(concurrency)
    ]
    threads.append(threading.Thread(target=_inject_faults, args=(trigger, tally, deadline, fault_every_s), daemon=True))
    for t in threads:
        t.start()
    processes = [(0.0, rss_by_process(pids))]
    probe = HealthProbe(mix.openai_url) if mix.openai_url else None
    try:
        while any(t.is_alive() for t in threads[:-1]):
            time.sleep(10)
            processes.append((time.monotonic() - start, rss_by_process(pids)))
    finally:  # the probe asks forever: never leave it behind
        health = [(when - start, ms) for when, ms in probe.stop()] if probe else []
    for t in threads:
        t.join(timeout=fault_every_s)
    tally.counts["faults_taken"] = tally.counts["faults_injected"] - trigger.exists()
    return {
        **tally.counts,
        "seconds": time.monotonic() - start,
        "memory_mb": [(t, sum(rss.values())) for t, rss in processes],
        "memory_by_process": processes,
        "health_ms_max": max((ms for _, ms in health), default=0.0),
        "health_ms_p99": sorted(ms for _, ms in health)[int(0.99 * (len(health) - 1))] if health else 0.0,
        # When the slowest answers came (s into the soak), to lay beside the server's log.
        "health_slowest": sorted(health, key=lambda answer: -answer[1])[:5],
        "problems": tally.problems,
    }
