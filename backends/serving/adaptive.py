"""Acceptance-driven draft length: each step, pick the k that maximises expected tokens per
second for this sequence, and k = 0 (no drafter call at all) when speculation cannot pay.

Tokens per verify step with per-token acceptance α (Leviathan et al., 2023):
    E(k) = (1 - α^(k+1)) / (1 - α)
Step time T(k) = verify(k) + draft(k), both measured on this sequence's own steps: the
drafter call's wall time, and the verify step's cost to the server (StepCost: under load,
the sequence's share of the batched forward, not the whole batch's time it waited for).
Verify time per k is kept in a small table; an unseen k is interpolated from the nearest
seen ones (or assumed flat, the optimistic choice that lets the table fill). While paused, a
probe every `probe_every` steps keeps α current, so a sequence that turns repetitive gets
speculation back.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def moving_average(old: float | None, new: float, decay: float) -> float:
    """`new` mixed into `old` with weight 1 - `decay` (`new` itself when nothing came before)."""
    return new if old is None else decay * old + (1 - decay) * new


@dataclass
class VerifyCosts:
    """A sequence's verify-step cost (StepCost) by its number of drafts: a moving average per
    count seen. An unseen count is interpolated from the nearest seen ones, extrapolated past
    the largest with the slope of the two largest (never below flat), and below the smallest
    (or with nothing seen) taken as flat: the optimistic choice that lets the table fill."""

    decay: float = 0.7
    seconds: dict[int, float] = field(default_factory=dict)  # drafts -> mean verify-call time

    def __call__(self, n: int) -> float:
        if n in self.seconds:
            return self.seconds[n]
        seen = sorted(self.seconds)
        if not seen:
            return 1.0  # nothing measured yet: every count costs the same
        below = max((j for j in seen if j < n), default=None)
        above = min((j for j in seen if j > n), default=None)
        if below is None:
            return self.seconds[above]
        if above is None:
            if len(seen) < 2:
                return self.seconds[below]
            j0, j1 = seen[-2], seen[-1]
            slope = max(0.0, (self.seconds[j1] - self.seconds[j0]) / (j1 - j0))
            return self.seconds[below] + slope * (n - below)
        t = (n - below) / (above - below)
        return self.seconds[below] * (1 - t) + self.seconds[above] * t

    def record(self, n: int, seconds: float) -> None:
        self.seconds[n] = moving_average(self.seconds.get(n), seconds, self.decay)


@dataclass
class DraftCost:
    """A drafter call's seconds as a + b * drafts, fitted by least squares to moving averages
    of the calls (an empty proposal is a call at 0 drafts). Every call moves the fit, so a slow
    one fades like any other: the per-call part used to be fixed by the first call for a drafter
    that always drafts (the heads), and one cold call of 6.6 ms against 2 ms steady kept an
    EAGLE-3 sequence from drafting for the rest of its request. A drafter asked for one length
    only costs its mean at every length (no slope to fit), and nothing measured costs nothing."""

    decay: float = 0.7
    means: tuple[float, ...] | None = None  # drafts, seconds, drafts^2, drafts * seconds

    def record(self, drafts: int, seconds: float) -> None:
        sample = (drafts, seconds, drafts * drafts, drafts * seconds)
        self.means = (
            sample
            if self.means is None
            else tuple(moving_average(m, x, self.decay) for m, x in zip(self.means, sample))
        )

    def __call__(self, drafts: int) -> float:
        if self.means is None:
            return 0.0
        n, s, nn, ns = self.means
        spread = nn - n * n
        slope = max(0.0, (ns - n * s) / spread) if spread > 1e-9 else 0.0
        return max(0.0, s + slope * (drafts - n))


@dataclass
class AdaptiveDraftLength:
    max_k: int
    alpha: float = 0.6  # per-token acceptance: its prior, then accepted / trials (moving averages)
    decay: float = 0.7  # weight of history in each moving average
    probe_every: int = 16
    verify: VerifyCosts = field(init=False)  # verify time per k, averaged with `decay`
    draft: DraftCost = field(init=False)
    _since_probe: int = 0
    _accepted: float = field(init=False)  # drafts accepted a step, moving average
    _trials: float = field(init=False)  # positions tried a step (accepted + the first rejected)

    def __post_init__(self) -> None:
        self.verify = VerifyCosts(self.decay)
        self.draft = DraftCost(self.decay)
        self._accepted, self._trials = self.alpha, 1.0  # the prior counts as one trial

    def expected_tokens(self, k: int) -> float:
        a = min(self.alpha, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def step_time(self, k: int) -> float:
        return self.verify(k) + (self.draft(k) if k else 0.0)

    def next_k(self, limit: int) -> int:
        """Draft length for the next step, at most `limit` (room left, client's choice)."""
        limit = min(limit, self.max_k)
        if limit <= 0:
            return 0
        best = max(range(limit + 1), key=lambda k: (self.expected_tokens(k) / self.step_time(k), -k))
        if best == 0:
            self._since_probe += 1
            if self._since_probe >= self.probe_every:
                self._since_probe = 0
                return 1
        return best

    def record(self, k_asked: int, num_drafted: int, num_accepted: int, verify_s: float, draft_s: float) -> None:
        """One finished step: k asked of the drafter, drafts it gave, drafts accepted, the
        verify step's cost (StepCost) and the draft call's wall time."""
        self.verify.record(num_drafted, verify_s)
        if k_asked > 0:
            self.draft.record(num_drafted, draft_s)
        if num_drafted:
            # Each draft position is a Bernoulli trial until the first rejection. Trials and
            # acceptances are averaged apart: the mean of each step's ratio is biased low (a
            # rejected first draft weighs as much as three accepted ones; at 0.5 per position
            # and 3 drafts it averages 0.33), which stopped EAGLE-3 drafting where it paid.
            trials = num_accepted + (1 if num_accepted < num_drafted else 0)
            self._accepted = self._mix(self._accepted, num_accepted)
            self._trials = self._mix(self._trials, trials)
            self.alpha = self._accepted / self._trials

    def _mix(self, old: float | None, new: float) -> float:
        return moving_average(old, new, self.decay)


@dataclass
class StepCost:
    """A verify step's cost as the draft-length policies weigh it: the sequence's share of the
    forward (the verifier's `forward_s`: its own tokens at what one token adds to the step,
    plus an even part of the rest) and the call's hops (wall time beyond the forward, measured
    while the sequence is served alone) shared by the `load` sequences served now. Alone,
    that is the call's wall time. Under load, the wall time is the whole batch's step, which
    one sequence's draft length hardly changes: weighed by it, every sequence would draft
    its maximum while each extra token slows everyone's step."""

    decay: float = 0.7
    hop_s: float | None = None

    def __call__(self, forward_s: float, wall_s: float, load: int) -> float:
        if load <= 1:
            hop = max(0.0, wall_s - forward_s)
            self.hop_s = moving_average(self.hop_s, hop, self.decay)
        return forward_s + (self.hop_s or 0.0) / max(1, load)


@dataclass
class TreeCut:
    """Per sequence and step, how many nodes of a draft tree to verify: the m nodes of the
    highest score (the drafter's probability of a node's whole path: EAGLE-2's rerank, closed
    under parents) that give the most expected tokens per second,

        (1 + sum of their scores) / (verify(m) + draft),

    a node's score standing for the chance that the target accepts it and its ancestors;
    verify(m) is this sequence's measured verify cost for m drafts (VerifyCosts: under load
    its share of the batched forward, where a node costs what it adds to the batch); draft
    is the drafter call's wall time, spent whatever m. m = 0 is a plain step. While the one
    size measured is the one chosen (a drafter that always fills its tree), a step keeps half
    as many nodes, so the cost's slope gets measured too.

    It replaces a bandit over four tree sizes (0, 1/4, 1/2 and all of the nodes, at most
    nodes / load under load), which spent steps probing sizes that never paid and could not
    follow one step's confidence. Replayed offline on the bench's greedy outputs (suffix trees
    of 16 levels and nodes, all four prompt families), at SmolLM2's measured batch-1 step costs
    the cut estimated 3-4% more tokens per second than the bandit on the same tree (13% more
    than the 8-deep chain), and at a compute-bound cost (0.6 ms a token, what a node adds to a
    loaded batch) as much as the chain, where the uncut tree lost 30%. Scaling the scores by
    what was accepted (accepted / predicted, moving averages) did no better at batch 1 and
    under load got stuck: one rejected step lowered the scale, the cut then verified nothing,
    and nothing raised it again."""

    verify: VerifyCosts = field(default_factory=VerifyCosts)

    def cut(self, scores: list[float], draft_s: float) -> int:
        """How many of the nodes to keep, given their `scores` (any order)."""
        gain, cost = 1.0, self.verify(0)
        best, best_rate = 0, gain / (cost + draft_s)
        for m, score in enumerate(sorted(scores, reverse=True), 1):
            gain += score
            cost = max(cost, self.verify(m))  # more nodes never cost less (measurements are noisy)
            rate = gain / (cost + draft_s)
            if rate > best_rate:
                best, best_rate = m, rate
        if best > 1 and list(self.verify.seconds) == [best]:
            return best // 2  # one size measured, chosen again: measure a second, for the slope
        return best

    def record(self, num_nodes: int, verify_s: float) -> None:
        """One verified step: nodes verified and the verify step's cost (StepCost)."""
        self.verify.record(num_nodes, verify_s)
