"""The target's answers for training, generated on the lean runtime the verifier serves with:
many sequences at a time over one KV pool (continuous batching, as a server's scheduler does),
each step one ragged forward of every active row: a newly admitted prompt's prefill beside
the others' next token.

Greedy answers record, at every position of prompt and answer, the hidden states of the
layers the heads read (the verifier's numbering, -1 = final normed) and the target's argmax
there: the same numbers the verifier computes at serve time (batch-invariant kernels: a
token's hidden states are the same bits whatever shares its step, one token at a time or a
whole sequence at once), so a head trains on exactly what it will be given and accepted on.
Sampled generation (the target writing its own requests) draws with temperature and top-p.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backends.runtime.lean_lm import LeanCausalLM, Row, UnsupportedArchitecture, read_checkpoint
from backends.runtime.model_store import load_causal_lm

log = logging.getLogger("tritonspec.training")

MAX_ROWS = 32  # sequences in flight; 2 cores, 128 prompts: 16 rows 607 tokens/s, 32 663, 64 732, 128 761


@dataclass
class Sampling:
    """Sampled instead of greedy: temperature, then nucleus (top-p) filtering."""

    temperature: float
    top_p: float
    generator: torch.Generator


@dataclass
class Generated:
    """One finished sequence. ``hidden`` and ``labels`` cover every position of ``token_ids``
    (only when states were asked for): hidden states ``[n, layers, hidden]`` in the order the
    layers were asked, and the target's argmax after each position ``[n]``."""

    index: int  # the prompt's index in the list given
    token_ids: list[int]  # prompt + answer
    prompt_len: int
    hidden: torch.Tensor | None = None
    labels: torch.Tensor | None = None


@dataclass
class _Active:
    """A sequence in flight: what it has, what it feeds next, its recorded states."""

    index: int
    token_ids: list[int]
    prompt_len: int
    feed: list[int]  # tokens the next step writes (the prompt, then one token at a time)
    closing: bool = False  # its last token is being fed, only to record its states
    hidden: list[torch.Tensor] = field(default_factory=list)
    labels: list[torch.Tensor] = field(default_factory=list)


def load_lean_target(target: Path, dtype: str) -> LeanCausalLM:
    """The target on the lean runtime as the verifier builds it: batch-invariant where its
    kernels run, else the SDPA path."""
    torch_dtype = getattr(torch, dtype)
    model = read_checkpoint(Path(target), torch_dtype) or load_causal_lm(target, dtype)
    try:
        try:
            return LeanCausalLM.from_hf(model, batch_invariant=True)
        except UnsupportedArchitecture as e:
            log.info("training data: batch-invariant kernels unavailable (%s); generating on the SDPA path", e)
            return LeanCausalLM.from_hf(model)
    except UnsupportedArchitecture as e:
        raise ValueError(f"{target}: training data is generated on the lean runtime, which does not run it: {e}") from e


class TargetGenerator:
    """The target generating for many prompts at once, ``max_rows`` sequences in flight."""

    def __init__(self, lm: LeanCausalLM, max_len: int, max_rows: int = MAX_ROWS) -> None:
        self.lm, self.max_rows, self.max_len = lm, max_rows, max_len
        block = 16  # each sequence's reservation rounds up to whole blocks
        self.pool = lm.new_pool(capacity_tokens=max_rows * (max_len + block), block_size=block)

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        stop_ids: set[int],
        hidden_layers: tuple[int, ...] = (),
        sampling: Sampling | None = None,
    ) -> Iterator[Generated]:
        """Each prompt continued until a token of ``stop_ids`` (kept) or ``max_new_tokens``,
        yielded as it finishes (not in prompt order). With ``hidden_layers``, every position's
        states and argmax are recorded (a sequence's last token is fed once more for them);
        ``max_new_tokens=0`` then records the states of the prompts as given."""
        record = bool(hidden_layers)
        if sampling is not None and record:
            raise ValueError("states are recorded for greedy answers only")
        waiting = deque(range(len(prompts)))
        active: dict[int, _Active] = {}
        while waiting or active:
            while waiting and len(active) < self.max_rows:
                i = waiting.popleft()
                if len(prompts[i]) + max_new_tokens > self.max_len:
                    raise ValueError(
                        f"prompt {i} has {len(prompts[i])} tokens: with {max_new_tokens} new ones "
                        f"past the {self.max_len} this generator holds a sequence"
                    )
                self.pool.admit(i, len(prompts[i]) + max_new_tokens)
                active[i] = _Active(i, list(prompts[i]), len(prompts[i]), list(prompts[i]), closing=not max_new_tokens)
            yield from self._step(active, max_new_tokens, stop_ids, hidden_layers, sampling)

    def _step(
        self,
        active: dict[int, _Active],
        max_new_tokens: int,
        stop_ids: set[int],
        hidden_layers: tuple[int, ...],
        sampling: Sampling | None,
    ) -> Iterator[Generated]:
        """One forward of every active sequence; the finished ones leave the pool."""
        seqs = list(active.values())
        counts = [len(s.feed) if hidden_layers else 1 for s in seqs]
        out = self.lm.forward(self.pool, [Row(s.index, s.feed) for s in seqs], counts, hidden_layers)
        last = torch.stack([logits[-1] for logits in out.logits])  # [rows, vocab]
        chosen = (last.argmax(-1) if sampling is None else sample(last, sampling)).tolist()
        for s, logits, hidden, token in zip(seqs, out.logits, out.hidden, chosen):
            if hidden_layers:
                s.hidden.append(torch.stack([hidden[i] for i in hidden_layers], dim=1))  # [n, layers, H]
                s.labels.append(logits.argmax(-1))
            answered = len(s.token_ids) - s.prompt_len
            if not s.closing:
                s.token_ids.append(token)
                s.feed = [token]
                answered += 1
            if s.closing or (not hidden_layers and (token in stop_ids or answered == max_new_tokens)):
                self.pool.release(s.index)
                del active[s.index]
                yield _finished(s, bool(hidden_layers))
            elif token in stop_ids or answered == max_new_tokens:
                s.closing = True  # fed once more for its states; what comes after is not kept


def _finished(s: _Active, recorded: bool) -> Generated:
    if not recorded:
        return Generated(s.index, s.token_ids, s.prompt_len)
    return Generated(s.index, s.token_ids, s.prompt_len, torch.cat(s.hidden), torch.cat(s.labels))


def sample(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """One token per row of ``logits`` [rows, vocab]: temperature, then the smallest set of
    most likely tokens whose probability reaches top_p (transformers' TopPLogitsWarper)."""
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    beyond = sorted_probs.cumsum(-1) - sorted_probs > sampling.top_p  # the nucleus is reached before it
    sorted_probs[beyond] = 0.0
    picked = torch.multinomial(sorted_probs, 1, generator=sampling.generator)  # [rows, 1]
    return order.gather(-1, picked).squeeze(-1)
