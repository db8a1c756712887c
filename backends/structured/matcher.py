"""One request's grammar state during speculative decoding (vLLM's StructuredOutputManager
and GuidanceGrammar, vllm/v1/structured_output/, for one request; plus forced tokens as drafts):

    draft = matcher.constrain(draft, room)   # the drafts the grammar allows, then forced tokens
    masks = matcher.masks(draft)             # [rows, words]: what the grammar allows at each row
    ... the verifier samples every row under its mask ...
    matcher.advance(emitted)                 # the accepted drafts and the bonus token

`constrain` and `masks` walk the grammar through the drafts and roll back, so the matcher only
ever stands where the output ends. Each verification row is sampled under the mask of exactly
the state a plain decoding step there would be in, so constrained speculative output is
constrained plain output (greedy: token for token; sampled: in distribution).

EOS: every EOS id is allowed where the grammar may end (llguidance allows only its tokenizer's
one), and nothing else once the grammar is complete, so an output ends by EOS right after its
last grammar token. A draft is cut after its first EOS, which ends the output anyway. With
`ignore_eos` the output goes on past that EOS as free text, unconstrained (vLLM's: its
StructuredOutputManager fills a full mask once the grammar has taken an EOS,
vllm/v1/structured_output/__init__.py `_fill_bitmasks`, and backend_guidance.py `accept_tokens`).
"""

from __future__ import annotations

from collections.abc import Collection

import llguidance
import torch

from backends.serving.proposer import Draft
from backends.serving.tree import DraftTree
from backends.structured.mask import mask_words


class GrammarMatcher:
    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        tokenizer: llguidance.LLTokenizer,
        vocab_size: int,
        eos_token_ids: Collection[int],
        forced_drafts: bool = True,
    ) -> None:
        self.matcher, self.tokenizer = matcher, tokenizer
        self.forced_drafts = forced_drafts
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.eos_token = min(self.eos_token_ids)  # the forced token of a complete output
        self.ended = False  # an EOS went out (ignore_eos): the rest of the output is free text

    @property
    def terminated(self) -> bool:
        """The grammar is complete: only EOS may follow."""
        return self.matcher.is_stopped()

    def advance(self, token_ids: list[int]) -> None:
        """Move past verified tokens (all allowed by their masks); EOS ends the grammar's part."""
        for token in token_ids:
            if self.ended or token in self.eos_token_ids:
                self.ended = True
                return
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar rejected verified token {token}: {self.matcher.get_error()}")

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of the drafts the grammar allows in a row from here (an EOS counts where the
        grammar may end there, and ends the count)."""
        n = 0
        while n < len(token_ids) and 0 <= token_ids[n] < self.vocab_size and token_ids[n] not in self.eos_token_ids:
            n += 1
        n = self.matcher.validate_tokens(token_ids[:n]) if n and not self.terminated else 0
        if n < len(token_ids) and token_ids[n] in self.eos_token_ids and self._accepting_after(token_ids[:n]):
            n += 1
        return n

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens for the bytes the grammar forces from here; EOS when the grammar
        is complete (`forced_split`'s chain)."""
        return self.forced_split(limit)[0]

    def forced_split(self, limit: int) -> tuple[list[int], int]:
        """Up to `limit` tokens for the bytes the grammar forces from here, and how many of them
        the target emits for sure. First llguidance's fast-forward tokens (the forced bytes
        tokenized canonically, less a last token that the text after them could merge into),
        then the rest of the forced bytes tokenized greedily: a guess, which the target may
        split otherwise (SmolLM2 writes `":` `"` as often as `":"`); the verifier checks it
        like any draft (on the json prompt set: 1.40 -> 1.57 tokens a step without a drafter)."""
        if limit <= 0:
            return [], 0
        if self.terminated:
            return [self.eos_token], 1
        tokens = self.matcher.compute_ff_tokens()
        certain = len(tokens)
        forced, emitted = self.matcher.compute_ff_bytes(), self.tokenizer.decode_bytes(tokens)
        if len(forced) > len(emitted) and forced.startswith(emitted):
            tokens += self.tokenizer.tokenize_bytes(forced[len(emitted) :])
        return tokens[:limit], min(certain, limit)

    def other_split(self, guessed: list[int]) -> list[int]:
        """The bytes of `guessed` (forced tokens past the certain ones) split the other likely
        way: the first token's longest proper prefix that is a token, then the rest greedily
        (`":"` -> `":` `"`); [] when the first is a single byte."""
        text, first = self.tokenizer.decode_bytes(guessed), self.tokenizer.decode_bytes(guessed[:1])
        for cut in range(len(first) - 1, 0, -1):
            head = self.tokenizer.tokenize_bytes(first[:cut])
            if len(head) == 1:
                return head + self.tokenizer.tokenize_bytes(text[cut:])
        return []

    def constrain(self, draft: Draft, room: int) -> tuple[Draft, int]:
        """The drafts to verify: a chain cut to its longest allowed prefix, then the tokens the
        grammar forces after it (when they are the whole draft and the target may split the
        forced bytes two ways, the other split as a sibling branch: `forced_split`,
        `other_split`); a tree without the branches the grammar rejects, each leaf
        followed by the tokens forced after its path (within the nodes pruned away; the forced
        chain alone when nothing is left). At most `room` levels; also how many tokens came from
        the drafter (a tree's: its first nodes, the forced ones follow them)."""
        if self.ended:
            return draft, len(draft.token_ids)
        if draft.parents is not None and draft.token_ids:
            pruned = self._prune(draft)
            if pruned.token_ids:
                budget = len(draft.token_ids) - len(pruned.token_ids)
                return self._forced_after_leaves(pruned, room, budget), len(pruned.token_ids)
            draft = Draft()
        n = min(self.valid_prefix(draft.token_ids), room)
        ids = draft.token_ids[:n]
        if not self.forced_drafts or (ids and ids[-1] in self.eos_token_ids):
            return Draft(ids, _with_one_hot(draft.probs, n, [])), n
        forced, certain = self._forced_after(ids, room - n)
        # The guessed tail's other split as a sibling branch: whichever way the target splits
        # the forced bytes, one branch has it (greedy follows it, sampling tries both in turn).
        # Only where the forced tokens are the whole draft: a drafter's steps stay chains, whose
        # cost its draft-length policy measures (and the drafters that learn the output's own
        # splits, suffix, gained nothing from the branch).
        guessed = forced[certain:] if n == 0 else []
        other = self.other_split(guessed)[: room - certain] if guessed else []
        chain = Draft(ids + forced, _with_one_hot(draft.probs, n, forced))
        if not other:
            return chain, n
        fork = certain - 1  # the node both splits hang from (-1: the root)
        parents = (
            list(range(-1, len(chain.token_ids) - 1))
            + [fork]
            + list(range(len(chain.token_ids), len(chain.token_ids) + len(other) - 1))
        )
        return Draft(chain.token_ids + other, _with_one_hot(chain.probs, len(chain.token_ids), other), parents), n

    def masks(self, draft: Draft) -> torch.Tensor | None:
        """[len(drafts) + 1, words] int32: row 0 what the grammar allows now, row i + 1 after
        draft node i (a chain: drafts[:i + 1]; a tree: node i's root path); after an EOS
        anything (only read with ignore_eos). Drafts must be allowed (constrain). None once the
        output is past an EOS: no constraint."""
        if self.ended:
            return None
        rows = torch.zeros(len(draft.token_ids) + 1, mask_words(self.vocab_size), dtype=torch.int32)
        self._fill(rows[0])
        if draft.parents is None:  # walk down the chain once
            paths = [[token] for token in draft.token_ids]
        else:  # each node from the root
            tree = DraftTree(tuple(draft.token_ids), tuple(draft.parents))
            paths = [[draft.token_ids[j] for j in tree.path(i)] for i in range(len(tree))]
        walked = 0
        for row, path in zip(rows[1:], paths):
            if path[-1] in self.eos_token_ids:  # free text past an EOS (ignore_eos)
                row.fill_(-1)
                continue
            self._consume(path)
            self._fill(row)
            if draft.parents is None:
                walked += 1
            else:
                self.matcher.rollback(len(path))
        self.matcher.rollback(walked)
        return rows

    def _fill(self, row: torch.Tensor) -> None:
        """One row of the mask from the current state, every EOS id allowed where the grammar may end."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if self.matcher.is_accepting():
            _allow(row, self.eos_token_ids)

    def _forced_after(self, token_ids: list[int], limit: int) -> tuple[list[int], int]:
        """`forced_split` from where `token_ids` lead (the matcher comes back here)."""
        self._consume(token_ids)
        forced = self.forced_split(limit)
        self.matcher.rollback(len(token_ids))
        return forced

    def _forced_after_leaves(self, tree: Draft, room: int, budget: int) -> Draft:
        """`tree` with the tokens the grammar forces after each leaf's path (leaves in node
        order, the drafter's best first) as a chain below it, `budget` nodes in all."""
        if not self.forced_drafts:
            return tree
        shape = DraftTree(tuple(tree.token_ids), tuple(tree.parents))
        token_ids, parents, forced_rows = list(tree.token_ids), list(tree.parents), []
        for leaf in range(len(shape)):
            path = [shape.token_ids[j] for j in shape.path(leaf)]
            if budget <= 0 or shape.children.get(leaf) or path[-1] in self.eos_token_ids:
                continue
            forced, _ = self._forced_after(path, min(budget, room - len(path)))
            for i, token in enumerate(forced):
                parents.append(leaf if i == 0 else len(token_ids) - 1)
                token_ids.append(token)
            forced_rows += forced
            budget -= len(forced)
        scores = None  # a forced node scores as the least of the drafter's (never above its parent)
        if tree.scores is not None:
            scores = tree.scores + [min(tree.scores)] * len(forced_rows)
        return Draft(token_ids, _with_one_hot(tree.probs, len(tree.token_ids), forced_rows), parents, scores)

    def _accepting_after(self, token_ids: list[int]) -> bool:
        self._consume(token_ids)
        accepting = self.matcher.is_accepting()
        self.matcher.rollback(len(token_ids))
        return accepting

    def _consume(self, token_ids: list[int]) -> None:
        if token_ids and not self.matcher.consume_tokens(token_ids):
            raise RuntimeError(f"the grammar rejected tokens it had allowed: {self.matcher.get_error()}")

    def _prune(self, draft: Draft) -> Draft:
        """The tree without nodes the grammar rejects on their root path (and their subtrees)."""
        tree = DraftTree(tuple(draft.token_ids), tuple(draft.parents))
        kept: list[int] = []
        ok: dict[int, bool] = {-1: True}
        for i, parent in enumerate(tree.parents):
            path = [tree.token_ids[j] for j in tree.path(i)]
            ok[i] = ok[parent] and (parent == -1 or path[-2] not in self.eos_token_ids)
            ok[i] = ok[i] and self.valid_prefix(path) == len(path)
            if ok[i]:
                kept.append(i)
        return draft.nodes(kept)


def _with_one_hot(probs: torch.Tensor | None, n: int, forced: list[int]) -> torch.Tensor | None:
    """The drafter's first `n` probability rows, then a one-hot row per forced token (where it
    has rows at all)."""
    if probs is None:
        return None
    if not forced:
        return probs[:n]
    return torch.cat([probs[:n], torch.nn.functional.one_hot(torch.tensor(forced), probs.shape[1]).to(probs)])


def _allow(row: torch.Tensor, token_ids: Collection[int]) -> None:
    """Set the bits of `token_ids` in one int32 mask row."""
    for token in token_ids:
        bit = 1 << (token % 32)
        row[token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # as a signed int32
