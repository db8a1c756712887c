"""A trained head's acceptance on held-out training sequences, through its proposer: the path it
is served on, not the trainer's unrolled forward.

The sequences are the trainer's validation split (every 20th of the cached data,
`TrainingData.split`): the target's own greedy answers with its hidden states. At each answer
position the proposer is handed the target's state rows up to there (as the verifier delivers
them) and drafts a greedy chain of k; its acceptance length there is 1 + the drafts that match
the target's next tokens in order. Reported: the mean acceptance length and how often 0..k
drafts were accepted (issue 55's "held-out set from the training split").

    .venv/bin/python scripts/heldout_acceptance.py --method eagle3 [--head DIR] [--int8] [--positions 100]

Heads from `tritonspec train METHOD` (default: the one it wrote for the target); the data from
its cache (the layers the head reads must be there: train that method first).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from backends.config import SpeculativeConfig  # noqa: E402
from backends.serving.proposer import DraftRequest, build_proposer  # noqa: E402
from backends.training import data_dir, head_dir  # noqa: E402

TARGET = Path.home() / ".cache/tritonspec/models/smollm2-135m"
HELD_OUT_EVERY = 20  # TrainingData.split's default: 5% of the sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="eagle3")
    parser.add_argument("--target", type=Path, default=TARGET)
    parser.add_argument("--head", type=Path, help="the head's directory (default: tritonspec train's)")
    parser.add_argument("--k", type=int, default=3, help="drafts per chain")
    parser.add_argument("--positions", type=int, default=100, help="answer positions per sequence, at most")
    parser.add_argument("--int8", action="store_true", help="serve the head with quantization: int8")
    args = parser.parse_args()
    torch.set_num_threads(2)
    head = args.head or head_dir(str(args.target), args.method)
    spec = {"method": args.method, "num_speculative_tokens": args.k, "model": str(head)}
    config = SpeculativeConfig.from_json({**spec, **({"quantization": "int8"} if args.int8 else {})})
    proposer = build_proposer(config, max_model_len=4096, dtype="bfloat16", target_model=args.target)
    with safe_open(data_dir(str(args.target)) / "states.safetensors", "pt") as f:
        offsets, prompt_lens = f.get_tensor("offsets"), f.get_tensor("prompt_lens")
        token_ids, labels = f.get_tensor("token_ids"), f.get_tensor("labels")
        missing = [i for i in proposer.hidden_layer_ids if f"hidden.{i}" not in f.keys()]
        if missing:
            raise SystemExit(f"the cached data has no hidden states of layers {missing}: train {args.method} first")
        layers = [f.get_tensor(f"hidden.{i}") for i in proposer.hidden_layer_ids]  # each [N, H]
    accepted = [0] * (args.k + 1)
    for seq in tqdm(range(0, len(prompt_lens), HELD_OUT_EVERY), desc="held-out sequences", unit="seq"):
        start, end, prompt = int(offsets[seq]), int(offsets[seq + 1]), int(prompt_lens[seq])
        ids, states = token_ids[start:end].tolist(), torch.stack([h[start:end] for h in layers], dim=1)
        proposer.propose([DraftRequest(seq, ids[:prompt], args.k, states[: prompt - 1])])
        for n in range(prompt, min(end - start - args.k, prompt + args.positions)):
            # x_0..x_n known, the target's state at n - 1 new; the drafts stand for x_{n+1}...
            request = DraftRequest(seq, ids[: n + 1], args.k, states[n - 1 : n], num_new=1, num_accepted=0)
            drafts = proposer.propose([request])[0].token_ids
            truth = labels[start + n : start + n + args.k].tolist()
            accepted[next((i for i, (d, t) in enumerate(zip(drafts, truth)) if d != t), len(drafts))] += 1
        proposer.release(seq)
    total = sum(accepted)
    mean = 1 + sum(i * c for i, c in enumerate(accepted)) / total
    shares = " / ".join(f"{c / total:.1%}" for c in accepted)
    print(f"{head} ({'int8' if args.int8 else 'bf16'}): {total} positions, mean acceptance length {mean:.3f}")
    print(f"accepted 0..{args.k} drafts: {shares}")


if __name__ == "__main__":
    main()
