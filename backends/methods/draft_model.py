"""The `draft_model` drafter: a small causal LM proposes k tokens autoregressively.

Each sequence keeps its own KV cache and the drafter tokens it holds. The caller passes the
whole token list every step; the proposer crops its cache back to the first token that
differs (the first rejected draft, or the target's correction) and feeds only what is new,
then k - 1 drafts (the k-th is sampled but never fed: it may be rejected).

Where the lean runtime runs the draft model (Llama, Qwen2/3, Mistral on the CPU; with
``quantization: int8`` or ``int4`` on its int8 or int4 kernel, where the CPU has AVX-512 VNNI or
AVX2; int4 takes a layer whose K is a multiple of 64 and leaves others in int8; a layer whose K
the int8 kernel cannot take leaves the drafter in bf16 on the packed kernel), each sequence's KV
lives in one paged pool (``backends/runtime``) with prefix caching: a batch is one ragged
forward per draft position, rollback is a shorter length, no cache is ever copied. Otherwise
(other architectures, GPUs, int8 on a CPU without either kernel: torch's dynamic int8) it runs through
transformers: the per-sequence caches are left-padded to the longest and stacked, the new
tokens right-padded, an attention mask hides both pads and explicit position ids keep each
sequence's own positions, and the new KV is appended back to each sequence's cache afterwards.

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
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from backends.config import DrafterConfig
from backends.methods.drafts import (
    DRAFT_KV_MEMORY_GB,
    GROW_SLACK_TOKENS,
    check_quantization_device,
    check_sample_method,
    gather_drafts,
    sample_drafts,
)
from backends.methods.hetero_vocab import TextBridge
from backends.runtime import cpu_kernels
from backends.runtime.device import keep_attention_off_cudnn
from backends.runtime.lean_lm import LeanCausalLM, Row, UnsupportedArchitecture, read_checkpoint
from backends.runtime.model_store import hand_back_freed_memory, load_causal_lm, load_tokenizer, resolve_model
from backends.serving.proposer import Draft, DraftRequest, ProposerContext, SequenceProposer, check_one_device
from backends.serving.rejection import new_generator
from backends.serving.tree import DraftTree, best_nodes, path_scores

QUANTIZATIONS = (None, "int8", "int4")

log = logging.getLogger("tritonspec.draft_model")


@dataclass
class _SeqState:
    cache: DynamicCache | None  # transformers' cache; None on the lean runtime (the pool holds it)
    token_ids: list[int] = field(default_factory=list)  # exactly the tokens the cache holds


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
        model: torch.nn.Module | None,
        max_model_len: int,
        sample_method: str = "greedy",
        bridge: TextBridge | None = None,
        seed: int | None = None,
        lean: LeanCausalLM | None = None,
    ) -> None:
        """`model`: the draft model through transformers; `lean`: on the lean runtime, which then
        runs every forward (`model` may then be None: the runtime holds its own weights)."""
        check_sample_method(sample_method)
        if bridge is not None and sample_method != "greedy":
            raise ValueError("use_heterogeneous_vocab supports greedy draft sampling only")
        self.model = None if lean is not None else model
        self.config = lean.config if lean is not None else model.config
        self.device = lean.device if lean is not None else next(model.parameters()).device
        limit = getattr(self.config, "max_position_embeddings", None) or max_model_len
        self.max_model_len = min(limit, max_model_len)
        self.sample_method = sample_method
        self.bridge = bridge
        self.generator = new_generator(self.device, seed)
        self.lean = lean
        # Prefix caching, except through a text bridge (a retokenized context may change early tokens).
        self.pool = (
            lean.new_pool(memory_gb=DRAFT_KV_MEMORY_GB, prefix_caching=bridge is None) if lean is not None else None
        )
        super().__init__()

    @classmethod
    def from_config(cls, config: DrafterConfig, ctx: ProposerContext) -> DraftModelProposer:
        check_one_device(config, "the draft model")
        if config.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization={config.quantization!r} is not supported for the draft "
                "model; use null, 'int8' or 'int4' (the linear layers' weights in 8 or 4 bits)"
            )
        quantized = config.quantization is not None
        if quantized:
            check_quantization_device(config.quantization, ctx.device)
        if not config.model:
            raise ValueError("draft_model needs `model`: a named model, an HF directory or a GGUF file")
        path = resolve_model(config.model)
        # The lean runtime quantizes from bf16 weights; torch's dynamic int8 (the fallback, for
        # int4 too) from float32 ones (its matmuls run in float32 anyway).
        dtype = "bfloat16" if quantized else ctx.dtype
        # The lean runtime reads the weights itself where it can; transformers loads the rest.
        checkpoint = read_checkpoint(path, getattr(torch, dtype), ctx.device)
        model = None if checkpoint else load_causal_lm(path, dtype).to(ctx.device)
        lean = _lean_drafter(checkpoint or model, config.quantization)
        del checkpoint
        if lean is not None:  # it holds its own copy of the weights
            model = None
            hand_back_freed_memory()
        else:
            model = model or load_causal_lm(path, dtype).to(ctx.device)  # the checkpoint was read in vain
            keep_attention_off_cudnn(ctx.device)
            if quantized:
                model = quantize_int8(model.float())
        bridge = None
        if config.use_heterogeneous_vocab:
            if ctx.target_model is None:
                raise ValueError(
                    "use_heterogeneous_vocab needs the target model's tokenizer (target_model was not given)"
                )
            bridge = TextBridge(load_tokenizer(Path(ctx.target_model)), load_tokenizer(path))
        proposer = cls(model, ctx.max_model_len, config.draft_sample_method, bridge, ctx.seed, lean)
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
        if self.lean is not None and work:
            self._run_lean(work)
        elif len(work) == 1:
            self._run_one(work[0])
        elif work:
            self._run_batch(work)
        for w in work:
            req = batch[w.index]
            if self.bridge:
                drafts[w.index] = Draft(self.bridge.to_target(req.token_ids, w.context, w.drafts, req.num_draft_tokens))
            else:
                drafts[w.index] = self._tree(w) if w.tree else Draft(w.drafts, w.probs)
        return drafts

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
        if self.pool is not None and keep < self.pool.final_tokens(req.seq_id):
            # Back into blocks other sequences may share: start over, from the cache where it matches.
            self.pool.release(req.seq_id)
            self._attach(req.seq_id, state, context)
            return context[len(state.token_ids) :]
        if len(state.token_ids) > keep:
            if self.pool is not None:
                self.pool.truncate(req.seq_id, keep)
            else:
                state.cache.crop(keep - len(state.token_ids))
            del state.token_ids[keep:]
        return context[keep:]

    def _new_state(self, seq_id: int, context: list[int]) -> _SeqState:
        state = _SeqState(DynamicCache(config=self.config) if self.pool is None else None)
        if self.pool is not None:
            self._attach(seq_id, state, context)
        self._seqs[seq_id] = state
        return state

    def _attach(self, seq_id: int, state: _SeqState, context: list[int]) -> None:
        """Admit the sequence to the pool; the blocks of its context another sequence already
        computed join it (prefix caching; never the last token: its logits give the first
        draft). ``_run_lean`` grows the reservation as drafting needs."""
        self.pool.admit(seq_id, len(context) + GROW_SLACK_TOKENS)
        state.token_ids = list(context[: self.pool.share_prefix(seq_id, context[:-1])])

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        if self.pool is not None:
            self.pool.release(seq_id)

    def _run_lean(self, work: list[_Work]) -> None:
        """One ragged forward per draft position over every sequence, on the pool: the first
        feeds each sequence's new tokens, the others its last draft."""
        steps = max(w.num_drafts for w in work)
        for w in work:
            if self.pool.room(w.seq_id) < len(w.new_ids) + steps:
                self.pool.grow(w.seq_id, len(w.context) + steps + GROW_SLACK_TOKENS)
        rows, sampled = [Row(w.seq_id, w.new_ids) for w in work], []
        for step in range(steps):
            logits = torch.cat(self.lean.forward(self.pool, rows).logits)
            tokens = self._sample(logits, work, sampled)
            if step + 1 == steps:
                break
            rows = [Row(w.seq_id, tokens[i : i + 1]) for i, w in enumerate(work)]
        for w, drafted, probs in zip(work, *gather_drafts(sampled, [w.num_drafts for w in work])):
            w.drafts, w.probs = drafted, probs
            w.state.token_ids.extend(w.new_ids + w.drafts[: w.num_drafts - 1])
            # a sequence that needed fewer drafts than the batch was fed some past its own
            self.pool.truncate(w.seq_id, len(w.state.token_ids))
            self.pool.commit(w.seq_id, w.context)  # the context is final, the drafts are not

    def _sample(self, logits: torch.Tensor, work: list[_Work], steps: list[tuple]) -> torch.Tensor:
        """One draft per row of `logits` [B, V] (row i: work[i]); the tokens [B] stay on the
        device and are fed back as they are, `steps` collects (tokens, probs) for `gather_drafts`."""
        tokens, probs = sample_drafts(
            logits, self.sample_method, [w.temperature for w in work], [w.generator for w in work]
        )
        steps.append((tokens, probs))
        ranks = max((path[-1] for w in work for path in w.tree), default=0)
        if ranks:  # siblings of the chain: the most likely ids, one more than needed (the chain's own)
            dist = logits.float().softmax(dim=-1)
            top = dist.topk(ranks + 1, dim=-1)
            chain = dist.gather(1, tokens.view(-1, 1)).squeeze(1)
            rows = zip(work, tokens.tolist(), chain.tolist(), top.indices.tolist(), top.values.tolist())
            for w, token, p, ids, ps in rows:
                others = [(t, q) for t, q in zip(ids, ps) if t != token]
                w.candidates.append([(token, p), *others[:ranks]])
        return tokens

    def _run_one(self, w: _Work) -> None:
        """A lone sequence runs on its own cache: no padding, no copies."""
        ids, steps = torch.tensor([w.new_ids], device=self.device), []
        for _ in range(w.num_drafts):
            logits = self.model(input_ids=ids, cache=w.state.cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            ids = self._sample(logits, [w], steps).unsqueeze(1)
        (w.drafts,), (w.probs,) = gather_drafts(steps, [w.num_drafts])
        # The last draft was sampled but not fed: the cache holds context + drafts[:-1].
        w.state.token_ids.extend(w.new_ids + w.drafts[:-1])

    def _run_batch(self, work: list[_Work]) -> None:
        cached = [len(w.state.token_ids) for w in work]
        lengths = [len(w.new_ids) for w in work]
        max_cached, max_len = max(cached), max(lengths)
        cache = stack_caches([w.state.cache for w in work], cached, self.config)
        input_ids = [w.new_ids + [0] * (max_len - n) for w, n in zip(work, lengths)]
        mask = torch.tensor(
            [[0] * (max_cached - c) + [1] * (c + n) + [0] * (max_len - n) for c, n in zip(cached, lengths)],
            device=self.device,
        )
        positions = torch.tensor([list(range(c, c + max_len)) for c in cached], device=self.device)
        last = torch.tensor([[n - 1] for n in lengths], device=self.device)  # each row's last real token
        steps = max(w.num_drafts for w in work)
        ids, sampled = torch.tensor(input_ids, device=self.device), []
        for step in range(steps):
            logits = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=last,
            ).logits[:, -1]
            ids = self._sample(logits, work, sampled).unsqueeze(1)
            if step + 1 == steps:
                break
            mask = F.pad(mask, (0, 1), value=1)
            positions = positions.gather(1, last) + 1
            last = torch.zeros_like(last)
        for w, drafted, probs in zip(work, *gather_drafts(sampled, [w.num_drafts for w in work])):
            w.drafts, w.probs = drafted, probs
        # Back into each sequence's cache: its new tokens, then the drafts that were fed.
        append_new_entries(
            cache, [w.state.cache for w in work], max_cached, lengths, max_len, [w.num_drafts - 1 for w in work]
        )
        for w in work:
            w.state.token_ids.extend(w.new_ids + w.drafts[: w.num_drafts - 1])


def stack_caches(caches: list[DynamicCache], lengths: list[int], config: Any) -> DynamicCache:
    """One batched cache from per-sequence caches of `lengths`, each left-padded to the longest."""
    batched = DynamicCache(config=config)
    longest = max(lengths)
    if longest == 0:
        return batched
    shaped = next(c for c, n in zip(caches, lengths) if n)  # gives an empty cache its shape
    for layer_idx, template in enumerate(shaped.layers):
        keys, values = [], []
        for cache, n in zip(caches, lengths):
            own = cache.layers[layer_idx] if n else template
            keys.append(F.pad(own.keys[:1, :, :n], (0, 0, longest - n, 0)))
            values.append(F.pad(own.values[:1, :, :n], (0, 0, longest - n, 0)))
        batched.update(torch.cat(keys), torch.cat(values), layer_idx)
    return batched


def append_new_entries(
    batched: DynamicCache, caches: list[DynamicCache], start: int, lengths: list[int], gap: int, fed: list[int]
) -> None:
    """The inverse of `stack_caches` for one propose call's new entries: row i's `lengths[i]`
    new tokens (at `start`) and its `fed[i]` fed drafts (at `start + gap`) onto caches[i]."""
    for row, own in enumerate(caches):
        device = batched.layers[0].keys.device
        keep = torch.cat(
            [
                torch.arange(start, start + lengths[row], device=device),
                torch.arange(start + gap, start + gap + fed[row], device=device),
            ]
        )
        for layer_idx, layer in enumerate(batched.layers):
            own.update(layer.keys[row : row + 1, :, keep], layer.values[row : row + 1, :, keep], layer_idx)


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
        if quantization and cpu_kernels.packed_linear_available():
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
