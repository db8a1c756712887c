"""The draft shape of each step, per sequence: plain (no drafter call at all), a chain of k
drafts, or a tree of k levels, whichever gives the most expected tokens per second, so that
speculation never makes a sequence slower than plain decoding for long.

Expected tokens of a verify step come from the acceptance of each draft position
(PositionAcceptance: E(k) = 1 + a_1 + a_1 a_2 + ..., Leviathan et al., 2023, with a rate per
position), a tree's from the chain's and its measured gain (DraftPolicy). Step time is
verify(tokens) + draft(levels), both measured on this sequence's own steps (started from
what the drafter's earlier sequences measured, DraftHistory): the verify step's cost to the
server (StepCost: under load, the sequence's share of the batched
forward, not the whole batch's time it waited for) by tokens verified, kept in a small table
(an unseen count is interpolated from the nearest seen ones, or assumed flat: the optimistic
choice that lets the table fill), and the drafter call's wall time fitted by levels, apart
for chains and trees. A draft must beat a plain step by a margin (2%); when none does, the
sequence decodes plainly and the drafter is not called: what it has not seen (tokens, the
target's hidden rows) waits for its next call, which catches up in one forward (the
drafters' delivery contract, backends/methods/eagle.py). A one-draft probe after at least 8
plain steps, and as many more as keep what probes add under 1% of the time, keeps the first
position's rate current, so a sequence that turns repetitive gets speculation back at a
bounded cost. A sequence's first draft is priced at the acceptance of the drafter's earlier
sequences (DraftHistory), the rest at its own once it drafted. Each sequence
times a plain step (its second, if its first drafted) unless one of the drafter's sequences
timed one in its last PLAIN_EVERY steps: the yardstick every draft is held to. A drafter that
drafts every step (a head) never timed one, and priced as its fewest drafts, a plain step made
any acceptance look worth drafting for (an EAGLE-3 head accepted at 0.32 drafted on at 0.84x
plain where a verified row costs 17% of a step). Every request timing its own cost an n-gram
drafter that matched every step a step's gain (a 32-step request at 4 tokens a step: 2%).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

PLAIN_EVERY = 128  # a drafter's sequences time a plain step at least once in this many steps
HISTORY_TRIALS = 100  # the drafter's acceptance, for a sequence's first draft: over about this many trials


def moving_average(old: float | None, new: float, decay: float) -> float:
    """`new` mixed into `old` with weight 1 - `decay` (`new` itself when nothing came before)."""
    return new if old is None else decay * old + (1 - decay) * new


@dataclass
class RunningMean:
    """The mean of the samples, the prior weighing as `count` + 1 of them, until there are
    `window` of them; then a moving average over about that many. The first samples teach fast
    and later ones are smoothed: a plain moving average of acceptance at 0.8 read a rate of
    0.3 as 0.05 often enough to pause n-gram drafting that paid, and over 10 samples a rate of
    0.5 read as 0.35 often enough to pause a head that paid."""

    value: float
    window: int = 30
    count: int = 0

    def add(self, sample: float) -> None:
        self.count = min(self.count + 1, self.window)
        self.value += (sample - self.value) / (self.count + 1)


@dataclass
class VerifyCosts:
    """A sequence's verify-step cost (StepCost) by its number of drafts: a moving average per
    count seen. An unseen count is interpolated from the nearest seen ones, extrapolated past
    the largest with the slope of the two largest (never below flat), and below the smallest
    (or with nothing seen) taken as flat: the optimistic choice that lets the table fill. A
    count never costs more than a larger one."""

    decay: float = 0.7
    seconds: dict[int, float] = field(default_factory=dict)  # drafts -> mean verify-call time

    def __call__(self, n: int) -> float:
        # More tokens never cost less: a count is never dearer than a larger one was measured.
        # (A plain step measured once at 16.7 ms, against 10 ms for one draft, kept a sequence
        # drafting a head that was never accepted: plain steps were never measured again.)
        larger = [seconds for j, seconds in self.seconds.items() if j > n]
        return min([self._interpolated(n), *larger])

    def _interpolated(self, n: int) -> float:
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
    EAGLE-3 sequence from drafting for the rest of its request. While one length n is all that
    was measured, a shorter one costs its share of n's mean (the optimistic guess that gets it
    tried, and measured: priced at n's whole mean, a head measured at 4 drafts never tried 1)
    and a longer one n's mean; nothing measured costs nothing."""

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
        if spread < 1e-3:  # one length measured (another's weight has faded to nothing)
            return s * min(1.0, drafts / n) if n > 0 else s
        return max(0.0, s + max(0.0, (ns - n * s) / spread) * (drafts - n))


@dataclass
class PositionAcceptance:
    """Per draft position, the chance that the target accepts the draft there once it accepted
    every draft before it, from that position's trials (accepted, or the first rejected) only.
    The expected tokens of a verify step with k drafts (Leviathan et al., 2023, with a rate per
    position as in vLLM's per-position acceptance metrics) are

        E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k.

    One rate for every position misjudges both kinds of drafter: a head's later positions are
    accepted less (a CPU-trained EAGLE-3's top-1 by step: 0.54 / 0.48 / 0.43), an n-gram match
    that is right once mostly runs on. Each rate is a RunningMean of its position's trials. A
    position never tried takes the rate of the last one tried (the prior, weighing as
    `prior_trials` trials, before any): the optimistic choice that gets it tried. A prior that
    weighed as one trial fell to 0.3 on the first rejection, and a head accepted at 0.7
    paused on it."""

    prior: float = 0.6
    window: int = 30  # trials each rate is averaged over
    prior_trials: int = 2
    positions: list[RunningMean] = field(default_factory=list)  # 0 = the first draft

    def rate(self, position: int) -> float:
        if position < len(self.positions):
            return self.positions[position].value
        return self.positions[-1].value if self.positions else self.prior

    def expected_tokens(self, k: int) -> float:
        total = reach = 1.0
        for position in range(k):
            reach *= min(self.rate(position), 0.999)
            total += reach
        return total

    def forget(self, trials: int = 2) -> None:
        """Weigh what was learnt as at most `trials` trials: paused, only rare probes teach, and
        each must move the rates (at 10 trials a rate of 0 took five accepted probes to pass 0.4)."""
        for mean in self.positions:
            mean.count = min(mean.count, trials)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One verified chain: its first `num_accepted` drafts accepted, the next one (if it
        was drafted) rejected; positions past that were not tried."""
        for position in range(min(num_accepted + 1, num_drafted)):
            if position == len(self.positions):
                weight = 1 if self.positions else self.prior_trials  # a later position starts from the one before
                self.positions.append(RunningMean(self.rate(position), self.window, weight - 1))
            self.positions[position].add(float(position < num_accepted))


@dataclass(frozen=True)
class Shape:
    """What a step drafts: `depth` levels (k; 0 is a plain step), as a chain or as a tree of
    the config's nodes for that depth."""

    depth: int
    tree: bool = False


PLAIN = Shape(0)


@dataclass
class DraftPolicy:
    """Each step's draft shape for one sequence: plain, a chain of k, or a tree of k levels,
    whichever gives the most expected tokens per second (see the module docstring).

    Trees: a tree step verifies the tree's nodes that pay (DraftCut, on this policy's verify
    table) after a draft whose cost is fitted by levels. Its expected tokens are the chain's
    at the same depth times the tree's gain: tokens per tree step over what the tree's chain
    of first children would have given on the same steps (RunningMeans, from a gain of 1.25),
    so a tree is drafted only while what its siblings add pays for drafting and verifying
    them."""

    max_k: int
    tree_nodes: Callable[[int], int] | None = None  # a tree config's nodes at a depth; None: chains only
    prior: float = 0.6  # acceptance per position before any is measured
    decay: float = 0.7  # weight of history in the cost averages
    probe_every: int = 8  # paused: a 1-draft probe after at least this many plain steps ...
    probe_budget: float = 0.01  # ... and as many more as keep probes under this part of the time
    margin: float = 0.02  # paused, a draft must be expected to beat a plain step by this much
    history: DraftHistory | None = None  # what the drafter's sequences measured: where this one starts
    acceptance: PositionAcceptance = field(init=False)
    verify: VerifyCosts = field(init=False)  # by tokens verified (drafts or tree nodes)
    draft: DraftCost = field(init=False)  # a chain's drafter call, by drafts
    tree_draft: DraftCost = field(init=False)  # a tree's drafter call, by levels
    # tokens a tree step emitted, and its first children's chain: priors weighing as two steps
    _tree_tokens: RunningMean = field(default_factory=lambda: RunningMean(1.25, count=1))
    _chain_tokens: RunningMean = field(default_factory=lambda: RunningMean(1.0, count=1))
    _tree_verified: float | None = None  # nodes a tree step verified after the cut
    _drafting: bool = True
    _since_probe: int = 0
    _steps: int = 0  # this sequence's steps recorded
    _timed_plain: bool = False  # one of them was plain
    _tried: bool = False  # one of them verified a draft (until then, the history's acceptance)

    def __post_init__(self) -> None:
        self.acceptance = PositionAcceptance(self.prior)
        self.verify = VerifyCosts(self.decay)
        self.draft, self.tree_draft = DraftCost(self.decay), DraftCost(self.decay)
        if self.history is not None:
            self.history.seed(self)

    def expected_tokens(self, shape: Shape) -> float:
        chain = self.acceptance.expected_tokens(shape.depth)
        return chain * self._tree_tokens.value / self._chain_tokens.value if shape.tree else chain

    def step_time(self, shape: Shape) -> float:
        if not shape.depth:
            return self.verify(0)
        if not shape.tree:
            return self.verify(shape.depth) + self.draft(shape.depth)
        nodes = self.tree_nodes(shape.depth)
        verified = nodes if self._tree_verified is None else min(nodes, round(self._tree_verified))
        return self.verify(verified) + self.tree_draft(shape.depth)

    def rate(self, shape: Shape) -> float:
        """Expected tokens per second."""
        return self.expected_tokens(shape) / self.step_time(shape)

    def next_shape(self, limit: int) -> Shape:
        """The shape of the next step, at most `limit` levels (the room left, the client's or
        the batch-size schedule's k)."""
        limit = min(limit, self.max_k)
        if limit <= 0:
            return PLAIN
        if self._steps and not self._timed_plain and (self.history is None or self.history.plain_is_stale()):
            return PLAIN
        shapes = [Shape(k) for k in range(1, limit + 1)]
        if self.tree_nodes is not None:
            shapes += [Shape(k, tree=True) for k in range(1, limit + 1) if self.tree_nodes(k) > k]
        best = max(shapes, key=self.rate)  # ties: the first, the shortest chain
        # Hysteresis: drafting goes on while it is expected to pay at all; a pause ends only
        # for a clear gain, as each switch back costs the drafter a catch-up call.
        self._drafting = self.rate(best) > self.rate(PLAIN) * (1 if self._drafting else 1 + self.margin)
        if self._drafting:
            self._since_probe = 0
            return best
        # Paused: the drafter is not called (it catches up on its next call). A probe now and
        # then keeps the first position's rate current, as often as its cost allows: what it
        # adds to a plain step, spread over the steps between probes, stays under probe_budget.
        # Probes are rare, so each one weighs as much as the little learnt before it.
        self.acceptance.forget()
        self._since_probe += 1
        probe_cost = self.step_time(Shape(1)) - self.verify(0)
        if self._since_probe < max(self.probe_every, probe_cost / (self.probe_budget * self.verify(0))):
            return PLAIN
        self._since_probe = 0
        return Shape(1)

    def record(
        self, depth: int, num_drafted: int, num_accepted: int, verify_s: float, draft_s: float | None, num_cut: int = 0
    ) -> None:
        """One finished chain step: k asked of the drafter, drafts verified, drafts accepted,
        the verify step's cost (StepCost), the draft call's wall time (None: a call that
        caught up on a pause, whose time is not the step's) and the drafts the cut dropped
        (DraftCut): drafted, paid for, and counted as the first one rejected, so a drafter
        whose drafts are mostly cut is paused like one whose drafts are rejected."""
        self._record_costs(num_drafted, verify_s, num_drafted + num_cut, draft_s if depth > 0 else None, tree=False)
        self._record_trial(num_drafted + min(num_cut, 1), num_accepted)

    def record_tree(
        self,
        depth: int,
        num_verified: int,
        num_emitted: int,
        chain: tuple[int, int],
        verify_s: float,
        draft_s: float | None,
    ) -> None:
        """One finished tree step: its levels, the nodes verified (after the cut), the tokens
        emitted, the verify step's cost and the draft call's wall time (as `record`). `chain`:
        (drafts, accepted) of the tree's chain of first children, what a chain would have had:
        the positions' acceptance learns from tree steps too."""
        self._record_costs(num_verified, verify_s, depth, draft_s, tree=True)
        self._record_trial(*chain)
        self._tree_verified = moving_average(self._tree_verified, num_verified, self.decay)
        self._tree_tokens.add(num_emitted)
        self._chain_tokens.add(1 + chain[1])

    def _record_trial(self, num_drafted: int, num_accepted: int) -> None:
        """A verified chain (or a tree's chain of first children) into the acceptance rates.
        The history's rates priced this sequence's first draft; if it drafted on them, its own
        start at the prior. A sequence the history kept paused goes on from the history's
        rates: from the prior, its first rejected probe read 0.4 and resumed drafting."""
        if not num_drafted:
            return
        if not self._tried:
            if self._drafting:
                self.acceptance = PositionAcceptance(self.prior)
            self._tried = True
        self.acceptance.record(num_drafted, num_accepted)
        if self.history is not None:
            self.history.record_trial(num_drafted, num_accepted)

    def _record_costs(self, verified: int, verify_s: float, drafted: int, draft_s: float | None, tree: bool) -> None:
        """A step's verify cost by tokens verified, and its drafter call's (None: not timed) by
        drafts or tree levels, here and in the drafter's history."""
        self._steps, self._timed_plain = self._steps + 1, self._timed_plain or verified == 0
        add_step_costs(self.verify, self.tree_draft if tree else self.draft, verified, verify_s, drafted, draft_s)
        if self.history is not None:
            self.history.record(verified, verify_s, drafted, draft_s, tree)


def add_step_costs(
    verify: VerifyCosts, draft: DraftCost, verified: int, verify_s: float, drafted: int, draft_s: float | None
) -> None:
    """A step's verify cost by tokens verified, and its drafter call's (None: not timed)."""
    verify.record(verified, verify_s)
    if draft_s is not None:
        draft.record(drafted, draft_s)


class DraftHistory:
    """What every sequence of one drafter has measured, for each new sequence to start from:
    the step costs (verify by tokens verified, the drafter call by drafts and by tree levels),
    which are the server's and the drafter's whichever request a step serves, and the
    acceptance per position over the last HISTORY_TRIALS trials, which prices a sequence's
    first draft (and, where it keeps the sequence paused, its probes).

    Started from nothing, every request paid again for finding out: its first steps drafted as
    deep as a head whose drafts could never pay (3 ms + 4 ms a level against an 8 ms step),
    and priced at the prior 0.6, an n-gram drafter whose requests copy their answers from
    their prompts drafted a chain of 2 first. Once a sequence drafted, its acceptance is its
    own (DraftPolicy._record_trial): started from the last requests' rates, a request whose
    drafts were rarely accepted after ones whose drafts were drafted on until its own trials
    outweighed them. Shared by the threads of one model's requests."""

    def __init__(self, decay: float = 0.7) -> None:
        self._lock = threading.Lock()
        self._since_plain: int | None = None  # steps since the last plain one (None: none yet)
        self._verify = VerifyCosts(decay)
        self._draft, self._tree_draft = DraftCost(decay), DraftCost(decay)
        self._acceptance = PositionAcceptance(window=HISTORY_TRIALS)

    def seed(self, policy: DraftPolicy) -> None:
        """Start a new sequence's cost tables, and its acceptance until its first trial, from
        the history's."""
        with self._lock:
            policy.verify.seconds = dict(self._verify.seconds)
            policy.draft.means, policy.tree_draft.means = self._draft.means, self._tree_draft.means
            window = policy.acceptance.window
            policy.acceptance.positions = [RunningMean(mean.value, window) for mean in self._acceptance.positions]

    def record_trial(self, num_drafted: int, num_accepted: int) -> None:
        """A verified chain of any sequence (PositionAcceptance.record)."""
        with self._lock:
            self._acceptance.record(num_drafted, num_accepted)

    def plain_is_stale(self) -> bool:
        """No sequence timed a plain step in the last PLAIN_EVERY steps."""
        with self._lock:
            return self._since_plain is None or self._since_plain >= PLAIN_EVERY

    def record(self, verified: int, verify_s: float, drafted: int, draft_s: float | None, tree: bool) -> None:
        """One step of any sequence (DraftPolicy._record_costs)."""
        with self._lock:
            self._since_plain = 0 if verified == 0 else None if self._since_plain is None else self._since_plain + 1
            add_step_costs(
                self._verify, self._tree_draft if tree else self._draft, verified, verify_s, drafted, draft_s
            )


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
class DraftCut:
    """Per sequence and step, how many nodes of a scored draft to verify: the m nodes of the
    highest score (the drafter's probability of a node's whole path: EAGLE-2's rerank, closed
    under parents; a chain's first m drafts) that give the most expected tokens per second,

        (1 + sum of their scores) / (verify(m) + draft),

    a node's score standing for the chance that the target accepts it and its ancestors;
    verify(m) is this sequence's measured verify cost for m drafts (DraftPolicy's table, which
    its steps fill: under load its share of the batched forward, where a node costs what it
    adds to the batch); draft is the drafter call's wall time, spent whatever m. m = 0 is a plain step. While the one
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
