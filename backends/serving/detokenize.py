"""Incremental detokenization that never emits broken UTF-8, with stop strings.

Text is decoded over a short window of recent tokens (vLLM's prefix/read offsets) so each
token costs O(1), and a multi-byte character split across tokens is held back until its
last byte arrives. Text that could still turn into a stop string is held back too.
"""
from __future__ import annotations

from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.token_ids: list[int] = []
        self.text = ""  # all complete text so far (cut at a stop string once one appears)
        self.stopped = False
        self._prefix_offset = 0
        self._read_offset = 0
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
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += new
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
                search_from = min(search_from, at)

    def take(self, final: bool = False) -> str:
        """The text not yet handed out, minus a tail that may begin a stop string."""
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._stop_prefix_len()
        if end <= self._sent:
            return ""
        out = self.text[self._sent : end]
        self._sent = end
        return out

    def _stop_prefix_len(self) -> int:
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest
