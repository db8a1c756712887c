"""Incremental detokenization that never emits broken UTF-8, with stop strings.

Text is decoded over a short window of recent tokens (vLLM's prefix/read offsets) so each
token costs O(1), and a multi-byte character split across tokens is held back until its
last byte arrives. The window starts on the prompt's last tokens, as vLLM's does:
SentencePiece (Metaspace) tokenizers drop the leading space of the first token a decode
call sees, so "is" + "▁Paris" decoded alone would read "isParis". Text that could still
turn into a stop string is held back too.
"""

from __future__ import annotations

from typing import Any

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens decoded as context.
PROMPT_CONTEXT_TOKENS = 5


class _StopMatcher:
    """One stop string, matched as text arrives (Knuth-Morris-Pratt): each character costs
    O(1) amortized, and the matcher's state is the longest tail of the text that begins the
    stop string, which is exactly what must be held back."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        # fail[i]: the longest proper prefix of stop[:i + 1] that is also its suffix.
        self.fail = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k
        self.matched = 0  # characters of the stop string the text ends with

    def feed(self, text: str, offset: int) -> int | None:
        """Advance over `text` (which starts at `offset` in the whole text); the start of
        the first complete match, if one ends in it."""
        stop, fail, k = self.stop, self.fail, self.matched
        for i, ch in enumerate(text):
            while k and ch != stop[k]:
                k = fail[k - 1]
            if ch == stop[k]:
                k += 1
            if k == len(stop):
                self.matched = k
                return offset + i + 1 - k
        self.matched = k
        return None


class TextStream:
    def __init__(self, tokenizer: Any, stop: list[str] | None = None, prompt_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stops = [_StopMatcher(s) for s in (stop or []) if s]
        context = list(prompt_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        self.token_ids: list[int] = context  # the context, then every output token
        self.text = ""  # all complete output text so far (cut at a stop string once one appears)
        self.stopped = False
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._sent = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> None:
        """Append one token; sets `stopped` when the text now contains a stop string."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # an incomplete character (or nothing printable) so far
        new = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        offset = len(self.text)
        self.text += new
        starts = [at for at in (m.feed(new, offset) for m in self.stops) if at is not None]
        if starts:
            self.text = self.text[: min(starts)]
            self.stopped = True

    def take(self, final: bool = False) -> str:
        """The text not yet handed out, minus a tail that may begin a stop string."""
        end = len(self.text)
        if not final and not self.stopped:
            end -= max((m.matched for m in self.stops), default=0)
        if end <= self._sent:
            return ""
        out = self.text[self._sent : end]
        self._sent = end
        return out
