"""Rejection sampling of speculative drafts, with the semantics of vLLM V1's rejection sampler.

Layout (vLLM V1): drafts are flattened over the batch; request ``i`` with ``n_i`` drafts owns
``n_i + 1`` consecutive target-logit rows, row ``j`` verifying draft ``j`` and the last one being
its bonus row.

Per request the result is the accepted drafts plus one token: the target's token at the first
rejection (greedy: the argmax; random: a sample of normalize(max(p - q, 0))), or the bonus token
when every draft is accepted. Greedy means temperature < 1e-5 (request.is_greedy); a random
request samples from the target logits after temperature, top-k and top-p, and keeps draft x with
probability min(1, p(x) / q(x)), q(x) = 1 when the proposer gives no draft probabilities (n-gram
style).
A -1 draft is always rejected.

Randomness: a random request draws, in this order, V uniforms for the exponential noise of its
bonus token, one float64 uniform per draft, then (if it has drafts) V uniforms for the noise of
its recovered tokens, all from its own generator (torch's default one when it has none). A seeded
request's output therefore does not depend on the rest of the batch.

The accept/recover steps run as OpenAI Triton kernels on CUDA tensors (or anywhere when
``TRITONSPEC_USE_KERNELS=1``; without CUDA, Triton's interpreter runs them), and as their torch
references otherwise; both give identical tokens. One rounding-level difference from vLLM: the
acceptance test p / q >= u is evaluated as p >= u * q in float64, which rounds the same on every
device.
"""

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from backends.runtime.cpu_kernels import argmax_rows
from backends.serving.request import GREEDY, SamplingParams, is_greedy
from kernels import rejection as rk

MAX_SPEC_LEN = 128  # vLLM V1's limit on drafts per request
PLACEHOLDER_TOKEN_ID = rk.PLACEHOLDER_TOKEN_ID


# --- sampling parameters ----------------------------------------------------------------------


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask ``logits`` [N, V] to -inf outside each row's top-k, then outside its top-p nucleus.

    Per-row ``top_k`` <= 0 or >= V and ``top_p`` = 1 disable the filter for that row. As in vLLM,
    top-k keeps every logit tied with the k-th largest, and top-p drops the tokens whose ascending
    cumulative probability is <= 1 - p, always keeping the most likely one.
    """
    if top_k is None and top_p is None:
        return logits
    # One ascending sort serves both filters; the result is scattered back to vocab order.
    ascending, order = logits.sort(dim=-1, stable=True)
    if top_k is not None:
        vocab_size = logits.shape[-1]
        k = top_k.to(logits.device, torch.int64)
        k = torch.where((k <= 0) | (k > vocab_size), vocab_size, k)
        kth_largest = ascending.gather(1, (vocab_size - k).unsqueeze(1))
        ascending = ascending.masked_fill(ascending < kth_largest, -math.inf)
    if top_p is not None:
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p.to(logits).unsqueeze(1)
        drop[:, -1] = False
        ascending = ascending.masked_fill(drop, -math.inf)
    return torch.empty_like(logits).scatter_(1, order, ascending)


def apply_temperature_top_k_top_p(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Target probabilities [N, V] (float32) from logits [N, V] and per-row parameters [N].

    Greedy rows (temperature < 1e-5) are divided by 1, as vLLM does; their probabilities go unused.
    """
    temperature = temperature.to(logits.device, torch.float32)
    temperature = torch.where(is_greedy(temperature), 1.0, temperature)
    scaled = logits.float() / temperature.unsqueeze(1)
    return apply_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)


def request_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """One request's target probabilities [N, V] at each row of ``logits`` [N, V] under its
    temperature, top-k and top-p."""
    return apply_temperature_top_k_top_p(logits, *_request_rows(sampling, logits.shape[0]))


def _request_rows(sampling: SamplingParams, rows: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A request's temperature, top-k and top-p repeated over `rows` rows. Disabled filters are
    dropped, not applied as no-ops (vLLM skips them too): saves a sort."""
    top_k, top_p = sampling.top_k, sampling.top_p
    return (
        torch.full((rows,), sampling.temperature),
        torch.full((rows,), top_k) if top_k is not None and top_k > 0 else None,
        torch.full((rows,), top_p) if top_p is not None and top_p < 1 else None,
    )


def new_generator(device: torch.device, seed: int | None) -> torch.Generator:
    """A generator of its own: seeded for reproducible requests, else from OS entropy."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


# --- rejection sampling -----------------------------------------------------------------------


def rejection_sample(
    draft_token_ids: list[int],
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Verify one request's drafts: returns the accepted drafts plus the recovered or bonus token.

    ``target_logits``: [len(drafts) + 1, V]; ``draft_probs``: [len(drafts), V] or None;
    ``sampling``: its temperature, top-k and top-p (vLLM's sampling metadata); ``generator``
    lives on the logits' device.
    """
    if sampling.greedy:
        return _greedy_accept_one(draft_token_ids, target_logits)
    temperature, top_k, top_p = _request_rows(sampling, 1)
    return rejection_sample_batch(
        torch.tensor(draft_token_ids, dtype=torch.int64, device=target_logits.device),
        [len(draft_token_ids)],
        target_logits,
        draft_probs,
        temperature,
        top_k,
        top_p,
        generators=None if generator is None else {0: generator},
    )[0]


def synthetic_sample(
    draft_token_ids: list[int],
    target_logits: torch.Tensor,
    rates: list[float],
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
) -> list[int]:
    """vLLM's synthetic acceptance (`rejection_sample_method: "synthetic"`, for benchmarking a
    drafter's speed at a chosen acceptance, NOT lossless): draft i is accepted with the
    conditional probability rates[i] / rates[i - 1] (rates[0] first), whatever the target
    says; the first rejection emits the target's token there (greedy: the argmax; sampled:
    a sample with the draft excluded), and full acceptance the bonus token, as usual."""
    emitted = []
    for i, draft in enumerate(draft_token_ids):
        previous = rates[i - 1] if i else 1.0
        conditional = rates[i] / previous if previous > 0 else 0.0
        if draft < 0 or torch.rand((), generator=generator, device=target_logits.device).item() >= conditional:
            return emitted + [_target_token(target_logits[i], sampling, generator, exclude=draft)]
        emitted.append(draft)
    return emitted + [_target_token(target_logits[-1], sampling, generator)]


def _target_token(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None, exclude: int = -1
) -> int:
    """The target's token at one row: the argmax when greedy, else a sample (`exclude`: a
    rejected draft that cannot be drawn, the residual of a one-hot draft)."""
    if sampling.greedy:
        return int(logits.float().argmax())
    probs = request_probs(logits[None], sampling)[0]
    if 0 <= exclude < probs.numel() and probs[exclude] < 1:
        probs[exclude] = 0.0
    return int(torch.multinomial(probs, 1, generator=generator))


def _greedy_accept_one(draft_token_ids: list[int], target_logits: torch.Tensor) -> list[int]:
    """The greedy path of one request without building batch tensors: it runs every step of
    every greedy request, plain steps (no drafts) included, so its cost is orchestration
    overhead (0.05 ms instead of 0.4 ms)."""
    num_drafts = len(draft_token_ids)
    if num_drafts > MAX_SPEC_LEN:
        raise ValueError(f"num_draft_tokens must be in [0, {MAX_SPEC_LEN}], got [{num_drafts}]")
    if target_logits.dim() != 2 or target_logits.shape[0] != num_drafts + 1:
        raise ValueError(f"target_logits must have shape ({num_drafts + 1}, V), got {tuple(target_logits.shape)}")
    if draft_token_ids and (min(draft_token_ids) < -1 or max(draft_token_ids) >= target_logits.shape[-1]):
        raise ValueError(f"draft token ids must be -1 or in [0, {target_logits.shape[-1]})")
    target = argmax_rows(target_logits)
    accepted = []
    for draft, token in zip(draft_token_ids, target):
        if draft != token:
            return accepted + [token]
        accepted.append(draft)
    return accepted + [target[-1]]


def rejection_sample_batch(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    generators: dict[int, torch.Generator] | None = None,
) -> list[list[int]]:
    """Verify a batch of requests, greedy and random mixed, in vLLM V1's layout.

    ``draft_token_ids``: [sum(n_i)] int64, flattened; ``num_draft_tokens``: n_i per request;
    ``target_logits``: [sum(n_i + 1), V]; ``draft_probs``: [sum(n_i), V] or None; ``temperature``,
    ``top_k``, ``top_p``: [batch] (top-k / top-p may be None); ``generators``: request index ->
    generator on the logits' device, for seeded requests.
    """
    _check_inputs(draft_token_ids, num_draft_tokens, target_logits, draft_probs, temperature, top_k, top_p)
    device = target_logits.device
    greedy_accept, random_accept, sample_recovered_tokens = accept_functions(device)
    rows = _BatchRows.of(draft_token_ids, num_draft_tokens, is_greedy(temperature.cpu()).tolist(), device)
    logits = target_logits.float()
    out = torch.full(
        (len(num_draft_tokens), max(num_draft_tokens, default=0) + 1),
        PLACEHOLDER_TOKEN_ID,
        dtype=torch.int64,
        device=device,
    )
    bonus = logits[rows.bonus_rows].argmax(dim=-1)  # greedy requests' bonus; random ones resample it
    if not all(rows.greedy):
        kernels = (random_accept, sample_recovered_tokens)
        sampling = (temperature, top_k, top_p)
        bonus = _accept_random(out, rows, logits, bonus, draft_probs, sampling, generators or {}, kernels)
    if any(rows.greedy):
        target_argmax = logits[rows.draft_rows].argmax(dim=-1)
        greedy_accept(out, rows.cu_num_draft_tokens, rows.drafts, target_argmax, bonus, rows.greedy_rows)
    return parse_output(out)


@dataclass
class _BatchRows:
    """Where each request's drafts and bonus lie in the flattened batch, and which are greedy."""

    drafts: torch.Tensor  # [sum(n_i)] int64
    cu_num_draft_tokens: torch.Tensor  # [batch]
    req_ids: torch.Tensor  # [batch]
    draft_req_ids: torch.Tensor  # [sum(n_i)]: each draft's request
    draft_rows: torch.Tensor  # [sum(n_i)]: each draft's row of the logits
    bonus_rows: torch.Tensor  # [batch]: each request's bonus row
    counts: torch.Tensor  # [batch]: n_i
    num_draft_tokens: list[int]
    greedy: list[bool]
    greedy_rows: torch.Tensor  # [batch] bool

    @classmethod
    def of(
        cls, draft_token_ids: torch.Tensor, num_draft_tokens: list[int], greedy: list[bool], device: torch.device
    ) -> "_BatchRows":
        counts = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)
        cu_num_draft_tokens = counts.cumsum(0)
        req_ids = torch.arange(len(num_draft_tokens), device=device)
        draft_req_ids = req_ids.repeat_interleave(counts)
        # Request i's rows start at cu[i] - n_i + i: its drafts' rows, then its bonus row.
        draft_rows = torch.arange(sum(num_draft_tokens), device=device) + draft_req_ids
        bonus_rows = cu_num_draft_tokens + req_ids
        greedy_rows = torch.tensor(greedy, dtype=torch.bool, device=device)
        drafts = draft_token_ids.to(device, torch.int64)
        return cls(
            drafts,
            cu_num_draft_tokens,
            req_ids,
            draft_req_ids,
            draft_rows,
            bonus_rows,
            counts,
            num_draft_tokens,
            greedy,
            greedy_rows,
        )


def _accept_random(
    out: torch.Tensor,
    rows: _BatchRows,
    logits: torch.Tensor,
    bonus: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    generators: dict[int, torch.Generator],
    kernels: tuple[Callable, Callable],
) -> torch.Tensor:
    """Fill the random requests' rows of `out`: accept draft x while p(x) / q(x) >= u, else a
    recovered token from the residual; the bonus tokens, the random requests' resampled."""
    random_accept, sample_recovered_tokens = kernels
    device = logits.device
    probs = _target_probs(logits, rows, *sampling)
    bonus_noise, uniform_probs, recovered_noise = _draw_random_inputs(
        rows.num_draft_tokens, rows.greedy, generators, logits.shape[-1], device
    )
    # Exponential race: argmax(p / E) is a sample of p.
    sampled_bonus = (probs[rows.bonus_rows] * bonus_noise).argmax(dim=-1)
    bonus = torch.where(rows.greedy_rows, bonus, sampled_bonus)
    target_probs = probs[rows.draft_rows]
    if draft_probs is not None:
        draft_probs = draft_probs.to(device, torch.float32)
    recovered = sample_recovered_tokens(
        rows.drafts, rows.draft_req_ids, target_probs, draft_probs, recovered_noise, rows.greedy_rows
    )
    # p and q at each draft token; a -1 draft reads column 0 but is rejected regardless.
    at_draft = rows.drafts.clamp_min(0).unsqueeze(1)
    p_at_draft = target_probs.gather(1, at_draft).squeeze(1)
    q_at_draft = torch.ones_like(p_at_draft) if draft_probs is None else draft_probs.gather(1, at_draft).squeeze(1)
    random_accept(
        out,
        rows.cu_num_draft_tokens,
        rows.drafts,
        p_at_draft,
        q_at_draft,
        uniform_probs,
        recovered,
        bonus,
        rows.greedy_rows,
    )
    return bonus


def _target_probs(
    logits: torch.Tensor,
    rows: _BatchRows,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
) -> torch.Tensor:
    """The target's distribution at every row, each under its request's sampling parameters."""
    device = logits.device
    row_req_ids = rows.req_ids.repeat_interleave(rows.counts + 1)
    return apply_temperature_top_k_top_p(
        logits,
        temperature.to(device)[row_req_ids],
        None if top_k is None else top_k.to(device)[row_req_ids],
        None if top_p is None else top_p.to(device)[row_req_ids],
    )


def parse_output(output_token_ids: torch.Tensor) -> list[list[int]]:
    """Per-request emitted tokens from the padded [batch, max_spec_len + 1] output."""
    return [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in output_token_ids.tolist()]


def accept_functions(device: torch.device) -> tuple[Callable, Callable, Callable]:
    """The OpenAI Triton kernels on CUDA or with TRITONSPEC_USE_KERNELS=1, else the references."""
    if device.type == "cuda" or os.environ.get("TRITONSPEC_USE_KERNELS") == "1":
        return rk.greedy_accept, rk.random_accept, rk.sample_recovered_tokens
    return rk.greedy_accept_ref, rk.random_accept_ref, rk.sample_recovered_tokens_ref


def _draw_random_inputs(
    num_draft_tokens: list[int],
    greedy: list[bool],
    generators: dict[int, torch.Generator],
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bonus noise [batch, V], float64 uniforms [sum(n_i)], recovered noise [batch, V].

    Only random requests draw; greedy rows are never read. Noise is returned as 1/E, E ~ Exp(1), so
    the exponential race multiplies (correctly rounded on every device, which keeps kernels and
    references identical).
    """
    batch_size = len(num_draft_tokens)
    bonus_noise = torch.zeros(batch_size, vocab_size, device=device)
    recovered_noise = torch.zeros(batch_size, vocab_size, device=device)
    uniform_probs = torch.ones(sum(num_draft_tokens), dtype=torch.float64, device=device)
    start = 0
    for req, num_drafts in enumerate(num_draft_tokens):
        if not greedy[req]:
            generator = generators.get(req)
            # Uniforms, made exponential below (torch's exponential_ is ~6x slower on CPU).
            bonus_noise[req].uniform_(generator=generator)
            uniform_probs[start : start + num_drafts].uniform_(generator=generator)
            if num_drafts:
                recovered_noise[req].uniform_(generator=generator)
        start += num_drafts
    return _inverse_exponential(bonus_noise), uniform_probs, _inverse_exponential(recovered_noise)


def _inverse_exponential(uniform: torch.Tensor) -> torch.Tensor:
    """1/E with E = -log(1 - U) ~ Exp(1); E can round to 0, and the clamp keeps 1/E finite."""
    exponential = uniform.neg_().log1p_().neg_()
    return exponential.clamp_min_(torch.finfo(torch.float32).tiny).reciprocal_()


def _check_inputs(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
) -> None:
    batch_size, num_tokens = len(num_draft_tokens), sum(num_draft_tokens)
    vocab_size = target_logits.shape[-1]
    if min(num_draft_tokens, default=0) < 0 or max(num_draft_tokens, default=0) > MAX_SPEC_LEN:
        raise ValueError(f"num_draft_tokens must be in [0, {MAX_SPEC_LEN}], got {num_draft_tokens}")
    if draft_token_ids.shape != (num_tokens,):
        raise ValueError(f"draft_token_ids must have shape ({num_tokens},), got {tuple(draft_token_ids.shape)}")
    if num_tokens and ((draft_token_ids < -1) | (draft_token_ids >= vocab_size)).any():
        raise ValueError(f"draft token ids must be -1 or in [0, {vocab_size})")
    if target_logits.dim() != 2 or target_logits.shape[0] != num_tokens + batch_size:
        raise ValueError(
            f"target_logits must have shape ({num_tokens + batch_size}, V), got {tuple(target_logits.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (num_tokens, vocab_size):
        raise ValueError(f"draft_probs must have shape ({num_tokens}, {vocab_size}), got {tuple(draft_probs.shape)}")
    for name, param in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if param is not None and param.shape != (batch_size,):
            raise ValueError(f"{name} must have shape ({batch_size},), got {tuple(param.shape)}")


# --- acceptance metrics -----------------------------------------------------------------------


@dataclass
class AcceptanceStats:
    """Per-request speculative-decoding counters, with vLLM's definitions
    (https://github.com/vllm-project/vllm/blob/c314af1abfddff7b6cce9af578be72c496c6a5e4/vllm/v1/spec_decode/metrics.py)."""

    num_drafts: int = 0  # verification steps that had drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """Record one step (num_accepted = emitted tokens - 1); steps without drafts are skipped."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"need 0 <= num_accepted <= num_drafted, got {num_accepted=}, {num_drafted=}")
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        missing = num_drafted - len(self.accepted_per_position)
        self.accepted_per_position.extend([0] * max(missing, 0))
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens; None before any draft (vLLM logs NaN)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted tokens per step: tokens emitted per verification, bonus included."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        """Acceptances at each position / all steps (shorter drafts count too, as in vLLM)."""
        return [count / self.num_drafts for count in self.accepted_per_position]

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance_rate": self.per_position_acceptance_rate,
        }
