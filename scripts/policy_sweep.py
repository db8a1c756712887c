"""The draft-shape policy (backends/serving/adaptive.py) against scripted drafters, over many
seeds: what a change to the policy does to speed, before it meets a server's noise.

A scripted drafter is accepted at a fixed rate per position and costs a fixed time a call and
a level; a step's verify time follows a fixed curve by tokens verified. Each scenario runs
`--requests` requests of `--steps` steps in turn, sharing one DraftHistory as a served model's
requests do, for each of `--seeds` seeds, and reports tokens per second (over the requests
after the first; over the one request when there is one) against the best fixed shape for
that drafter (plain included) and against plain steps, and how many runs lost more than 3%
to plain. Mixed scenarios alternate two drafters' rates from request to request (a chat
request after a code one). tests/unit/test_adaptive.py runs the same simulator.

    .venv/bin/python scripts/policy_sweep.py --seeds 100 --steps 100 --requests 5
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from backends.serving.adaptive import PLAIN, DraftHistory, DraftPolicy, Shape  # noqa: E402

Verify = Callable[[int], float]  # tokens verified -> seconds


@dataclass
class Drafter:
    """A scripted drafter: accepted at `rates[i]` at position i (the last rate past them), a
    call costing `call_s` + `level_s` a level + `row_s` a row it catches up on; as a tree of
    `nodes` nodes, a rejected level is rescued by a sibling at `sibling`."""

    rates: tuple[float, ...]
    call_s: float
    level_s: float
    row_s: float = 0.00005
    sibling: float = 0.0
    tree_level_s: float | None = None  # a tree level's cost (default: a chain level's)

    def rate(self, position: int) -> float:
        return self.rates[min(position, len(self.rates) - 1)]

    def draft_s(self, shape: Shape) -> float:
        level_s = self.tree_level_s if shape.tree and self.tree_level_s is not None else self.level_s
        return self.call_s + level_s * shape.depth


def verify_s(tokens: int) -> float:
    """SmolLM2 bf16 on an AVX-512 BF16 CPU: a token adds 4% to an 8 ms step."""
    return 0.008 + 0.0003 * tokens


def avx2_verify_s(tokens: int) -> float:
    """The same on an AVX2 CPU (float32 FMAs): a 13.4 ms step, 17% more a token."""
    return 0.0134 * (1 + 0.17 * tokens)


def tree_nodes(depth: int) -> int:
    return 4 * depth


NGRAM = dict(call_s=0.00005, level_s=0.00001)  # a lookup
FAST_HEAD = dict(call_s=0.0005, level_s=0.0004)  # a head at kernel cost (issue 55's goal: a level <= 8%)
HEAD = dict(call_s=0.001, level_s=0.0015)  # a head's level through Python (today's EAGLE-3 chain)
SLOW_HEAD = dict(call_s=0.003, level_s=0.004)  # a tree level today
AVX2_HEAD = dict(call_s=0.001, level_s=0.0008)  # EAGLE-3's chain of 3 at 25% of a 13.4 ms step


def step(
    policy: DraftPolicy,
    drafter: Drafter,
    rng: random.Random,
    unseen: int,
    verify: Verify = verify_s,
    noise: float = 0.0,
) -> tuple[Shape, int, float]:
    """One step as Generation runs it: the shape, the tokens it emitted, the seconds it took,
    charged as they would be spent: a drafter call that catches up on a pause costs its rows
    too, which the policy is not told (Generation does not time such calls). `noise`: each
    time taken is the curve's times a lognormal factor of that sigma (a busy host's spread)."""

    def jitter(seconds: float) -> float:
        return seconds * rng.lognormvariate(0.0, noise) if noise else seconds

    shape = policy.next_shape(4)
    if not shape.depth:
        took = jitter(verify(0))
        policy.record(0, 0, 0, took, None)
        return shape, 1, took
    accepted = 0
    while accepted < shape.depth and rng.random() < drafter.rate(accepted):
        accepted += 1
    draft_s = jitter(drafter.draft_s(shape))
    timed = draft_s if unseen <= policy.max_k + 1 else None
    draft_s += drafter.row_s * unseen
    tried = min(accepted + 1, shape.depth)
    if not shape.tree:
        verified = jitter(verify(shape.depth))
        policy.record(shape.depth, shape.depth, accepted, verified, timed)
        return shape, accepted + 1, verified + draft_s
    rescued = accepted < shape.depth and rng.random() < drafter.sibling
    emitted = accepted + 1 + rescued
    verified = jitter(verify(tree_nodes(shape.depth)))
    policy.record_tree(shape.depth, tree_nodes(shape.depth), emitted, (tried, accepted), verified, timed)
    return shape, emitted, verified + draft_s


def run_policy(
    drafter: Drafter,
    steps: int,
    policy: DraftPolicy | None = None,
    seed: int = 0,
    verify: Verify = verify_s,
    noise: float = 0.0,
) -> tuple[DraftPolicy, list[Shape], float]:
    """`steps` steps: the policy, the shapes chosen, and tokens per second over them."""
    policy = policy or DraftPolicy(max_k=4, tree_nodes=tree_nodes if drafter.sibling else None)
    rng, shapes, tokens, seconds, unseen = random.Random(seed), [], 0, 0.0, 1
    for _ in range(steps):
        shape, emitted, took = step(policy, drafter, rng, unseen, verify, noise)
        unseen = emitted if shape.depth else unseen + emitted
        shapes.append(shape)
        tokens, seconds = tokens + emitted, seconds + took
    return policy, shapes, tokens / seconds


def fixed_rate(drafter: Drafter, shape: Shape, verify: Verify = verify_s) -> float:
    """Tokens per second of drafting `shape` every step (no catch-up rows)."""
    tokens = reach = 1.0
    for position in range(shape.depth):
        reach *= drafter.rate(position)
        tokens += reach
    if not shape.depth:
        return 1 / verify(0)
    if not shape.tree:
        return tokens / (verify(shape.depth) + drafter.draft_s(shape))
    tokens += (1 - reach) * drafter.sibling  # a rejected level rescued by a sibling
    return tokens / (verify(tree_nodes(shape.depth)) + drafter.draft_s(shape))


def best_fixed(drafter: Drafter, verify: Verify = verify_s) -> float:
    shapes = [PLAIN] + [
        Shape(k, tree) for k in range(1, 5) for tree in ((False, True) if drafter.sibling else (False,))
    ]
    return max(fixed_rate(drafter, shape, verify) for shape in shapes)


SCENARIOS: dict[str, tuple[list[Drafter], Verify]] = {
    "ngram 0.1": ([Drafter((0.1,), **NGRAM)], verify_s),
    "ngram 0.5": ([Drafter((0.5,), **NGRAM)], verify_s),
    "ngram 0.9": ([Drafter((0.9,), **NGRAM)], verify_s),
    "head 0.05": ([Drafter((0.05,), **HEAD)], verify_s),
    "head 0.3": ([Drafter((0.3,), **HEAD)], verify_s),
    "head 0.5": ([Drafter((0.5,), **HEAD)], verify_s),
    "head 0.7": ([Drafter((0.7,), **HEAD)], verify_s),
    "head .54/.48/.43": ([Drafter((0.54, 0.48, 0.43), **HEAD)], verify_s),
    "head 0.5 tree 0.6": ([Drafter((0.5,), **HEAD, sibling=0.6)], verify_s),
    "fast head 0.3": ([Drafter((0.3,), **FAST_HEAD)], verify_s),
    "fast head 0.5 tree 0.6": ([Drafter((0.5,), **FAST_HEAD, sibling=0.6)], verify_s),
    "slow head 0.5": ([Drafter((0.5,), **SLOW_HEAD)], verify_s),
    "slow head 0.7": ([Drafter((0.7,), **SLOW_HEAD)], verify_s),
    "avx2 head .32/.07/0": ([Drafter((0.32, 0.07, 0.0), **AVX2_HEAD)], avx2_verify_s),
    "avx2 head .54/.48/.43": ([Drafter((0.54, 0.48, 0.43), **AVX2_HEAD)], avx2_verify_s),
    "avx2 ngram 0.3": ([Drafter((0.3,), **NGRAM)], avx2_verify_s),
    "mixed head 0.7 / 0.1": ([Drafter((0.7,), **HEAD), Drafter((0.1,), **HEAD)], verify_s),
    "mixed head 0.5 / 0.2": ([Drafter((0.5,), **HEAD), Drafter((0.2,), **HEAD)], verify_s),
    "mixed ngram 0.9 / 0.1": ([Drafter((0.9,), **NGRAM), Drafter((0.1,), **NGRAM)], verify_s),
    "mixed tree 0.5+0.6 / 0.2+0.3": (
        [Drafter((0.5,), **HEAD, sibling=0.6), Drafter((0.2,), **HEAD, sibling=0.3)],
        verify_s,
    ),
}


def sweep(
    drafters: list[Drafter], verify: Verify, seeds: int, steps: int, requests: int, noise: float
) -> tuple[list, list]:
    """Per request measured (after the first, unless there is one): speed over the best fixed
    shape's, and over plain steps'."""
    of_best, of_plain = [], []
    for seed in range(seeds):
        history = DraftHistory()
        for r in range(requests):
            drafter = drafters[r % len(drafters)]
            policy = DraftPolicy(max_k=4, tree_nodes=tree_nodes if drafter.sibling else None, history=history)
            speed = run_policy(drafter, steps, policy, seed * 1000 + r, verify, noise)[2]
            if r or requests == 1:
                speed *= math.exp(noise**2 / 2)  # what noise adds to every time, on average
                of_best.append(speed / best_fixed(drafter, verify))
                of_plain.append(speed * verify(0))
    return of_best, of_plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--steps", type=int, default=100, help="per request (128 tokens take 60-100)")
    parser.add_argument("--requests", type=int, default=5, help="in turn, sharing the drafter's history")
    parser.add_argument("--noise", type=float, default=0.0, help="sigma of a lognormal factor on every time taken")
    args = parser.parse_args()
    print("scenario                        best/plain | speed/best mean   p10 | speed/plain min  runs < 0.97")
    for name, (drafters, verify) in tqdm(SCENARIOS.items(), desc="scenarios", leave=False):
        of_best, of_plain = sweep(drafters, verify, args.seeds, args.steps, args.requests, args.noise)
        best = statistics.mean(best_fixed(d, verify) * verify(0) for d in drafters)
        p10 = sorted(of_best)[len(of_best) // 10]
        losing = sum(x < 0.97 for x in of_plain)
        tqdm.write(
            f"{name:30s} {best:10.2f} | {statistics.mean(of_best):15.3f} {p10:5.3f} | {min(of_plain):15.3f}"
            f"  {losing}/{len(of_plain)}"
        )


if __name__ == "__main__":
    main()
