"""Drafting cost of the head methods: median milliseconds per `propose` call.

Each head is a synthetic checkpoint in its published layout (tests/fixtures writers), sized
for the target (default SmolLM2-135M) with random weights: a measure of speed only, never of
acceptance. bf16, 2 threads. A sequence first hands over its whole prompt, then every call
brings 3 new target positions and asks for k drafts; batch 1 at 100 and 1000 cached tokens,
batch 4 at 100.

    .venv/bin/python scripts/bench_heads.py [--target DIR] [--calls 25] [--heads eagle3 dflash ...] [--int8]

`--int8` serves every head with `quantization: int8` (its own linear layers on the int8 kernel).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from backends.config import SpeculativeConfig  # noqa: E402
from backends.serving.proposer import DraftRequest, build_proposer  # noqa: E402
from tests.fixtures.synthetic_blocks import write_dflash  # noqa: E402
from tests.fixtures.synthetic_checkpoints import write_eagle1, write_eagle3  # noqa: E402
from tests.fixtures.synthetic_heads import write_medusa  # noqa: E402

# name -> (checkpoint writer, its options, the speculative config, tree nodes asked per call)
HEADS = {
    "eagle3": (write_eagle3, {"draft_vocab_size": 8192}, {"method": "eagle3", "num_speculative_tokens": 3}, 0),
    "eagle3+tree": (
        write_eagle3,
        {"draft_vocab_size": 8192},
        {"method": "eagle3", "num_speculative_tokens": 4, "dynamic_tree": {"top_k": 4, "total_token": 16}},
        16,
    ),
    "eagle": (write_eagle1, {}, {"method": "eagle", "num_speculative_tokens": 3}, 0),
    "medusa": (write_medusa, {"num_heads": 3}, {"method": "medusa", "num_speculative_tokens": 3}, 0),
    "dflash": (
        write_dflash,
        {"block_size": 8, "num_layers": 2, "target_layer_ids": (1, 15), "mask_token_id": 0},
        {"method": "dflash", "num_speculative_tokens": 7},
        0,
    ),
}
CASES = [(1, 100), (1, 1000), (4, 100)]  # (batch, prompt tokens)
NEW_TOKENS = 3


def time_calls(proposer, k: int, nodes: int, batch: int, prompt: int, calls: int, vocab: int, width: int) -> float:
    gen = torch.Generator().manual_seed(0)
    layers = len(proposer.hidden_layer_ids)

    def hidden(rows: int) -> torch.Tensor:
        return torch.randn(rows, layers, width, generator=gen).bfloat16()

    ids = {s: torch.randint(0, vocab, (prompt,), generator=gen).tolist() for s in range(batch)}
    proposer.propose([DraftRequest(s, ids[s], k, hidden(prompt - 1), num_nodes=nodes) for s in range(batch)])
    times = []
    for _ in range(calls):
        requests = []
        for s in range(batch):
            ids[s] = ids[s] + torch.randint(0, vocab, (NEW_TOKENS,), generator=gen).tolist()
            requests.append(
                DraftRequest(s, ids[s], k, hidden(NEW_TOKENS), num_new=NEW_TOKENS, num_accepted=2, num_nodes=nodes)
            )
        start = time.perf_counter()
        proposer.propose(requests)
        times.append(time.perf_counter() - start)
    for s in range(batch):
        proposer.release(s)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=Path.home() / ".cache/tritonspec/models/smollm2-135m")
    parser.add_argument("--calls", type=int, default=25)
    parser.add_argument("--heads", nargs="+", choices=sorted(HEADS), default=list(HEADS))
    parser.add_argument("--int8", action="store_true", help="quantization: int8 for every head")
    args = parser.parse_args()
    torch.set_num_threads(2)
    from backends.methods.head_checkpoint import TargetInfo

    target = TargetInfo.load(args.target)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in tqdm(args.heads, desc="heads"):
            writer, options, spec, nodes = HEADS[name]
            path = Path(tmp) / name
            writer(path, args.target, **options)
            quantization = {"quantization": "int8"} if args.int8 else {}
            config = SpeculativeConfig.from_json({**spec, **quantization, "model": str(path)})
            proposer = build_proposer(config, max_model_len=8192, dtype="bfloat16", target_model=args.target)
            k = spec["num_speculative_tokens"]
            cells = [
                time_calls(proposer, k, nodes, b, p, args.calls, target.vocab_size, target.hidden_size)
                for b, p in CASES
            ]
            rows.append((name, cells))
    print("| head | " + " | ".join(f"batch {b}, {p} cached" for b, p in CASES) + " |")
    print("|---" * (len(CASES) + 1) + "|")
    for name, cells in rows:
        print(f"| {name} | " + " | ".join(f"{ms:.2f} ms" for ms in cells) + " |")


if __name__ == "__main__":
    main()
