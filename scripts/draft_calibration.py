"""How well a drafter's chain scores (Draft.scores: each draft's path probability) predict what
the target accepts, in process: the bench prompts decoded with a fixed k (no policy, no cut),
every drafting step's scores kept with how many of its drafts were accepted.

Printed per draft position: how often the target accepted the chain up to it, by the score's
range (a calibrated score reads like the accepted share). Then a replay of the same steps
under score floors (a chain ends at its first draft scored under the floor; the cut drops that
one) at the step costs given: tokens a step, time a step and tokens per second, which is
what a floor would trade (tried in the server and dropped: docs/measurements.md, "Chains
cut by their drafter's scores").

    .venv/bin/python scripts/draft_calibration.py --target qwen2.5-coder-1.5b \\
        --spec '{"method": "draft_model", "model": "qwen2.5-coder-0.5b", "quantization": "int4"}' \\
        --k 6 --plain-ms 140 --draft-ms 15 --row-ms 17
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from backends.config import SpeculativeConfig  # noqa: E402
from backends.runtime.model_store import load_tokenizer, resolve_model  # noqa: E402
from backends.runtime.threads import forward_thread  # noqa: E402
from backends.serving.detokenize import TextStream  # noqa: E402
from backends.serving.drafting import DraftService  # noqa: E402
from backends.serving.local import LocalDrafter  # noqa: E402
from backends.serving.orchestrator import Generation, ServingContext, generate  # noqa: E402
from backends.serving.proposer import build_proposer  # noqa: E402
from backends.serving.request import GenerationRequest  # noqa: E402
from backends.serving.target import TargetRunner  # noqa: E402
from backends.triton_models.step_batch import StepBatcher, in_process  # noqa: E402
from client.cli.bench import load_prompts  # noqa: E402

BINS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.01)


def scored_steps(target: Path, spec: dict, k: int, categories: list[str], max_tokens: int) -> list[tuple]:
    """(scores, drafts accepted) of every drafting step of the prompts' greedy decoding."""
    tokenizer = load_tokenizer(target)
    forward = forward_thread("forward")  # as the server: one thread runs every forward
    runner = forward.submit(TargetRunner, target, "bfloat16").result()
    run_rows = in_process(runner)
    batcher = StepBatcher(lambda rows: forward.submit(run_rows, rows).result(), carries_logprobs=True)
    config = SpeculativeConfig.from_json({**spec, "num_speculative_tokens": k}, target_model=str(target))
    service = forward.submit(
        lambda: DraftService(build_proposer(config, max_model_len=runner.max_model_len, target_model=target), config)
    ).result()
    drafter = LocalDrafter(service)
    ctx = ServingContext({tokenizer.eos_token_id}, runner.max_model_len, load=lambda: 1)
    steps = []

    class Recording(Generation):
        def verify(self, plan, drafted):
            result = super().verify(plan, drafted)
            if not result.waiting and drafted.draft.scores:
                steps.append((drafted.draft.scores, len(result.token_ids) - 1))
            return result

    prompts = load_prompts()[1]
    for category in categories:
        for prompt in prompts[category]:
            req = GenerationRequest(prompt=prompt, max_tokens=max_tokens, num_draft_tokens=k)
            seq_id = random.getrandbits(62)
            ids = tokenizer(prompt)["input_ids"]
            for _ in generate(Recording(req, ids, seq_id, batcher, drafter, TextStream(tokenizer, req.stop), ctx)):
                pass
            batcher.release(seq_id)
            drafter.release(seq_id)
            print(f"{category}: {len(steps)} drafting steps so far", flush=True)
    return steps


def calibration(steps: list[tuple], k: int) -> None:
    for position in range(k):
        reached = [(scores[position], accepted > position) for scores, accepted in steps if len(scores) > position]
        share = sum(ok for _, ok in reached) / max(1, len(reached))
        print(f"draft {position + 1}: {len(reached)} steps, the chain accepted up to it in {share:.2f}")
        for low, high in zip(BINS, BINS[1:]):
            binned = [ok for score, ok in reached if low <= score < high]
            if binned:
                print(
                    f"    score [{low:.2f}, {high:.2f}): {len(binned):4d} steps, accepted {sum(binned) / len(binned):.2f}"
                )


def replay(steps: list[tuple], k: int, floor: float, plain_ms: float, draft_ms: float, row_ms: float) -> tuple:
    """(tokens a step, ms a step, tokens/s) of the steps with a chain ending at its first
    draft under `floor`, that draft cut."""
    tokens = ms = 0.0
    for scores, accepted in steps:
        scores = scores[:k]
        drafted = next((i + 1 for i, s in enumerate(scores) if s < floor), len(scores))
        kept = sum(s >= floor for s in scores[:drafted])
        tokens += 1 + min(accepted, kept)
        ms += plain_ms + draft_ms * drafted + row_ms * kept
    return tokens / len(steps), ms / len(steps), 1000 * tokens / ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--spec", required=True, help="the drafter's speculative config (JSON), k aside")
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--categories", nargs="+", default=["code", "chat"])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--plain-ms", type=float, required=True, help="a plain step, for the replay")
    parser.add_argument("--draft-ms", type=float, required=True, help="what a draft adds to the drafter call")
    parser.add_argument("--row-ms", type=float, required=True, help="what a draft adds to the verify step")
    args = parser.parse_args()
    steps = scored_steps(resolve_model(args.target), json.loads(args.spec), args.k, args.categories, args.max_tokens)
    calibration(steps, args.k)
    for k in range(2, args.k + 1):
        for floor in (0.0, 0.1, 0.2, 0.3):
            tokens, ms, rate = replay(steps, k, floor, args.plain_ms, args.draft_ms, args.row_ms)
            print(f"k {k}, floor {floor:.1f}: {tokens:.2f} tokens a step, {ms:.0f} ms a step, {rate:.1f} tok/s")


if __name__ == "__main__":
    main()
