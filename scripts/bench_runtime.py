"""Step time of the lean runtime (plain and batch-invariant) vs transformers on the same weights.

Median milliseconds per forward of n new tokens over a cached context (default 200 tokens), for
batch 1 (1, 5, 17 new tokens: a plain step and two verify sizes) and batch 8 (x1, x5). Both sides
compute the logits of every new token (what verification needs); transformers runs with a
DynamicCache cropped back after each step, the lean runtime with its paged pool truncated back.

    .venv/bin/python scripts/bench_runtime.py [MODEL_DIR] [--repeats 3] [--block-size 16] [--int8] [--int4]

`--tree N` also times one row of N new tokens verified as a chain and as a draft tree (a
pending token and a ternary tree of N - 1 nodes under it) on the batch-invariant engine, where a tree's nodes
share one key list with a mask (lean_lm's _key_lists).

`--int8` / `--int4` add the lean runtime with int8 / int4 linear layers, batch-invariant (one C
call a layer), as a quantized drafter runs (e.g. `~/.cache/tritonspec/models/qwen2.5-coder-0.5b`),
where the CPU has AVX-512 VNNI or AVX2.

The machine is shared and noisy: every case is measured --repeats times, interleaved, and the
table gives the median of the per-repeat medians, their spread (min-max), and the fastest single
forward (the least disturbed by other processes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from backends.runtime.lean_lm import LeanCausalLM, Row  # noqa: E402
from backends.serving.tree import DraftTree  # noqa: E402

CASES = [(1, 1), (1, 5), (1, 17), (8, 1), (8, 5)]  # (batch, new tokens per row)


def lean_step(lm: LeanCausalLM, pool, batch: int, n: int, context: int, new: torch.Tensor, mask=None):
    """`mask`: each row's [n, n] mask among its new tokens (a draft tree), else causal."""

    def step() -> None:
        lm.forward(pool, [Row(b, new[b, :n], mask) for b in range(batch)], logits_rows=n)
        for b in range(batch):
            pool.truncate(b, context)

    return step


def hf_step(hf, cache: DynamicCache, n: int, new: torch.Tensor):
    def step() -> None:
        hf(input_ids=new[:, :n], cache=cache, use_cache=True)
        cache.crop(-n)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="~/.cache/tritonspec/models/smollm2-135m")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--iters", type=int, default=30, help="timed forwards per case and repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-hf", action="store_true", help="time the lean runtime only")
    parser.add_argument("--int8", action="store_true", help="also the lean runtime with int8 linear layers")
    parser.add_argument("--int4", action="store_true", help="also the lean runtime with int4 linear layers")
    parser.add_argument("--tree", type=int, help="also one row of N new tokens as a chain and as a tree")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(Path(args.model).expanduser(), dtype=dtype).eval()
    engines = {"lean": LeanCausalLM.from_hf(hf), "invariant": LeanCausalLM.from_hf(hf, batch_invariant=True)}
    quantized = [q for q in ("int8", "int4") if getattr(args, q)]
    for q in quantized:
        engines[q] = LeanCausalLM.from_hf(hf, batch_invariant=True, quantization=q)
    gen = torch.Generator().manual_seed(0)
    vocab = hf.config.vocab_size
    max_batch = max(b for b, _ in CASES)
    prompt = torch.randint(0, vocab, (max_batch, args.context), generator=gen)
    new = torch.randint(0, vocab, (max_batch, max(*(n for _, n in CASES), args.tree or 0)), generator=gen)

    pools = {}
    for name, lm in engines.items():
        pools[name] = lm.new_pool(capacity_tokens=max_batch * (args.context + 64), block_size=args.block_size)
        for b in range(max_batch):
            pools[name].admit(b, args.context + max(32, args.tree or 0))
            lm.forward(pools[name], [Row(b, prompt[b])])
    steps = {}
    with torch.inference_mode():
        for batch, n in CASES:
            for name, lm in engines.items():
                steps[(name, batch, n)] = lean_step(lm, pools[name], batch, n, args.context, new)
            if not args.no_hf:
                cache = DynamicCache(config=hf.config)
                hf(input_ids=prompt[:batch], cache=cache, use_cache=True)
                steps[("hf", batch, n)] = hf_step(hf, cache, n, new[:batch])
        if args.tree:
            steps[("chain", 1, args.tree)] = lean_step(
                engines["invariant"], pools["invariant"], 1, args.tree, args.context, new
            )
            # the verifier's mask for a pending token and a ternary tree under it (node k's parent k // 3 - 1)
            tree = DraftTree(tuple(range(args.tree - 1)), tuple(k // 3 - 1 for k in range(args.tree - 1)))
            steps[("tree", 1, args.tree)] = lean_step(
                engines["invariant"], pools["invariant"], 1, args.tree, args.context, new, tree.attention_mask(1)
            )

        medians: dict[tuple, list[float]] = {key: [] for key in steps}
        best: dict[tuple, float] = {key: float("inf") for key in steps}
        with tqdm(total=args.repeats * len(steps) * (args.iters + 3), desc="forwards", unit="fwd") as bar:
            for _ in range(args.repeats):
                for key, step in steps.items():
                    for _ in range(3):  # warm-up (oneDNN builds a primitive per new shape)
                        step()
                    times = []
                    for _ in range(args.iters):
                        start = time.perf_counter()
                        step()
                        times.append(time.perf_counter() - start)
                    medians[key].append(statistics.median(times) * 1e3)
                    best[key] = min(best[key], min(times) * 1e3)
                    bar.update(args.iters + 3)

    def cell(key) -> str:
        if key not in medians:
            return "-"
        m = medians[key]
        return f"{statistics.median(m):.1f} ({min(m):.1f}-{max(m):.1f}) {best[key]:.1f}"

    print(
        f"\n{Path(args.model).name}, {args.dtype}, {args.threads} threads, context {args.context}, "
        f"block size {args.block_size}; ms per forward: median (spread of the {args.repeats} repeats' "
        "medians) fastest"
    )

    def ratio(a, b) -> str:
        return "-" if a not in medians else f"{statistics.median(medians[a]) / statistics.median(medians[b]):.2f}x"

    titles = {
        "lean": "lean",
        "invariant": "lean, batch-invariant",
        "hf": "transformers",
        "int8": "int8 linears",
        "int4": "int4 linears",
    }
    columns = [name for name in titles if name in engines or name == "hf"]
    print(
        f"{'batch x new':>12} | "
        + "".join(f"{titles[name]:>24} | " for name in columns)
        + "invariant cost | lean speedup vs transformers (medians)"
        + "".join(f" | {q} / lean" for q in quantized)
    )
    for batch, n in CASES:
        lean = ("lean", batch, n)
        print(
            f"{f'{batch} x {n}':>12} | "
            + "".join(f"{cell((name, batch, n)):>24} | " for name in columns)
            + f"{ratio(('invariant', batch, n), lean):>14} | {ratio(('hf', batch, n), lean)}"
            + "".join(f" | {ratio((q, batch, n), lean)}" for q in quantized)
        )
    if args.tree:
        chain, tree = ("chain", 1, args.tree), ("tree", 1, args.tree)
        print(
            f"1 x {args.tree}, batch-invariant: chain {cell(chain)}, tree {cell(tree)}: tree / chain {ratio(tree, chain)}"
        )


if __name__ == "__main__":
    main()
