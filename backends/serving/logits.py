"""A request's token controls applied to the target's logits inside verification, and the
logprobs reported for the tokens it emits.

Order and formulas are vLLM V1's (Sampler.apply_logits_processors): allowed_token_ids, bad
words, min_tokens, logit_bias, then the repetition, frequency and presence penalties, and min_p
(which vLLM applies after temperature: here on the same temperature-scaled probabilities);
temperature, top-k and top-p follow in rejection sampling, so every draft is verified against
the distribution these controls leave. Row j of a verify step is the position after the
sequence so far plus drafts d_1..d_j, and it is processed with exactly that history, so
each position sees what a plain decoding step there would see: the output stays the one
plain decoding gives with the same settings (vLLM treats its drafts the same way).

Logprobs are vLLM V1's default (`logprobs_mode="raw_logprobs"`): the log-softmax of the
target's own logits at the position, before any control, temperature or top-k/top-p.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from backends.runtime.kv_cache import SequenceError
from backends.serving.request import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely; tokens as likely count as ahead (vLLM's rank)
    top: tuple[tuple[int, float], ...] = ()  # the n most likely (id, logprob), best first


def process_logits(
    logits: torch.Tensor,
    sampling: SamplingParams,
    output_ids: list[int],
    row_prefixes: list[list[int]],
    prompt_ids: list[int],
) -> torch.Tensor:
    """[rows, V] target logits -> a float32 copy with the controls applied; row j's history
    is `output_ids` (generated so far) + row_prefixes[j], the drafts before it (a chain's
    drafts[:j], a tree node's root path). Placeholder drafts (-1) are never accepted, so rows
    past one are never used; they are skipped in the history."""
    rows = logits.float().clone()
    if sampling.allowed_token_ids:
        allowed = torch.zeros(rows.shape[-1], dtype=torch.bool, device=rows.device)
        allowed[list(sampling.allowed_token_ids)] = True
        rows.masked_fill_(~allowed, -math.inf)
    histories = [output_ids + [d for d in prefix if d >= 0] for prefix in row_prefixes]
    for row, history in zip(rows, histories):
        _ban_bad_words(row, sampling.bad_words_ids, history)
        if len(history) < sampling.min_tokens and sampling.min_tokens_stop_ids:
            row[list(sampling.min_tokens_stop_ids)] = -math.inf
    if sampling.logit_bias:
        ids, biases = zip(*sampling.logit_bias)
        rows[:, list(ids)] += torch.tensor(biases, device=rows.device)
    if sampling.repetition_penalty != 1.0 or sampling.frequency_penalty or sampling.presence_penalty:
        _apply_penalties(rows, sampling, histories, prompt_ids)
    if sampling.min_p > 0 and not sampling.greedy:
        _apply_min_p(rows, sampling.min_p, sampling.temperature)
    return rows


def _apply_min_p(rows: torch.Tensor, min_p: float, temperature: float) -> None:
    """vLLM's MinPLogitsProcessor (vllm/v1/sample/logits_processor/builtin.py): tokens whose
    probability at this temperature is below min_p x the most likely token's are dropped."""
    probs = torch.softmax(rows / temperature, dim=-1)  # [rows, V]
    rows.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), -math.inf)


def _ban_bad_words(row: torch.Tensor, bad_words: tuple[tuple[int, ...], ...], history: list[int]) -> None:
    """A bad word's last token is banned where its other tokens end the history."""
    for word in bad_words:
        prefix = list(word[:-1])
        if len(prefix) <= len(history) and history[len(history) - len(prefix) :] == prefix:
            row[word[-1]] = -math.inf


def _apply_penalties(
    rows: torch.Tensor, sampling: SamplingParams, histories: list[list[int]], prompt_ids: list[int]
) -> None:
    """vLLM's apply_penalties: repetition over prompt and output tokens (positive logits
    divided, negative multiplied), frequency per occurrence and presence once, over the
    output only."""
    vocab = rows.shape[-1]
    counts = torch.stack(
        [torch.bincount(torch.tensor(h, dtype=torch.int64), minlength=vocab)[:vocab] for h in histories]
    ).to(rows.device, torch.float32)
    if sampling.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt_ids:
            seen[:, torch.tensor(prompt_ids, device=rows.device)] = True
        penalty = torch.where(seen, sampling.repetition_penalty, 1.0)
        rows *= torch.where(rows > 0, 1.0 / penalty, penalty)
    rows -= sampling.frequency_penalty * counts
    rows -= sampling.presence_penalty * (counts > 0).float()


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """The raw logprob and rank of each emitted token (row i chose token_ids[i]) and the
    `num_top` most likely alternatives there."""
    logprobs = torch.log_softmax(logits[: len(token_ids)].float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logprobs.device)[:, None])
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
    out = []
    for i, (token, logprob) in enumerate(zip(token_ids, chosen[:, 0].tolist())):
        top = () if top_ids is None else tuple(zip(top_ids[i].tolist(), top_values[i].tolist()))
        out.append(TokenLogprob(token, logprob, ranks[i], top))
    return out


LOGPROB_OUTPUTS = ("logprobs", "logprob_ranks", "top_logprob_ids", "top_logprobs")  # the verifier's
# prompt_logprobs go as the same arrays under this prefix, with the prompt tokens they score.
PROMPT = "prompt_"
PROMPT_LOGPROB_OUTPUTS = (*(PROMPT + name for name in LOGPROB_OUTPUTS), "prompt_token_ids")


def logprobs_to_arrays(logprobs: list[TokenLogprob], prefix: str = "") -> dict[str, np.ndarray]:
    """The verifier's outputs for a step's logprobs ([n] and [n, top] arrays); with the
    PROMPT prefix, its prompt logprobs and their tokens."""
    shape = (len(logprobs), len(logprobs[0].top) if logprobs else 0)
    arrays = {
        "logprobs": np.array([p.logprob for p in logprobs], dtype=np.float32),
        "logprob_ranks": np.array([p.rank for p in logprobs], dtype=np.int64),
        "top_logprob_ids": np.array([[t for t, _ in p.top] for p in logprobs], dtype=np.int64).reshape(shape),
        "top_logprobs": np.array([[v for _, v in p.top] for p in logprobs], dtype=np.float32).reshape(shape),
    }
    if prefix == PROMPT:
        arrays["token_ids"] = np.array([p.token_id for p in logprobs], dtype=np.int64)
    return {prefix + name: array for name, array in arrays.items()}


def logprobs_from_arrays(token_ids: list[int], arrays: dict[str, np.ndarray], prefix: str = "") -> list[TokenLogprob]:
    """Back from the verifier's outputs (each with a leading batch dimension of 1; the top
    arrays are left out when no alternatives were asked for)."""
    arrays = {name.removeprefix(prefix): array for name, array in arrays.items() if name.startswith(prefix)}
    values, ranks = arrays["logprobs"].reshape(-1).tolist(), arrays["logprob_ranks"].reshape(-1).tolist()
    empty = np.zeros((len(token_ids), 0))
    top_ids = arrays.get("top_logprob_ids", empty).reshape(len(token_ids), -1).tolist()
    top_values = arrays.get("top_logprobs", empty).reshape(len(token_ids), -1).tolist()
    return [
        TokenLogprob(t, v, r, tuple(zip(ti, tv)))
        for t, v, r, ti, tv in zip(token_ids, values, ranks, top_ids, top_values)
    ]


def vllm_logprobs(logprobs: list[TokenLogprob], decode: Callable[[int], str]) -> list[dict[int, dict]]:
    """The vLLM backend's `logprobs` output: per token {token id: {"logprob", "rank",
    "decoded_token"}}, the chosen token first, then the alternatives ranked 1..n (the chosen
    one keeps its rank among them when it is one)."""
    out = []
    for p in logprobs:
        entry = {p.token_id: {"logprob": p.logprob, "rank": p.rank, "decoded_token": decode(p.token_id)}}
        for rank, (token, logprob) in enumerate(p.top, 1):
            entry[token] = {"logprob": logprob, "rank": rank, "decoded_token": decode(token)}
        out.append(entry)
    return out


def check_controls_fit(sampling: SamplingParams, vocab_size: int) -> None:
    """Token ids of the sequence's controls must index the logits (``vocab_size`` wide), and
    its logprob counts must not exceed them: SequenceError otherwise."""
    ids = (
        [t for t, _ in sampling.logit_bias]
        + [t for word in sampling.bad_words_ids for t in word]
        + list(sampling.min_tokens_stop_ids)
        + list(sampling.allowed_token_ids)
    )
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise SequenceError(
            f"token id {outside[0]} in the sampling parameters is outside the vocabulary [0, {vocab_size})"
        )
    for name in ("logprobs", "prompt_logprobs"):
        if (value := getattr(sampling, name)) is not None and value > vocab_size:
            raise SequenceError(f"{name}={value} is above the vocabulary size {vocab_size}")
