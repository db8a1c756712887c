"""Compiling a request's StructuredOutputs into a grammar over the target's tokenizer, once:
llguidance (https://github.com/guidance-ai/llguidance, the `guidance` structured-output
backend of vLLM) builds a matcher; the cache keeps a fresh one per constraint, and each request
gets a copy of it (docs/structured-outputs.md says why llguidance and what was measured).

Compiling runs on a small thread pool, never on the forward thread: the request's own thread
waits for it (a long schema then delays only that request), and a second request with the same
constraint waits for the first compilation instead of starting another.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.hf

from backends.serving.request import RequestError
from backends.structured.matcher import GrammarMatcher
from backends.structured.spec import StructuredOutputs
from backends.structured.structural_tag import StructuralTagError, structural_tag_grammar

CACHE_SIZE = 256  # compiled constraints kept (least recently used go first)


class GrammarError(RequestError):
    """A constraint that cannot be compiled: the schema, regex or grammar at fault, and why."""


def grammar_text(spec: StructuredOutputs) -> str:
    """The constraint as an llguidance grammar (vLLM's serialize_guidance_grammar, without its
    options). JSON kinds keep the schema's own whitespace rule when it brings one, else follow
    `whitespace_pattern`, else allow no whitespace between tokens (vLLM's default for llguidance
    is "flexible": any whitespace, which lets a small model ramble in newlines)."""
    options: dict[str, Any] = {"whitespace_flexible": False}
    if spec.whitespace_pattern is not None:
        options = {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern}
    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.spec, defaults=options)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == "choice":  # one of the strings, as Lark literals (JSON escapes)
        choices = json.loads(spec.spec)
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError(f"choice must be a non-empty list of strings, got {spec.spec[:80]}")
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        )
    if spec.kind == "grammar":  # Lark or GBNF (llguidance tells them apart)
        return llguidance.grammar_from("grammar", spec.spec)
    if spec.kind == "structural_tag":
        return structural_tag_grammar(json.loads(spec.spec), options)
    raise GrammarError(f"structured_outputs: unknown kind {spec.kind!r}")


def _described(spec: StructuredOutputs) -> str:
    """How the client named the constraint, for an error message."""
    what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}.get(spec.kind, spec.kind)
    return f"structured_outputs.{spec.kind}: the {what}"


class GrammarCompiler:
    """Compiled constraints over one tokenizer (the compiler's own: each served model has one),
    cached by (kind, spec, whitespace_pattern).

    `vocab_size`: the target's logits columns (masks cover them all; ids past the tokenizer's
    are never allowed). `eos_token_ids`: where the grammar may end, every one of them is allowed."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int], workers: int = 1) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(vocab_size, len(tokenizer)))
        self.vocab_size = self.tokenizer.vocab_size  # the masks' columns (the logits' beyond: disallowed)
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[StructuredOutputs, Future] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs) -> Future:
        """The compiled constraint, now or soon: a Future of an llguidance matcher at its start
        (GrammarError inside when it cannot be compiled; that is cached too)."""
        with self._lock:
            future = self._cache.get(spec)
            if future is None:
                future = self._cache[spec] = self._pool.submit(self._build, spec)
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(spec)
            return future

    def matcher(self, spec: StructuredOutputs, forced_drafts: bool = True) -> GrammarMatcher:
        """A matcher of the constraint at its start, for one request (waits for its compilation).
        `forced_drafts`: the tokens the grammar forces go to the verifier as drafts (the
        request's `forced_drafts`; off, it decodes constrained as the peers do)."""
        matcher = self.compile(spec).result().deep_copy()
        return GrammarMatcher(matcher, self.tokenizer, self.vocab_size, self.eos_token_ids, forced_drafts)

    def _build(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        try:
            text = grammar_text(spec)
        except StructuralTagError as e:  # names the part of the tag at fault
            raise GrammarError(f"structured_outputs.{e}") from None
        except (ValueError, KeyError, TypeError) as e:  # malformed JSON of a schema, choice list or tag
            raise GrammarError(f"{_described(spec)} cannot be compiled: {e}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{_described(spec)} cannot be compiled: {matcher.get_error()}")
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
