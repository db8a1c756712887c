"""Concurrent streams decoded in this process, without Triton, gRPC or a client: what the
server's own parts (the step batcher, the target on its forward thread, the draft -> verify
loop) reach at N streams, to set beside `tritonspec perf` at the same concurrency.

Each of N threads decodes the benchmark prompts in turn (128 tokens, ignore_eos) through
`generate`, the loop the `speculative` model runs, with the shipped drafter config (ngram,
k = 4 up to 4 streams and 1 above) and adaptive draft length; the verify steps of all
streams go through one `StepBatcher` to the target on a thread of its own, which also loaded
the model (as the server does: OpenMP keeps a team per calling thread). Plain decoding is the
same loop with `num_draft_tokens` 0. Tokens count from 2 s after the first one to 1 s before
the end of each measurement.

    .venv/bin/python scripts/bench_in_process.py --concurrency 1 8 16 --seconds 20
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import threading
import time

from tqdm import tqdm
from transformers import AutoTokenizer

from backends.config import SpeculativeConfig
from backends.runtime.model_store import resolve_model
from backends.runtime.threads import forward_thread
from backends.serving.detokenize import TextStream
from backends.serving.drafting import DraftService
from backends.serving.local import LocalDrafter
from backends.serving.orchestrator import Generation, ServingContext, generate
from backends.serving.proposer import build_proposer
from backends.serving.request import GenerationRequest
from backends.serving.target import TargetRunner
from backends.triton_models.pbtxt import get_parameter
from backends.triton_models.step_batch import StepBatcher, in_process
from client.cli.bench import load_prompts
from client.cli.launcher import DEFAULT_REPOSITORY


def shipped_drafter_config() -> SpeculativeConfig:
    text = (DEFAULT_REPOSITORY / "drafter" / "config.pbtxt").read_text()
    return SpeculativeConfig.from_json(get_parameter(text, "speculative_config"))


def measure(
    runner: TargetRunner,
    batcher: StepBatcher,
    drafter: LocalDrafter | None,
    tokenizer,
    prompts: list[str],
    concurrency: int,
    seconds: float,
) -> float:
    """Output tokens per second of `concurrency` streams decoding for `seconds`."""
    stop, lock, emitted, active = threading.Event(), threading.Lock(), [], [0]
    ctx = ServingContext({tokenizer.eos_token_id}, runner.max_model_len, load=lambda: active[0])

    def stream(first: int) -> None:
        for n in itertools.count(first, concurrency):
            if stop.is_set():
                return
            prompt = prompts[n % len(prompts)]
            req = GenerationRequest(
                prompt=prompt, max_tokens=128, ignore_eos=True, **({} if drafter else {"num_draft_tokens": 0})
            )
            seq_id = random.getrandbits(62)
            with lock:
                active[0] += 1
            try:
                ids, text = tokenizer(prompt)["input_ids"], TextStream(tokenizer, req.stop)
                for step in generate(Generation(req, ids, seq_id, batcher, drafter, text, ctx)):
                    emitted.append((time.perf_counter(), len(step.token_ids)))
            finally:
                with lock:
                    active[0] -= 1
                batcher.release(seq_id)
                if drafter:
                    drafter.release(seq_id)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    start, end = emitted[0][0] + 2.0, emitted[0][0] + seconds - 1.0
    return sum(n for t, n in emitted if start <= t < end) / (end - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--seconds", type=float, default=20.0, help="per measurement (at least 5)")
    args = parser.parse_args()
    if args.seconds < 5:
        parser.error("--seconds must be at least 5 (2 s of warm-up and 1 s at the end are not counted)")

    model = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    forward = forward_thread("forward")  # as the server: the one thread with OpenMP teams
    runner = forward.submit(TargetRunner, model, "bfloat16").result()
    run_rows = in_process(runner)
    batcher = StepBatcher(lambda rows: forward.submit(run_rows, rows).result(), carries_logprobs=True)
    config = shipped_drafter_config()
    drafter = LocalDrafter(DraftService(build_proposer(config, max_model_len=runner.max_model_len), config))
    prompts = [p for category in load_prompts()[1].values() for p in category]

    results: dict[str, dict[int, float]] = {"plain": {}, "speculative": {}}
    jobs = [(mode, c) for c in args.concurrency for mode in results]
    for mode, c in tqdm(jobs, desc="in-process sweep", unit="run"):
        results[mode][c] = measure(
            runner, batcher, drafter if mode == "speculative" else None, tokenizer, prompts, c, args.seconds
        )
    print(f"{'streams':>7}  {'plain':>8}  {'speculative':>11}  ratio")
    for c in args.concurrency:
        plain, spec = results["plain"][c], results["speculative"][c]
        print(f"{c:>7}  {plain:>8.1f}  {spec:>11.1f}  {spec / plain:.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
