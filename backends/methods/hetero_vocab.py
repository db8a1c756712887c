"""Drafting with a model whose tokenizer differs from the target's (`use_heterogeneous_vocab`).

Token ids do not translate one to one, so the bridge goes through text: the target's
context is decoded and re-encoded with the drafter's tokenizer, and the draft tokens'
text is re-encoded with the target's tokenizer. Only greedy drafts are supported (as in
vLLM): the drafter's probabilities live in another vocabulary and cannot feed the target's
rejection sampler. Drafts that come out wrong only cost acceptance; the target decides
every token.
"""

from __future__ import annotations

from typing import Any

# Tokens of context decoded together with the drafts: a tokenizer that drops a leading
# space on the first decoded token (SentencePiece) keeps it when the token is not first.
_DECODE_TAIL = 4
# Target tokens re-encoded together with the draft text, so the drafts are tokenized the
# way they would be in context (the pre-tokenizer sees what precedes them).
_ENCODE_TAIL = 8


class TextBridge:
    """Maps a target-token context to drafter tokens and drafter drafts back to target tokens."""

    def __init__(self, target_tokenizer: Any, draft_tokenizer: Any) -> None:
        self.target = target_tokenizer
        self.draft = draft_tokenizer

    def to_draft(self, target_ids: list[int]) -> list[int]:
        """The drafter's tokenization of the target's context."""
        text = self.target.decode(target_ids, skip_special_tokens=False)
        return self.draft(text, add_special_tokens=False)["input_ids"]

    def to_target(self, target_ids: list[int], draft_context: list[int], draft_ids: list[int], limit: int) -> list[int]:
        """At most `limit` target tokens that spell what `draft_ids` add to the context."""
        tail = draft_context[-_DECODE_TAIL:]
        before = self.draft.decode(tail, skip_special_tokens=False)
        text = self.draft.decode(tail + draft_ids, skip_special_tokens=False)[len(before) :]
        text = text.rstrip("\ufffd")  # an incomplete UTF-8 character would be encoded as U+FFFD
        if not text:
            return []
        context = target_ids[-_ENCODE_TAIL:]
        prefix = self.target.decode(context, skip_special_tokens=False)
        ids = self.target(prefix + text, add_special_tokens=False)["input_ids"]
        if ids[: len(context)] == context:
            ids = ids[len(context) :]
        else:  # the draft text merges into the context's last token: tokenize it alone
            ids = self.target(text, add_special_tokens=False)["input_ids"]
        return ids[:limit]
