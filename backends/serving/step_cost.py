"""What a verify step costs by its new tokens, and each row's share of a batched step: the
orchestrator's adaptive k prices a draft token at what it adds to the step (serving/adaptive.py)."""

from __future__ import annotations

import bisect
import statistics
import time
from dataclasses import dataclass

import torch

from backends.runtime.engine import Engine, Row


def step_shares(step_s: float, tokens: list[int], token_cost_s: float) -> list[float]:
    """Each row's share of a batched step that took `step_s` over rows of `tokens` new tokens:
    its own tokens at `token_cost_s` each, plus an even part of the rest. The shares sum to
    `step_s`, and one more token in a row adds `token_cost_s` to that row's share: what it
    adds to the step. (An even split hides that: under load every sequence then finds a
    long draft as cheap as a short one and drafts its maximum, slowing every step.)"""
    total = sum(tokens)
    per_token = min(token_cost_s, step_s / total) if total else 0.0
    rest = step_s - per_token * total
    return [rest / len(tokens) + per_token * n for n in tokens]


@dataclass(frozen=True)
class StepCostCurve:
    """A lean step's time by its number of new tokens, measured at start-up, interpolated
    linearly between the sizes measured and extended with the last slope. The curve bends
    up: a few tokens ride on the weights' one pass through memory (~0.3 ms a token for
    SmolLM2 bf16 on a 2-core AVX-512 CPU up to 8 tokens), past that each one is arithmetic
    (~0.6 ms). So what a draft token costs depends on how many tokens the step already has."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def time(self, n: float) -> float:
        # the segment that ends at the first size >= n (the first or last segment outside them)
        i = min(max(bisect.bisect_left(self.tokens, n), 1), len(self.tokens) - 1)
        (x0, x1), (y0, y1) = self.tokens[i - 1 : i + 1], self.seconds[i - 1 : i + 1]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def token_cost(self, rows: int, total: int) -> float:
        """What one draft token adds to a step of `rows` rows and `total` new tokens: the
        curve's average slope from `rows` tokens (every row's one token, no drafts) to
        `total`, or its slope at `rows` when nothing more is drafted."""
        top = max(total, rows + 1)
        return max(0.0, (self.time(top) - self.time(rows)) / (top - rows))

    def __str__(self) -> str:
        return ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in zip(self.tokens, self.seconds)) + " ms"


# A size's steps are repeated only while they took less than this in all: four steps of every
# size took 5 of a SmolLM2 server's 13-16 s start on the 2-core Zen 1 host (a 64-token step
# 0.57 s there), and would take about 4x that for a 1.5B model. A long step needs no repeat
# for its time to be what it is.
STEP_COST_BUDGET_S = 0.25


def measure_step_cost(
    engine: Engine, context: int = 64, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
) -> StepCostCurve:
    """The step cost curve, on a scratch sequence of `context` cached tokens: a step of each
    size in `sizes` new tokens (median of 3, after one to warm up; fewer where steps are
    long, see STEP_COST_BUDGET_S). The scratch sequence's cache goes back to the engine."""
    probe = "token cost probe"  # not an int: no request's sequence id
    engine.admit(probe, context + max(sizes))
    try:
        engine.forward([Row(probe, [0] * context)], 0)

        def step(n: int) -> float:
            start = time.perf_counter()
            engine.forward([Row(probe, [0] * n)])
            if engine.device.type == "cuda":  # the forward only queued its kernels
                torch.cuda.synchronize(engine.device)
            elapsed = time.perf_counter() - start
            engine.truncate(probe, context)
            return elapsed

        seconds = []
        for n in sizes:
            times = [step(n)]  # the first warms up
            while len(times) < 4 and sum(times) < STEP_COST_BUDGET_S:
                times.append(step(n))
            seconds.append(statistics.median(times[1:] or times))
    finally:
        engine.release(probe)
    return StepCostCurve(sizes, tuple(seconds))
