"""Two builds of the lean runtime's CPU kernels, one forward each in turn, in one process: a
kernel change measured on a whole model's forward without the host's swings (on the shared
2-core machine memory bandwidth moves by up to 1.5x within minutes, more than most changes).

Both builds must take the same packed weights (pack_linear, pack_linear_int8/int4 unchanged);
the model is loaded once. The base is a cpu_kernels.c from another revision, e.g.

    git show HEAD~1:backends/runtime/cpu_kernels.c > /tmp/base_kernels.c
    .venv/bin/python scripts/bench_kernels_ab.py /tmp/base_kernels.c \
        ~/.cache/tritonspec/models/qwen2.5-coder-1.5b --tokens 1 5 7 9 13

Median milliseconds per forward of n new tokens (logits for all of them, as verification
asks) over a cached context, batch 1, on the batch-invariant lean runtime.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from backends.runtime import cpu_kernels
from backends.runtime.lean_lm import LeanCausalLM, Row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path, help="the cpu_kernels.c to compare against")
    parser.add_argument("model", nargs="?", default="~/.cache/tritonspec/models/smollm2-135m")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 5, 9, 17])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=10, help="rounds; each times 4 forwards per build and size")
    parser.add_argument("--quantization", choices=["int8", "int4"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    libraries = {"base": cpu_kernels.load_library(args.base.expanduser()), "this": cpu_kernels._library()}
    current = ["this"]
    cpu_kernels._library = lambda: libraries[current[0]]  # every kernel call goes to the build in turn

    hf = AutoModelForCausalLM.from_pretrained(Path(args.model).expanduser(), dtype=torch.bfloat16).eval()
    lm = LeanCausalLM.from_hf(hf, batch_invariant=True, quantization=args.quantization)
    del hf
    pool = lm.new_pool(capacity_tokens=args.context + max(args.tokens) + 64, block_size=16)
    pool.admit(0, args.context + max(args.tokens))
    gen = torch.Generator().manual_seed(0)
    times: dict[tuple[str, int], list[float]] = {(b, n): [] for b in libraries for n in args.tokens}
    with torch.inference_mode():
        lm.forward(pool, [Row(0, torch.randint(0, 1000, (args.context,), generator=gen))])
        new = torch.randint(0, 1000, (max(args.tokens),), generator=gen)
        for _ in tqdm(range(args.repeats), desc="rounds"):
            for n in args.tokens:
                for name in libraries:
                    current[0] = name
                    for _ in range(4):
                        start = time.perf_counter()
                        lm.forward(pool, [Row(0, new[:n])], logits_rows=n)
                        times[(name, n)].append(time.perf_counter() - start)
                        pool.truncate(0, args.context)
    print(f"{Path(args.model).name}, {args.quantization or 'bf16'}, context {args.context}: ms per forward (median)")
    for n in args.tokens:
        base, this = (statistics.median(times[(b, n)]) * 1e3 for b in libraries)
        print(f"{n:3} tokens: base {base:6.1f}  this {this:6.1f}  this / base {this / base:.3f}")


if __name__ == "__main__":
    main()
