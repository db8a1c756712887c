"""`custom_class`: a user's proposer, named by its dotted path in `model`
(`{"model": "my_pkg.my_module.MyProposer", "num_speculative_tokens": 4}`; `method` may be
given as "custom_class" or left out, as in vLLM's https://github.com/vllm-project/vllm/blob/c314af1abfddff7b6cce9af578be72c496c6a5e4/vllm/config/speculative.py).

The class implements the interface every built-in method implements (backends/serving/proposer.py):
`propose(batch: list[DraftRequest]) -> list[Draft]` (one Draft per request, at most
`request.num_draft_tokens` target token ids each), `release(seq_id)`, and optionally
`hidden_layer_ids` (the target layers whose hidden states it wants in
`DraftRequest.hidden_states`, numbered as backends/serving/target.py numbers them). Subclassing
`backends.serving.proposer.Proposer` gives the defaults. It is built as every method is, with
`cls.from_config(config, ctx)` (`config`: the resolved DrafterConfig; `ctx`: a ProposerContext,
with max_model_len, target_model, dtype, device and seed), else `cls(config)`. A `from_config`
written for the keyword contract before ProposerContext (`from_config(cls, config, **context)`,
or named keywords such as `max_model_len=...`) still gets the context's fields as keywords.

The module must be importable by the Python that runs the Triton stub (the venv: install
your package there, e.g. `pip install -e`; the stub ignores PYTHONPATH). A wrong path, an
import error, a missing class, a class without the interface, or a constructor that fails
is a load error naming the cause (the drafter model does not load, the others serve); a
proposer that answers with the wrong shape fails its requests with an error saying what
was wrong. client/examples/bigram_proposer.py is a worked example.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

import torch

from backends.config import DrafterConfig
from backends.runtime.model_store import model_config
from backends.serving.proposer import Draft, DraftRequest, Proposer, ProposerContext


def load_class(path: str) -> type:
    """The class a dotted path names, checked for the proposer interface."""
    module_name, _, class_name = (path or "").rpartition(".")
    if not module_name or not class_name:
        raise ValueError(f"Invalid custom proposer module path {path!r}: expected 'module.ClassName'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an import error inside the user's module is theirs to read
        raise ImportError(
            f"Cannot import module {module_name!r} for the custom proposer {path!r}: {type(e).__name__}: {e}"
        ) from e
    cls = getattr(module, class_name, None)
    if cls is None:
        raise AttributeError(f"Module {module_name!r} has no attribute {class_name!r} (custom proposer {path!r})")
    if not isinstance(cls, type):
        raise TypeError(f"custom proposer {path!r} is a {type(cls).__name__}, not a class")
    for name, args in (("propose", ([],)), ("release", (0,))):
        method = getattr(cls, name, None)
        if not callable(method):
            raise TypeError(
                f"custom proposer class {path!r} has no callable {name}(); implement the interface "
                "of backends.serving.proposer.Proposer (subclass it)"
            )
        try:
            inspect.signature(method).bind(None, *args)  # self plus the interface's arguments
        except TypeError as e:
            raise TypeError(
                f"custom proposer class {path!r}: {name}{inspect.signature(method)} does not take "
                f"{'(self, batch)' if name == 'propose' else '(self, seq_id)'}: {e}"
            ) from e
    return cls


def takes_context_keywords(factory: Any) -> bool:
    """Whether a user's `from_config` follows the keyword contract before ProposerContext: no
    positional parameter after `config`, or one of the context's field names there."""
    params = list(inspect.signature(factory).parameters.values())[1:]  # after config
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return not positional or positional[0].name in {f.name for f in dataclasses.fields(ProposerContext)}


def build_user_proposer(user_class: type, config: DrafterConfig, ctx: ProposerContext) -> Any:
    factory = getattr(user_class, "from_config", None)
    if not callable(factory):
        return user_class(config)
    if takes_context_keywords(factory):
        return factory(config, **dataclasses.asdict(ctx))
    return factory(config, ctx)


class CustomClassProposer(Proposer):
    """The registry's entry for `custom_class`: builds the user's proposer and checks what it
    returns before the rest of the server relies on it."""

    method = "custom_class"

    def __init__(self, inner: Any, path: str, vocab_size: int | None = None) -> None:
        self.inner, self.path = inner, path
        self.vocab_size = vocab_size  # the target's: draft ids and probability rows are checked against it
        ids = getattr(inner, "hidden_layer_ids", ()) or ()
        if not isinstance(ids, (tuple, list)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TypeError(f"custom proposer {path!r}: hidden_layer_ids must be a tuple of ints, got {ids!r}")
        self.hidden_layer_ids = tuple(ids)
        self.proposes_drafts = bool(getattr(inner, "proposes_drafts", True))

    @classmethod
    def from_config(cls, config: DrafterConfig, ctx: ProposerContext) -> CustomClassProposer:
        user_class = load_class(config.model)
        try:
            inner = build_user_proposer(user_class, config, ctx)
        except Exception as e:
            raise RuntimeError(
                f"Failed to instantiate custom proposer class {config.model!r}: {type(e).__name__}: {e}"
            ) from e
        target = ctx.target_model
        return cls(inner, config.model, model_config(target).vocab_size if target else None)

    @classmethod
    def layers_for(cls, config: Any, target_model: Any = None) -> tuple[int, ...]:
        """A custom proposer that reads hidden states declares them as a class attribute."""
        ids = getattr(load_class(config.model), "hidden_layer_ids", ()) or ()
        return tuple(ids) if isinstance(ids, (tuple, list)) else ()

    def propose(self, batch: list[DraftRequest]) -> list[Draft]:
        drafts = self.inner.propose(batch)
        if not isinstance(drafts, list) or len(drafts) != len(batch):
            got = f"a list of {len(drafts)}" if isinstance(drafts, list) else f"a {type(drafts).__name__}"
            raise TypeError(
                f"custom proposer {self.path!r} returned {got} for {len(batch)} requests; expected a "
                "list with one Draft per request"
            )
        for req, draft in zip(batch, drafts):
            if not isinstance(draft, Draft) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in draft.token_ids
            ):
                raise TypeError(
                    f"custom proposer {self.path!r} returned {draft!r} for sequence {req.seq_id}; "
                    "expected a backends.serving.proposer.Draft of int token ids"
                )
            if len(draft.token_ids) > req.num_draft_tokens:
                raise ValueError(
                    f"custom proposer {self.path!r} returned {len(draft.token_ids)} drafts for "
                    f"sequence {req.seq_id}, which asked for at most {req.num_draft_tokens}"
                )
            self._check_values(req, draft)
        return drafts

    def _check_values(self, req: DraftRequest, draft: Draft) -> None:
        """Ids the target has and real distributions: anything else would reach the verifier."""
        where = f"custom proposer {self.path!r} returned for sequence {req.seq_id}"
        vocab = self.vocab_size
        bad = [t for t in draft.token_ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise ValueError(f"{where} the draft id {bad[0]}, outside the target's vocabulary [0, {vocab or '...'})")
        probs = draft.probs
        if probs is None:
            return
        rows = len(draft.token_ids)
        if (
            not isinstance(probs, torch.Tensor)
            or probs.dim() != 2
            or probs.shape[0] != rows
            or (vocab is not None and probs.shape[1] != vocab)
        ):
            shape = list(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
            raise ValueError(
                f"{where} probs of shape {shape}; expected a tensor [{rows}, {vocab or 'V'}], one "
                "distribution over the target's vocabulary per draft"
            )
        if not probs.dtype.is_floating_point or not torch.isfinite(probs).all() or (probs < 0).any():
            raise ValueError(f"{where} probs that are not finite, non-negative probabilities")

    def release(self, seq_id: int) -> None:
        self.inner.release(seq_id)
