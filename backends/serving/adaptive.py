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
class AdaptiveDraftLength:
    max_k: int
    alpha: float = 0.6  # prior per-token acceptance, refined from the first drafted step
    decay: float = 0.7  # weight of history in each moving average
    probe_every: int = 16
    verify_s: dict[int, float] = field(default_factory=dict)  # k -> mean verify-call time
    draft_s_per_token: float | None = None
    draft_s_per_call: float | None = None
    _since_probe: int = 0

    def expected_tokens(self, k: int) -> float:
        a = min(self.alpha, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def step_time(self, k: int) -> float:
        draft = 0.0 if k == 0 else (self.draft_s_per_call or 0.0) + (self.draft_s_per_token or 0.0) * k
        return self._verify_time(k) + draft

    def _verify_time(self, k: int) -> float:
        if k in self.verify_s:
            return self.verify_s[k]
        seen = sorted(self.verify_s)
        if not seen:
            return 1.0  # nothing measured yet: every k costs the same
        below = max((j for j in seen if j < k), default=None)
        above = min((j for j in seen if j > k), default=None)
        if below is None:
            return self.verify_s[above]
        if above is None:  # extrapolate with the slope of the two largest seen, never below flat
            if len(seen) < 2:
                return self.verify_s[below]
            j0, j1 = seen[-2], seen[-1]
            slope = max(0.0, (self.verify_s[j1] - self.verify_s[j0]) / (j1 - j0))
            return self.verify_s[below] + slope * (k - below)
        t = (k - below) / (above - below)
        return self.verify_s[below] * (1 - t) + self.verify_s[above] * t

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
        self.verify_s[num_drafted] = self._mix(self.verify_s.get(num_drafted), verify_s)
        if k_asked > 0:
            per_call = draft_s if num_drafted == 0 else None
            if per_call is not None:  # an empty proposal costs only the call itself
                self.draft_s_per_call = self._mix(self.draft_s_per_call, per_call)
            elif self.draft_s_per_call is not None:
                extra = max(0.0, draft_s - self.draft_s_per_call) / num_drafted
                self.draft_s_per_token = self._mix(self.draft_s_per_token, extra)
            else:
                self.draft_s_per_call = self._mix(self.draft_s_per_call, draft_s)
        if num_drafted:
            # Each draft position is a Bernoulli trial until the first rejection.
            trials = num_accepted + (1 if num_accepted < num_drafted else 0)
            self.alpha = self._mix(self.alpha, num_accepted / trials)

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
class TreeSize:
    """Per sequence, the draft-tree size (nodes) that gives the most tokens per second, from a
    few candidates: 0 (a chain), a quarter, half and all of the configured nodes. Each
    candidate keeps moving averages of the tokens its steps emitted and of their wall time
    (verify + draft), so the choice follows both acceptance and the measured cost of
    verifying more nodes. An untried candidate is tried first; the others are probed every
    `probe_every` steps, so the choice can change when the text does."""

    max_nodes: int
    decay: float = 0.7
    probe_every: int = 16
    tokens: dict[int, float] = field(default_factory=dict)  # size -> emitted tokens per step
    seconds: dict[int, float] = field(default_factory=dict)  # size -> step wall time
    _steps: int = 0

    @property
    def sizes(self) -> list[int]:
        return sorted({0, self.max_nodes // 4, self.max_nodes // 2, self.max_nodes})

    def next_size(self, load: int = 1) -> int:
        """The size for the next step; under load (`load` sequences share each forward) at most
        max_nodes / load, since every extra node then costs every sequence's step."""
        self._steps += 1
        sizes = [s for s in self.sizes if s <= self.max_nodes // max(1, load)] or [0]
        untried = [s for s in sizes if s not in self.tokens]
        if untried:
            return untried[-1]
        if self._steps % self.probe_every == 0:  # round-robin over the candidates
            return sizes[(self._steps // self.probe_every) % len(sizes)]
        return max(sizes, key=lambda s: self.tokens[s] / max(self.seconds[s], 1e-9))

    def record(self, size: int, num_emitted: int, step_s: float) -> None:
        self.tokens[size] = moving_average(self.tokens.get(size), num_emitted, self.decay)
        self.seconds[size] = moving_average(self.seconds.get(size), step_s, self.decay)
