"""Acceptance-driven draft length: each step, pick the k that maximises expected tokens per
second for this sequence, and k = 0 (no drafter call at all) when speculation cannot pay.

Tokens per verify step with per-token acceptance α (Leviathan et al., 2023):
    E(k) = (1 - α^(k+1)) / (1 - α)
Step time T(k) = verify(k) + draft(k), both measured on this sequence's own steps (wall
time of the calls, so BLS hops count). Verify time per k is kept in a small table; an
unseen k is interpolated from the nearest seen ones (or assumed flat, the optimistic
choice that lets the table fill). While paused, a probe every `probe_every` steps keeps
α current, so a sequence that turns repetitive gets speculation back.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
        """One finished step: k asked of the drafter, drafts it gave, drafts accepted, and the
        wall time of the verify and draft calls."""
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
            self.alpha = self.decay * self.alpha + (1 - self.decay) * (num_accepted / trials)

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new
