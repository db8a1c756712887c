"""Time to first token in process: a prompt of N tokens prefilled through the batch-invariant lean
runtime in chunks as the orchestrator sends them (`prefill_chunk_tokens`), logits for the last
token only. Prints the median seconds and tokens/s over --repeats prefills, with the range, and
the longest chunk's step (the last: its attention reads the most keys), which is how long other
streams sharing the server wait at most between two of their tokens.

    .venv/bin/python scripts/bench_prefill.py --tokens 2000 8000 --chunk 128 512

With --base (a checkout of another revision, as scripts/bench_runtime_ab.py takes) both
checkouts' runtimes are loaded in this process and timed in turn, who goes first alternating,
and the median this / base ratio per prompt is printed with its range:

    git worktree add /tmp/base HEAD~1
    .venv/bin/python scripts/bench_prefill.py --base /tmp/base --tokens 2000 8000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "scripts"))
from bench_runtime_ab import runtime  # noqa: E402


def prefill_seconds(lean, lm, pool, prompt: torch.Tensor, chunk: int) -> tuple[float, float]:
    """Seconds to prefill `prompt` ([n] token ids) as sequence 0 in chunks of `chunk` tokens (0:
    one), and the longest chunk's."""
    pool.admit(0, prompt.shape[0] + 1)
    step = chunk or prompt.shape[0]
    start = last = time.perf_counter()
    longest = 0.0
    for i in range(0, prompt.shape[0], step):
        part = prompt[i : i + step]
        lm.forward(pool, [lean.Row(0, part)], logits_rows=1 if i + step >= prompt.shape[0] else 0)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    pool.release(0)
    return last - start, longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="~/.cache/tritonspec/models/smollm2-135m")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2000, 8000], help="prompt lengths")
    parser.add_argument("--chunk", type=int, nargs="+", default=[128], help="prefill chunk sizes (0: whole prompt)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--base", type=Path, help="a checkout of the revision to compare against")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model = Path(args.model).expanduser()
    prompt = torch.randint(0, 1000, (max(args.tokens),), generator=torch.Generator().manual_seed(0))
    checkouts = {"this": HERE} if args.base is None else {"base": args.base.expanduser().resolve(), "this": HERE}
    sides = {}
    with torch.inference_mode():
        for name, checkout in checkouts.items():
            lean = runtime(checkout)
            lm = lean.LeanCausalLM.from_hf(lean.read_checkpoint(model, torch.bfloat16), batch_invariant=True)
            pool = lm.new_pool(capacity_tokens=max(args.tokens) + 64, block_size=16)
            prefill_seconds(lean, lm, pool, prompt[:64], 0)  # builds the kernels, warms the pools
            sides[name] = (lean, lm, pool)
        print(f"{model.name}, bf16, {args.threads} threads: prefill seconds (median, range) over {args.repeats}")
        for n in args.tokens:
            for chunk in args.chunk:
                times: dict[str, list[float]] = {name: [] for name in sides}
                steps: dict[str, list[float]] = {name: [] for name in sides}
                for round_ in range(args.repeats):
                    for name in sorted(sides, reverse=round_ % 2 == 1):  # who goes first alternates
                        taken, longest = prefill_seconds(*sides[name], prompt[:n], chunk)
                        times[name].append(taken)
                        steps[name].append(longest)
                line = f"{n:6} tokens, chunk {chunk:5}:"
                for name, taken in times.items():
                    med = statistics.median(taken)
                    line += f"  {name} {med:7.3f} s ({min(taken):.3f}-{max(taken):.3f}) {n / med:6.0f} tok/s"
                    line += f", longest step {statistics.median(steps[name]):.3f} s"
                if len(sides) == 2:
                    ratios = [t / b for t, b in zip(times["this"], times["base"])]
                    line += f"  this / base {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
                print(line, flush=True)


if __name__ == "__main__":
    main()
