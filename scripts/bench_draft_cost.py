"""Draft cost of the seven head methods as a fraction of a plain 1-token target step (issue
55's measure: a chain of 3 EAGLE-3 drafts, a tree level, Medusa's heads against a step).

Each head has the shape `tritonspec train METHOD` gives it by default (random weights: a
measure of speed, never of acceptance): eagle3 one decoder layer over an 8192-token draft
vocabulary, drafting a chain of 3 or (`eagle3-tree`) an EAGLE-2 tree of 16 nodes, top-k 4,
4 levels; eagle (EAGLE-1) one layer over the target's vocabulary; mtp one DeepSeek-V3-layout
layer; medusa 3 heads over an 8192-token draft vocabulary, mlp_speculator 3 tied stages over
the target's vocabulary, dflash a 1-layer block of 8 over 8192 draft ids, dspark a block of 7
with a rank-64 Markov head. `medusa-full` is Medusa with a full-vocabulary LM head per head
(FasterDecoding's layout). bf16, 2 threads, batch 1, 200 cached tokens; a draft call hands
over 3 new target positions and asks for k drafts (or a tree's nodes), greedy.

The plain step is the verifier's: the batch-invariant lean runtime, one new token, its logits
and their argmax; a verify step of 4 tokens (k = 3) is timed beside it. Each draft call follows a plain step, as in serving (the target's weights
evict the head's from the caches). Heads take turns, `--repeats` rounds of `--calls` calls
each; the table gives the median of the round medians and their range.

    .venv/bin/python scripts/bench_draft_cost.py [--target DIR] [--tree DIR] [--heads medusa dflash ...] [--int8]

`--int8` serves every head with `quantization: int8` (its own linear layers on the int8 kernel).
`eagle-map`, `mtp-map`, `medusa-full-map` and `mlp_speculator-map` are those heads with their
LM heads cut to a token map of 8192 ids (`speculative_token_map`).

`--tree DIR` imports `backends` from another checkout of the repository (e.g. `git archive
main` unpacked), so two revisions can be timed alternately under the same conditions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

TARGET = Path.home() / ".cache/tritonspec/models/smollm2-135m"
CONTEXT, NEW_TOKENS = 200, 3
VERIFY_TOKENS = 4  # a chain of 3 drafts and the pending token: the bench's `verify` column
DRAFT_VOCAB = 8192  # the trainers' default draft vocabulary (backends/training/trainer.py's DRAFT_VOCAB_SIZE)


def write_heads(root: Path, target_dir: Path, names: list[str]) -> dict[str, tuple[dict, int, int]]:
    """Each head in the layout its trainer writes: name -> (speculative config, k, tree nodes)."""
    from backends.methods.block_checkpoint import save_head
    from backends.methods.dflash import DFlashHead
    from backends.methods.dspark import DSparkHead
    from backends.methods.dspark import default_config as dspark_config
    from backends.methods.head_checkpoint import TargetInfo
    from backends.methods.medusa import MedusaHead, save_medusa
    from backends.methods.mlp_speculator import MLPSpeculatorHead, save_mlp_speculator
    from backends.training.blocks import DFlashTrainer
    from tests.fixtures.synthetic_checkpoints import write_eagle1, write_eagle3
    from tests.fixtures.synthetic_heads import write_mtp

    torch.manual_seed(0)
    target = TargetInfo.load(target_dir)
    ids = [i - 1 for i in DFlashTrainer().layer_ids(target)]
    specs = {}
    for name in names:
        out = root / name
        if name.endswith("-map"):  # the head cut to a token map of DRAFT_VOCAB ids (speculative_token_map)
            base = name.removesuffix("-map")
            spec, k, nodes = write_heads(out, target_dir, [base])[base]
            token_map = out / "token_map.json"
            token_map.write_text(json.dumps(torch.randperm(target.vocab_size)[:DRAFT_VOCAB].tolist()))
            specs[name] = ({**spec, "model": str(out / base), "speculative_token_map": str(token_map)}, k, nodes)
            continue
        if name.startswith("eagle3"):
            write_eagle3(out, target_dir, draft_vocab_size=DRAFT_VOCAB)
            tree = {"dynamic_tree": {"top_k": 4, "total_token": 16}} if name == "eagle3-tree" else {}
            k = 4 if tree else 3
            specs[name] = ({"method": "eagle3", "num_speculative_tokens": k, **tree}, k, 16 if tree else 0)
        elif name in ("eagle", "mtp"):
            (write_eagle1 if name == "eagle" else write_mtp)(out, target_dir)
            specs[name] = ({"method": name, "num_speculative_tokens": 3}, 3, 0)
        elif name.startswith("medusa"):
            config = {"num_heads": 3, "num_hidden_layers": 1, "medusa_fc_bias": True}
            if name == "medusa":
                config["truncated_vocab_size"] = DRAFT_VOCAB
            head = MedusaHead(config, target)
            if head.token_map is not None:
                head.token_map.copy_(torch.randperm(target.vocab_size)[:DRAFT_VOCAB].sort().values)
            save_medusa(head, out)
            specs[name] = ({"method": "medusa", "num_speculative_tokens": 3}, 3, 0)
        elif name == "mlp_speculator":
            config = {"emb_dim": target.hidden_size, "vocab_size": target.vocab_size, "n_predict": 3}
            head = MLPSpeculatorHead({**config, "tie_weights": True, "scale_input": True}, target)
            save_mlp_speculator(head, out)
            specs[name] = ({"method": "mlp_speculator", "num_speculative_tokens": 3}, 3, 0)
        else:
            mask = target.vocab_size - 1
            if name == "dflash":
                config = DFlashTrainer().config(target, mask, 7)
                head_class = DFlashHead
            else:
                config = dspark_config(target, mask_token_id=mask, block_size=7, target_layer_ids=ids)
                config["enable_confidence_head"] = config["confidence_head_with_markov"] = False
                head_class = DSparkHead
            config["draft_vocab_size"] = DRAFT_VOCAB
            save_head(head_class(config, target), out)
            specs[name] = ({"method": name, "num_speculative_tokens": 7}, 7, 0)
    return specs


def plain_step(target_dir: Path, tokens: int = 1) -> Callable[[], None]:
    """One verifier step of `tokens` new tokens after CONTEXT cached ones, the argmax of their
    logits included."""
    from transformers import AutoModelForCausalLM

    from backends.runtime.cpu_kernels import argmax_rows
    from backends.runtime.lean_lm import LeanCausalLM, Row

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    lm = LeanCausalLM.from_hf(hf, batch_invariant=True)
    pool = lm.new_pool(capacity_tokens=1024)
    pool.admit(0, CONTEXT + 16)
    ids = torch.randint(0, lm.vocab_size, (CONTEXT + tokens,), generator=torch.Generator().manual_seed(0))
    lm.forward(pool, [Row(0, ids[:CONTEXT])])

    def step() -> None:
        argmax_rows(lm.forward(pool, [Row(0, ids[CONTEXT:])], logits_rows=tokens).logits[0])
        pool.truncate(0, CONTEXT)

    return step


def draft_call(proposer, k: int, nodes: int, vocab: int, width: int) -> Callable[[], None]:
    """A propose call for one sequence that brings NEW_TOKENS target positions (the first call
    handed over its whole prompt) and asks for k drafts or, with `nodes`, a tree of k levels."""
    from backends.serving.proposer import DraftRequest

    gen = torch.Generator().manual_seed(0)
    layers = len(proposer.hidden_layer_ids)
    ids = torch.randint(0, vocab, (CONTEXT,), generator=gen).tolist()
    proposer.propose([DraftRequest(0, ids, k, torch.randn(CONTEXT - 1, layers, width).bfloat16())])
    new = torch.randint(0, vocab, (NEW_TOKENS,), generator=gen).tolist()
    hidden = torch.randn(NEW_TOKENS, layers, width, generator=gen).bfloat16()

    def call() -> None:
        # The same step each time: back to CONTEXT tokens, 2 of the last k drafts accepted.
        request = DraftRequest(
            0, ids + new, k, hidden, temperature=0.0, num_new=NEW_TOKENS, num_accepted=2, num_nodes=nodes
        )
        proposer.propose([request])

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=TARGET)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    heads = ["eagle3", "eagle3-tree", "eagle", "mtp", "medusa", "medusa-full", "mlp_speculator", "dflash", "dspark"]
    heads += ["eagle-map", "mtp-map", "medusa-full-map", "mlp_speculator-map"]
    parser.add_argument("--heads", nargs="+", choices=heads, default=heads)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--int8", action="store_true", help="quantization: int8 for every head")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    torch.set_num_threads(2)
    from backends.config import SpeculativeConfig
    from backends.methods.head_checkpoint import TargetInfo
    from backends.serving.proposer import build_proposer

    target = TargetInfo.load(args.target)
    plain, verify = plain_step(args.target), plain_step(args.target, VERIFY_TOKENS)
    calls = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (spec, k, nodes) in write_heads(Path(tmp), args.target, args.heads).items():
            quantization = {"quantization": "int8"} if args.int8 else {}
            config = SpeculativeConfig.from_json({"model": str(Path(tmp) / name), **spec, **quantization})
            proposer = build_proposer(config, max_model_len=4096, dtype="bfloat16", target_model=args.target)
            calls[name] = draft_call(proposer, k, nodes, target.vocab_size, target.hidden_size)
    verify_name = f"verify step ({VERIFY_TOKENS} tokens)"
    medians = {name: [] for name in ["plain 1-token step", verify_name, *calls]}
    for _ in range(args.repeats):
        times = []
        for _ in range(args.calls + 1):
            start = time.perf_counter()
            verify()
            times.append(time.perf_counter() - start)
        medians[verify_name].append(statistics.median(times[1:]) * 1e3)
        for name, call in calls.items():
            plain_times, times = [], []
            for _ in range(args.calls + 1):  # the first pair warms up
                # As in serving, each draft call follows a target step (which evicts the head's
                # weights from the caches).
                start = time.perf_counter()
                plain()
                middle = time.perf_counter()
                call()
                plain_times.append(middle - start)
                times.append(time.perf_counter() - middle)
            medians["plain 1-token step"].append(statistics.median(plain_times[1:]) * 1e3)
            medians[name].append(statistics.median(times[1:]) * 1e3)
    plain_ms = statistics.median(medians["plain 1-token step"])
    print(f"backends from {args.tree}")
    print("| case | ms (median of rounds) | range | / plain step |")
    print("|---|---|---|---|")
    for name, values in medians.items():
        ms = statistics.median(values)
        print(f"| {name} | {ms:.2f} | {min(values):.2f}-{max(values):.2f} | {ms / plain_ms:.0%} |")


if __name__ == "__main__":
    main()
