"""Two checkouts' lean runtimes (their Python and their C kernels), forwards in turn in one
process: a runtime change measured on a whole model's forward without the host's swings (on the
shared 2-core machine memory bandwidth moves by up to 1.5x within minutes, more than most
changes). The base is a checkout of another revision, e.g.

    git worktree add /tmp/base HEAD~1
    .venv/bin/python scripts/bench_runtime_ab.py /tmp/base \
        ~/.cache/tritonspec/models/qwen2.5-coder-1.5b --tokens 1 5 7 9 13

Each side loads the model itself (twice the weights in memory) and builds its own kernels.
Median milliseconds per forward of n new tokens for each of --batch rows (logits for all of
them, as verification asks) over a cached context, on the batch-invariant lean runtime, and
the median over rounds of each round's this / base ratio with its range.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
from tqdm import tqdm

HERE = Path(__file__).resolve().parents[1]


def runtime(checkout: Path) -> ModuleType:
    """`backends.runtime.lean_lm` of `checkout`, imported afresh beside any other checkout's."""
    for name in [m for m in sys.modules if m.split(".")[0] in ("backends", "kernels")]:
        del sys.modules[name]
    sys.path.insert(0, str(checkout))
    try:
        return importlib.import_module("backends.runtime.lean_lm")
    finally:
        sys.path.remove(str(checkout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path, help="a checkout of the revision to compare against")
    parser.add_argument("model", nargs="?", default="~/.cache/tritonspec/models/smollm2-135m")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 5, 9, 17])
    parser.add_argument("--batch", type=int, default=1, help="rows per forward, each with --context cached")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=10, help="rounds; each times 4 forwards per side and size")
    parser.add_argument("--quantization", choices=["int8", "int4"])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model = Path(args.model).expanduser()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 1000, (args.context,), generator=gen)
    new = torch.randint(0, 1000, (max(args.tokens),), generator=gen)
    sides = {}
    with torch.inference_mode():
        for name, checkout in (("base", args.base.expanduser().resolve()), ("this", HERE)):
            lean = runtime(checkout)
            quantized = {"quantization": args.quantization} if args.quantization else {}  # older trees lack it
            lm = lean.LeanCausalLM.from_hf(
                lean.read_checkpoint(model, getattr(torch, args.dtype)), batch_invariant=True, **quantized
            )
            pool = lm.new_pool(capacity_tokens=args.batch * (args.context + max(args.tokens) + 64), block_size=16)
            for row in range(args.batch):
                pool.admit(row, args.context + max(args.tokens))
                lm.forward(pool, [lean.Row(row, prompt)])
            sides[name] = (lean.Row, lm, pool)
        times: dict[tuple[str, int], list[list[float]]] = {(s, n): [] for s in sides for n in args.tokens}
        for round_ in tqdm(range(args.repeats), desc="rounds"):
            for n in args.tokens:
                for name in sorted(sides, reverse=round_ % 2 == 1):  # who goes first alternates
                    row_type, lm, pool = sides[name]
                    rows = [row_type(row, new[:n]) for row in range(args.batch)]
                    taken = []
                    for _ in range(4):
                        start = time.perf_counter()
                        lm.forward(pool, rows, logits_rows=n)
                        taken.append(time.perf_counter() - start)
                        for row in range(args.batch):
                            pool.truncate(row, args.context)
                    times[(name, n)].append(taken)
    print(
        f"{model.name}, {args.quantization or args.dtype}, {args.batch} row(s) over {args.context} cached tokens: "
        "ms per forward (median), this / base per round"
    )
    for n in args.tokens:
        base, this = ([statistics.median(r) for r in times[(s, n)]] for s in ("base", "this"))
        ratios = [t / b for t, b in zip(this, base)]
        print(
            f"{n:3} tokens: base {statistics.median(base) * 1e3:6.1f}  this {statistics.median(this) * 1e3:6.1f}  "
            f"this / base {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
        )


if __name__ == "__main__":
    main()
