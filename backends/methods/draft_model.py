"""The `draft_model` drafter: a small causal LM proposes k tokens autoregressively.

Each sequence keeps its own KV cache and the drafter tokens it holds. The caller passes the
whole token list every step; the proposer crops its cache back to the first token that
differs (the first rejected draft, or the target's correction) and feeds only what is new,
then k - 1 drafts (the k-th is sampled but never fed: it may be rejected).

A batch is one forward per draft position over every sequence, on an engine
(``backends/runtime/engine.py``). Where the lean runtime runs the draft model (Llama, Qwen2/3,
Mistral on the CPU; with ``quantization: int8`` or ``int4`` on its int8 or int4 kernel, where the
CPU has AVX-512 VNNI or AVX2; int4 takes a layer whose K is a multiple of 64 and leaves others in
int8; a layer whose K the int8 kernel cannot take leaves the drafter in bf16 on the packed
kernel), each sequence's KV lives in one paged pool with prefix caching: the forward is ragged,
rollback is a shorter length, no cache is ever copied. Otherwise (other architectures, GPUs, int8
on a CPU without either kernel: torch's dynamic int8) it runs through transformers
(``runtime/hf_engine.py``: a cache per sequence, a batch padded and stacked once per call).

Greedy drafts (the default) come without probabilities: an argmax draft was drawn from a
one-hot distribution, which is what the rejection sampler assumes when it gets none (vLLM's
"one-hot treatment"). Passing the softmax instead would bias sampled verification: a draft x
would be accepted with probability min(1, p(x)/q(x)) although it was proposed with
probability 1. `probabilistic` drafts are sampled from the softmax at the request's own
temperature and come with it; a greedy request still drafts the argmax (vLLM: sampling
drafts for a request that accepts only the argmax would only lower its acceptance).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from backends.config import DrafterConfig
from backends.methods.drafts import (
    DRAFT_KV_MEMORY_GB,
    GROW_SLACK_TOKENS,
    check_quantization_device,
    check_sample_method,
    draft_confidence,
    gather_drafts,
    sample_drafts,
)
from backends.methods.hetero_vocab import TextBridge
from backends.runtime import linear_kernels
from backends.runtime.engine import Engine, LeanEngine
from backends.runtime.lean_lm import LeanCausalLM, Row, UnsupportedArchitecture, read_checkpoint
from backends.runtime.model_store import hand_back_freed_memory, load_causal_lm, load_tokenizer, resolve_model
from backends.serving.proposer import Draft, DraftRequest, ProposerContext, SequenceProposer, check_one_device
from backends.serving.rejection import new_generator
from backends.serving.tree import DraftTree, best_nodes, path_scores

QUANTIZATIONS = (None, "int8", "int4")

log = logging.getLogger("tritonspec.draft_model")


@dataclass
class _SeqState:
    token_ids: list[int] = field(default_factory=list)  # exactly the tokens its cache holds


@dataclass
class _Work:
    """One sequence's part of a propose call."""

    index: int  # position in the batch
    seq_id: int
    state: _SeqState
    context: list[int]  # the sequence in the drafter's vocabulary
    new_ids: list[int]  # context tokens not in the cache yet (at least one)
    num_drafts: int
    temperature: float  # the request's; probabilistic drafts are sampled at it
    generator: torch.Generator | None  # the request's (SequenceProposer.generator_for)
    drafts: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # [num_drafts, V] on the drafter's device (probabilistic)
    tree: list[tuple[int, ...]] = field(default_factory=list)  # the static tree's paths in reach (empty: a chain)
    num_nodes: int = 0  # how many of them to keep
    # per draft position: (token, draft probability) of the chain's token, then of the others by rank
    candidates: list[list[tuple[int, float]]] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)  # per draft position: the drafter's probability of it


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix; a binary search whose comparisons run in C."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class DraftModelProposer(SequenceProposer):
    """With `speculative_token_tree`, the chain gets siblings: path (0, ..., 0, r) with d zeros
    is the r-th most likely other token at draft position d, from the logits the chain was
    drafted from (no extra forward). Its deeper paths must branch off the chain only."""

    token_tree: tuple[tuple[int, ...], ...] | None = None

    def __init__(
        self,
        engine: Engine,
        max_model_len: int,
        sample_method: str = "greedy",
        bridge: TextBridge | None = None,
        seed: int | None = None,
    ) -> None:
        """`engine`: runs the draft model (draft_engine builds it from a checkpoint)."""
        check_sample_method(sample_method)
        if bridge is not None and sample_method != "greedy":
            raise ValueError("use_heterogeneous_vocab supports greedy draft sampling only")
        if bridge is not None and engine.prefix_caching:  # a retokenized context may change early tokens
            raise ValueError("use_heterogeneous_vocab needs a draft engine without prefix caching")
        self.engine = engine
        self.config = engine.config
        self.device = engine.device
        limit = getattr(self.config, "max_position_embeddings", None) or max_model_len
        self.max_model_len = min(limit, max_model_len)
        self.sample_method = sample_method
        self.bridge = bridge
        self.generator = new_generator(self.device, seed)
        super().__init__()

    @classmethod
    def from_config(cls, config: DrafterConfig, ctx: ProposerContext) -> DraftModelProposer:
        check_one_device(config, "the draft model")
        if config.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization={config.quantization!r} is not supported for the draft "
                "model; use null, 'int8' or 'int4' (the linear layers' weights in 8 or 4 bits)"
            )
        if config.quantization is not None:
            check_quantization_device(config.quantization, ctx.device)
        if not config.model:
            raise ValueError("draft_model needs `model`: a named model, an HF directory or a GGUF file")
        path = resolve_model(config.model)
        bridge = None
        if config.use_heterogeneous_vocab:
            if ctx.target_model is None:
                raise ValueError(
                    "use_heterogeneous_vocab needs the target model's tokenizer (target_model was not given)"
                )
            bridge = TextBridge(load_tokenizer(Path(ctx.target_model)), load_tokenizer(path))
        # Prefix caching, except through a text bridge (a retokenized context may change early tokens).
        engine = draft_engine(path, ctx.dtype, ctx.device, config.quantization, prefix_caching=bridge is None)
        proposer = cls(engine, ctx.max_model_len, config.draft_sample_method, bridge, ctx.seed)
        proposer.token_tree = config.speculative_token_tree
        return proposer

    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest]) -> list[Draft]:
        drafts = [Draft() for _ in batch]
        work = []
        for i, req in enumerate(batch):
            context = self.bridge.to_draft(req.token_ids) if self.bridge else req.token_ids
            num_drafts = min(req.num_draft_tokens, self.max_model_len - len(context))
            if num_drafts <= 0 or not context:
                continue
            state = self._seqs.get(req.seq_id)
            if state is None:
                state = self._new_state(req.seq_id, context)
                new_ids = context[len(state.token_ids) :]
            else:
                new_ids = self._rollback(state, context, req)
            work.append(
                _Work(
                    i,
                    req.seq_id,
                    state,
                    context,
                    new_ids,
                    num_drafts,
                    req.temperature,
                    self.generator_for(req),
                    tree=self._tree_paths(req, num_drafts),
                    num_nodes=req.num_nodes,
                )
            )
        if work:
            self._draft(work)
        for w in work:
            req = batch[w.index]
            if self.bridge:
                drafts[w.index] = Draft(self.bridge.to_target(req.token_ids, w.context, w.drafts, req.num_draft_tokens))
            else:
                drafts[w.index] = self._tree(w) if w.tree else Draft(w.drafts, w.probs, scores=self._scores(w))
        return drafts

    @staticmethod
    def _scores(w: _Work) -> list[float]:
        """A chain's scores (Draft.scores): each draft's path probability, the product of the
        drafter's probabilities of it and of the drafts before it."""
        scores, path = [], 1.0
        for p in w.confidence[: len(w.drafts)]:
            path *= p
            scores.append(path)
        return scores

    def _tree_paths(self, req: DraftRequest, num_drafts: int) -> list[tuple[int, ...]]:
        """The static tree's paths within this step's drafts; empty: a chain."""
        if not req.num_nodes or self.token_tree is None or self.bridge is not None:
            return []
        return [path for path in self.token_tree if len(path) <= num_drafts]

    def _tree(self, w: _Work) -> Draft:
        """The chain and its siblings as a tree: the `num_nodes` paths of the highest
        cumulative draft probability (a cut in breadth-first order would drop the chain's
        deeper drafts first, which a confident draft gets accepted most). A sibling is a
        fixed token (a one-hot row when the chain comes with probabilities), so sampled
        verification stays exact whichever nodes are kept."""
        scores = path_scores(w.tree, lambda depth, rank: w.candidates[depth][rank][1])
        kept = best_nodes(scores, [len(p) for p in w.tree], w.num_nodes)
        paths = [w.tree[i] for i in kept]
        tokens, rows = [], []
        for path in paths:
            depth, rank = len(path) - 1, path[-1]
            token = w.candidates[depth][rank][0]
            tokens.append(token)
            if w.probs is not None:
                rows.append(
                    w.probs[depth] if rank == 0 else F.one_hot(torch.tensor(token), w.probs.shape[-1]).to(w.probs)
                )
        tree = DraftTree.from_paths(paths, tokens)
        return Draft(
            list(tree.token_ids), torch.stack(rows) if rows else None, list(tree.parents), [scores[i] for i in kept]
        )

    def _rollback(self, state: _SeqState, context: list[int], req: DraftRequest) -> list[int]:
        """Crop the cache past the drafts the target rejected; the tokens to feed. At least
        the last token is fed again, since its logits are what the first draft needs. Through
        a text bridge the drafter's tokens are a retokenization: there the longest shared
        prefix decides."""
        if self.bridge:
            valid = common_prefix_len(state.token_ids, context)
        else:  # of the drafts said accepted, those the cache holds (a tree may accept a sibling)
            base = len(context) - req.num_new
            valid = base + common_prefix_len(state.token_ids[base : req.num_kept], context[base : req.num_kept])
        keep = min(valid, len(state.token_ids), len(context) - 1)
        if keep < self.engine.final_tokens(req.seq_id):
            # Back into blocks other sequences may share: start over, from the cache where it matches.
            self.engine.release(req.seq_id)
            self._attach(req.seq_id, state, context)
            return context[len(state.token_ids) :]
        if len(state.token_ids) > keep:
            self.engine.truncate(req.seq_id, keep)
            del state.token_ids[keep:]
        return context[keep:]

    def _new_state(self, seq_id: int, context: list[int]) -> _SeqState:
        state = _SeqState()
        self._attach(seq_id, state, context)
        self._seqs[seq_id] = state
        return state

    def _attach(self, seq_id: int, state: _SeqState, context: list[int]) -> None:
        """Admit the sequence to the engine; the blocks of its context another sequence already
        computed join it (prefix caching; never the last token: its logits give the first
        draft). ``_draft`` grows the reservation as drafting needs."""
        self.engine.admit(seq_id, len(context) + GROW_SLACK_TOKENS)
        state.token_ids = list(context[: self.engine.share_prefix(seq_id, context[:-1])])

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self.engine.release(seq_id)

    def _draft(self, work: list[_Work]) -> None:
        """One forward per draft position over every sequence: the first feeds each sequence's
        new tokens, the others its last draft (the last draft is sampled, never fed)."""
        steps = max(w.num_drafts for w in work)
        for w in work:
            if self.engine.room(w.seq_id) < len(w.new_ids) + steps:
                self.engine.grow(w.seq_id, len(w.context) + steps + GROW_SLACK_TOKENS)
        rows, sampled = [Row(w.seq_id, w.new_ids) for w in work], []
        for step in range(steps):
            logits = torch.cat(self.engine.forward(rows).logits)  # [B, V]: each row's last token
            tokens = self._sample(logits, work, sampled)
            if step + 1 == steps:
                break
            rows = [Row(w.seq_id, tokens[i : i + 1]) for i, w in enumerate(work)]
        for w, drafted, probs in zip(work, *gather_drafts(sampled, [w.num_drafts for w in work])):
            w.drafts, w.probs = drafted, probs
            w.state.token_ids.extend(w.new_ids + w.drafts[: w.num_drafts - 1])
            # a sequence that needed fewer drafts than the batch was fed some past its own
            self.engine.truncate(w.seq_id, len(w.state.token_ids))
            self.engine.commit(w.seq_id, w.context)  # the context is final, the drafts are not

    def _sample(self, logits: torch.Tensor, work: list[_Work], steps: list[tuple]) -> torch.Tensor:
        """One draft per row of `logits` [B, V] (row i: work[i]); the tokens [B] stay on the
        device and are fed back as they are, `steps` collects (tokens, probs) for `gather_drafts`."""
        tokens, probs = sample_drafts(
            logits, self.sample_method, [w.temperature for w in work], [w.generator for w in work]
        )
        steps.append((tokens, probs))
        ranks = max((path[-1] for w in work for path in w.tree), default=0)
        if not ranks:
            chain = draft_confidence(logits, tokens)
        else:  # siblings of the chain: the most likely ids, one more than needed (the chain's own)
            dist = logits.float().softmax(dim=-1)
            top = dist.topk(ranks + 1, dim=-1)
            chain = dist.gather(1, tokens.view(-1, 1)).squeeze(1)
            rows = zip(work, tokens.tolist(), chain.tolist(), top.indices.tolist(), top.values.tolist())
            for w, token, p, ids, ps in rows:
                others = [(t, q) for t, q in zip(ids, ps) if t != token]
                w.candidates.append([(token, p), *others[:ranks]])
        for w, p in zip(work, chain.tolist()):
            w.confidence.append(p)
        return tokens


def draft_engine(path: Path, dtype: str, device: str, quantization: str | None, prefix_caching: bool) -> Engine:
    """The draft model at `path` on the lean runtime where it runs (its own pool), else through
    transformers (torch's dynamic int8 for a quantization the lean runtime cannot run)."""
    # The lean runtime quantizes from bf16 weights; torch's dynamic int8 (the fallback, for
    # int4 too) from float32 ones (its matmuls run in float32 anyway).
    dtype = "bfloat16" if quantization else dtype
    # The lean runtime reads the weights itself where it can; transformers loads the rest.
    checkpoint = read_checkpoint(path, getattr(torch, dtype), device)
    model = None if checkpoint else load_causal_lm(path, dtype).to(device)
    lean = _lean_drafter(checkpoint or model, quantization)
    del checkpoint
    if lean is not None:  # it holds its own copy of the weights
        del model
        hand_back_freed_memory()
        return LeanEngine.with_pool(lean, memory_gb=DRAFT_KV_MEMORY_GB, prefix_caching=prefix_caching)
    model = model or load_causal_lm(path, dtype).to(device)  # the checkpoint was read in vain
    from backends.runtime.hf_engine import HFEngine  # transformers' config classes: only where it runs

    return HFEngine(quantize_int8(model.float()) if quantization else model)


def _lean_drafter(model: torch.nn.Module | SimpleNamespace, quantization: str | None) -> LeanCausalLM | None:
    """The draft model (transformers' or a checkpoint read for the runtime) on the lean runtime,
    or None where it does not run (transformers then).
    Batch-invariant: on the CPU its layers run in one C call each (key-list attention), on a GPU
    on the runtime's Triton kernels; the drafts need not be invariant, the time is what counts.
    int8 where its kernel cannot run (a K not a multiple of 4, a CPU without AVX2) runs in bf16
    on the packed kernel where that runs: faster than torch's dynamic int8 (Qwen2.5-Coder-0.5B
    on a 2-core AVX2 EPYC: 35 against 39 ms a token; int8 on the kernel: 19)."""
    try:
        return LeanCausalLM.from_hf(model, batch_invariant=True, quantization=quantization)
    except UnsupportedArchitecture as e:
        if quantization and linear_kernels.packed_linear_available():
            log.info("draft model in bf16 on the lean runtime, not %s: %s", quantization, e)
            return _lean_drafter(model, None)
        log.info("draft model runs through transformers: %s", e)
        return None


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Dynamic int8 of every nn.Linear, where the lean runtime's int8 kernel cannot run: about 2x
    faster drafting on CPU than float32. Not bit-equal to the float model (the activation scale
    depends on the whole input), which only costs acceptance: the target decides every token."""
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # torch.ao.quantization is deprecated in favour of torchao
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
