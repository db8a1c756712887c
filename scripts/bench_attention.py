"""Time of the batch-invariant CPU attention kernel (`cpu_kernels.attend`) over a whole step's
layers, each layer's keys cold in cache as in serving (a step reads every layer's pool once;
past a few hundred cached tokens SmolLM2's 30 layers of keys no longer fit in the CPU's caches).

One row of n new tokens (a chain: each a longer prefix of one key list) over `context` cached
keys, SmolLM2-135M's heads (9 query heads over 3 kv heads of 64) by default; median and fastest
of --repeats steps, the caches flushed before each.

    .venv/bin/python scripts/bench_attention.py --context 500 2000 --tokens 1 5 13
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from backends.runtime import cpu_kernels  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, nargs="+", default=[500, 2000])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 5, 13])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("HEADS", "KV_HEADS", "HEAD_DIM"))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    heads, kv_heads, d = args.heads
    gen = torch.Generator().manual_seed(0)
    flush = torch.empty(64 << 20, dtype=torch.uint8)  # larger than the CPU's caches
    print(f"{args.layers} layers, {heads} heads over {kv_heads} kv heads of {d}, bf16, {args.threads} threads")
    for context in args.context:
        pool = torch.randn(args.layers, context + max(args.tokens), 2, kv_heads, d, generator=gen).bfloat16()
        for n in args.tokens:
            q = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen).bfloat16()
            keys = cpu_kernels.KeyLists(
                torch.arange(context + n), torch.zeros(n, dtype=torch.long), torch.arange(context + 1, context + n + 1)
            )
            times = []
            for _ in range(args.repeats + 1):
                flush.fill_(1)
                start = time.perf_counter()
                for layer in pool.unbind(0):
                    cpu_kernels.attend(q, layer, keys, heads)
                times.append((time.perf_counter() - start) * 1e3)
            times = times[1:]  # the first built the kernel's scratch
            print(
                f"context {context:>6}, {n:>3} new tokens: median {statistics.median(times):.2f} ms, "
                f"fastest {min(times):.2f} ms"
            )


if __name__ == "__main__":
    main()
