"""EAGLE-family drafters: `eagle` (EAGLE-1/2 heads) and `eagle3` (EAGLE-3 heads).

An EAGLE head is one decoder layer that drafts from the target's hidden states instead of
from tokens alone (EAGLE, arXiv 2401.15077; EAGLE-2's dynamic tree, arXiv 2406.16858; EAGLE-3,
arXiv 2503.01840). Both methods load their checkpoints in the published layouts (SafeAILab/EAGLE's
eagle/model/cnets1.py and cnets.py, https://github.com/SafeAILab/EAGLE); the layout is decided from config.json
and the state-dict keys, never from the directory name:

- EAGLE-1/2: Llama-style config.json with `num_hidden_layers` (1), state dict `fc.weight`
  [H, 2H] (+ `fc.bias` unless `"bias": false`), `layers.{i}.*` where layer 0 has no
  `input_layernorm`. No final norm; the target's LM head turns the layer output into logits
  and its embedding embeds the tokens (both borrowed when the checkpoint omits them).
- EAGLE-3: config.json with `draft_vocab_size` (or the speculators format:
  `speculators_model_type: eagle3` + `transformer_layer_config`), state dict `fc.weight`
  [H, 3·H_t] (no bias), `midlayer.*` or `layers.0.*` with 2H-wide q/k/v, `hidden_norm` and
  `input_layernorm` (on the embedding), `norm.weight`, `lm_head.weight` [V_d, H], `d2t`
  [V_d] offsets (target id = draft id + d2t[draft id]) and `t2d` [V] (ignored).

How hidden states line up with tokens (the "one-token shift")
------------------------------------------------------------
Let the sequence be x_0 .. x_{n-1}. The target has run x_0 .. x_{n-2}; x_{n-1} is the token it
just emitted. h_t is the target's hidden state at position t (computed from x_0..x_t; the
state that predicted x_{t+1}). EAGLE's input at draft position t is the pair
(x_{t+1}, h_t), at rotary position t; x_0 is never an input token. The head's output at
position n-2 gives the first draft d_1 and a hidden state g that replaces h for the next
position: pair (d_1, g) at position n-1 gives d_2, and so on (k drafts = k forwards; the
k-th draft is never fed).

Delivery contract (`DraftRequest.hidden_states`): a float tensor [r, len(hidden_layer_ids), H_t]
with one row per target position the drafter has not been given yet, in order, ending at
position n-2: row j is h_{n-1-r+j}, i.e. exactly what `TargetRunner.verify` returns as
`VerifyResult.hidden_states` (the pending tokens + accepted drafts), concatenated over every
verify step since the last draft call (steps where no draft was asked for included). Layer
ids come from `hidden_layer_ids`: (-1,) for eagle (the final normed state), the sorted aux
ids for eagle3 (default (2, L//2, L-3) as vLLM, or `eagle_aux_hidden_state_layer_ids`). Rows
may repeat positions already delivered (they are fed again); a gap is an error.
`hidden_states=None` means the target has not run yet (the first step): no drafts.

The head's decoder layers run on the lean runtime (`LeanDecoder`, backends/runtime/lean_lm.py):
each sequence's entries live in one paged KV pool per proposer, a call is one ragged step over
every sequence's new pairs, then one step per draft position or tree level; `decode` gives the
head's own inputs to those layers (the module's `forward` runs the same `decode` over a
transformers DynamicCache, for training and references).

Draft-position KV entries computed from the drafter's own g are speculative: the next call
crops them (even for accepted drafts, which are re-fed with the target's h, as EAGLE does)
and keeps only the entries computed from target states whose tokens still match the
sequence (the token list is diffed as in draft_model).

Greedy drafts come without probabilities (one-hot, backends/methods/drafts.py); `probabilistic`
drafts are sampled and come with [k, V_target] probabilities (eagle3 scatters its draft
vocabulary into the target's through d2t; target ids outside it get probability 0).

Draft trees (a request with `num_nodes` > 0 under a tree config; backends/serving/tree.py)
------------------------------------------------------------------------------------------
A node's pair is (its token, its parent's output state) at position n-1 + depth, and it
attends to the sequence's target pairs, its ancestors and itself; the head runs once per
level for all the level's fed nodes of every sequence (as many per sequence), so a tree
costs as many forwards as a chain of its depth.
- `dynamic_tree` (EAGLE-2): the root's top_k tokens are the first level; each level feeds
  its top_k nodes by cumulative draft log-probability (the draft's softmax along the path)
  and gives each top_k children; at the end the num_nodes best of all are kept (a node never
  scores above its parent, and ties keep the shallower, so the kept nodes form a tree).
- `speculative_token_tree` (static): the paths of at most k levels, cut to the first
  num_nodes (breadth-first, so closed under parents); path (r_0, .., r_d) is the rank-r_d
  token of its parent's distribution. Only nodes with children are fed.
Tree drafts are these fixed top-ranked tokens for greedy and sampled requests alike and come
without probabilities: distinct fixed siblings are one-hot drafts, which the verifier's
recursive rejection keeps exact. The tree's entries are dropped from the head's cache before
the call returns: the accepted path comes back as new tokens with the target's states.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backends.config import DrafterConfig
from backends.config import aux_layer_ids as checkpoint_aux_layer_ids
from backends.methods.drafts import DRAFT_KV_MEMORY_GB, GROW_SLACK_TOKENS, gather_drafts
from backends.methods.eagle_head import EagleCheckpointError, EagleHead, kernel_norms, kernel_weights_of, load_eagle
from backends.methods.head_checkpoint import Checkpoint, TargetInfo
from backends.methods.head_proposer import HeadProposer
from backends.runtime import cpu_kernels
from backends.runtime.lean_lm import LeanDecoder, Row
from backends.serving.proposer import Draft, DraftRequest, ProposerContext
from backends.serving.request import is_greedy
from backends.serving.tree import ROOT, DraftTree, best_nodes, subtree_parents

log = logging.getLogger(__name__)
# ---------------------------------------------------------------------------- the proposers


@dataclass
class _SeqState:
    # x_0..x_c: the pool's first c entries are the pairs (x_{t+1}, h_t) from target states;
    # entries past c came from the drafter's own states and are always cropped.
    token_ids: list[int] = field(default_factory=list)


@dataclass
class _Work:
    index: int
    seq_id: int
    start: int  # first position fed this call
    new_ids: list[int]  # x_{start+1}..x_{n-1}
    features: torch.Tensor  # [len(new_ids), D]
    num_drafts: int  # chain drafts, or tree levels
    temperature: float
    generator: torch.Generator | None  # the request's (SequenceProposer.generator_for)
    num_nodes: int = 0  # the most tree nodes; 0: a chain
    drafts: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # [num_drafts, V_target] on the head's device (probabilistic)
    parents: list[int] | None = None  # a tree's (None: a chain)
    scores: list[float] | None = None  # a tree's node scores (Draft.scores)

    @property
    def context(self) -> int:
        """Pool entries from target states once this call's pairs are in."""
        return self.start + len(self.new_ids)


class EagleProposer(HeadProposer):
    """The head's decoder layers run on the lean runtime (backends/runtime), each sequence's
    entries in one paged KV pool: a propose call is one ragged step over every sequence's new
    target pairs, then one step per draft position (a chain) or tree level."""

    method = "eagle"
    hidden_layer_ids = (-1,)  # EAGLE-1/2 read the target's final normed state
    _seqs: dict[int, _SeqState]

    def __init__(
        self,
        head: nn.Module,
        max_model_len: int,
        sample_method: str = "greedy",
        seed: int | None = None,
        *,
        dynamic_tree: dict[str, int] | None = None,
        token_tree: tuple[tuple[int, ...], ...] | None = None,
        kernels: bool = True,
    ) -> None:
        """`dynamic_tree` ({"top_k", "total_token"}) or `token_tree` (a static tree's paths):
        how requests that ask for tree nodes are drafted; neither: always chains. `kernels`
        (bf16 on a CPU whose kernels build): each decoder layer in one C call and the head's
        RMSNorms in C; False: the reference they are tested against, bit for bit (the layer op
        by op, transformers' norms)."""
        super().__init__(head, max_model_len, sample_method, seed)
        self.dynamic_tree = dynamic_tree
        self.token_tree = token_tree
        self.decoder = LeanDecoder.from_layers(head.config, list(head.layers), self.dtype)
        self.pool = self.decoder.new_pool(memory_gb=DRAFT_KV_MEMORY_GB)
        self.kernels = kernels and self.decoder.layer_steps is not None
        if not self.kernels:
            self.decoder.layer_steps = None  # plan() then makes no scratch: layer() runs op by op
        elif turned := kernel_norms(head):
            log.info("%s head: its layers in one C call each, %d RMSNorms on the C kernel", self.method, turned)

    @classmethod
    def from_config(cls, config: DrafterConfig, ctx: ProposerContext) -> EagleProposer:
        proposer = super().from_config(config, ctx)
        proposer.dynamic_tree, proposer.token_tree = config.dynamic_tree, config.speculative_token_tree
        return proposer

    @classmethod
    def load_head(cls, config: Any, target: TargetInfo, dtype: str) -> EagleHead:
        return load_eagle(cls.checkpoint(config), target, dtype, cls.method, config.eagle_aux_hidden_state_layer_ids)

    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest]) -> list[Draft]:
        drafts = [Draft() for _ in batch]
        work = [w for i, req in enumerate(batch) if (w := self._prepare(i, req)) is not None]
        chains, trees = [w for w in work if not w.num_nodes], [w for w in work if w.num_nodes]
        if chains:
            self._run(chains)
        if trees:
            self._run_tree(trees)
        for w in work:
            drafts[w.index] = Draft(w.drafts, w.probs, w.parents, w.scores)
        return drafts

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self.pool.release(seq_id)

    def _prepare(self, index: int, req: DraftRequest) -> _Work | None:
        """Crop the sequence's pool entries back to where the delivered hidden states start,
        make room for this call's; the work."""
        n, hidden = len(req.token_ids), req.hidden_states
        num_drafts = min(req.num_draft_tokens, self.max_model_len - n)
        if hidden is None or num_drafts <= 0:
            return None  # the target has not run yet (first step), or no room
        width = len(self.hidden_layer_ids) * self.head.target_hidden_size
        if (
            hidden.dim() != 3
            or hidden.shape[1] != len(self.hidden_layer_ids)
            or hidden.shape[1] * hidden.shape[2] != width
            or not 0 < hidden.shape[0] < n
        ):
            raise ValueError(
                f"sequence {req.seq_id}: hidden_states has shape {list(hidden.shape)}; expected [rows, "
                f"{len(self.hidden_layer_ids)}, {width // len(self.hidden_layer_ids)}] (layers "
                f"{self.hidden_layer_ids}) with 1 <= rows <= {n - 1} (one per target position)"
            )
        start = n - 1 - hidden.shape[0]
        state = self._seqs.get(req.seq_id)
        if state is None:
            self.pool.admit(req.seq_id, n + GROW_SLACK_TOKENS)
            state = self._seqs[req.seq_id] = _SeqState()
        valid = max(0, min(len(state.token_ids), req.num_kept) - 1)
        if valid < start:
            raise ValueError(
                f"sequence {req.seq_id}: hidden states start at position {start}, but the drafter has "
                f"target states up to position {valid - 1} only; deliver every position the target "
                "processed since the last draft call"
            )
        self.pool.truncate(req.seq_id, min(start, self.pool.length(req.seq_id)))
        state.token_ids = list(req.token_ids)
        trees = self.dynamic_tree is not None or self.token_tree is not None
        num_nodes = req.num_nodes if trees else 0
        # entries this call adds past the context: the fed drafts, or every fed tree node
        fed = max(num_nodes, num_drafts * (self.dynamic_tree or {}).get("top_k", 1)) if num_nodes else num_drafts
        if self.pool.room(req.seq_id) < n - start + fed:
            self.pool.grow(req.seq_id, n + fed + GROW_SLACK_TOKENS)
        return _Work(
            index,
            req.seq_id,
            start,
            req.token_ids[start + 1 :],
            self.head.features(hidden.to(self.device, self.dtype)),
            num_drafts,
            req.temperature,
            self.generator_for(req),
            num_nodes,
        )

    def _decode(self, rows: list[Row], features: list[torch.Tensor], step: int) -> list[torch.Tensor]:
        """One ragged step of the head over the pool: row i's pairs (its tokens, features[i]);
        each row's output states. Positions are the rows' own (default: after their entries)."""
        plan = self.decoder.plan(self.pool, rows)
        order = sorted(range(len(rows)), key=lambda i: plan.spans[i][0])  # the step's token order
        features = torch.cat([features[i] for i in order])

        def run_layer(i: int, attn_input: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            # a copy: the layer in one C call updates its residual in place, the head may read it again
            return self.decoder.layer(i, residual.clone(), self.pool, plan, attn_input)

        out = self.head.decode(plan.ids, features, plan.positions.to(self.device), run_layer, step)
        return [out[a:b] for a, b in plan.spans]

    def _feed_context(self, work: list[_Work]) -> torch.Tensor:
        """The first forward: every sequence's new target pairs, each after its kept entries;
        the head's state at each sequence's last pair [B, D] (position w.context - 1)."""
        rows = [Row(w.seq_id, w.new_ids) for w in work]
        return torch.stack([out[-1] for out in self._decode(rows, [w.features for w in work], 0)])

    def _run(self, work: list[_Work]) -> None:
        """A chain: one step per draft position for the whole batch."""
        steps, sampled = max(w.num_drafts for w in work), []
        for w in work:  # a sequence drafting fewer than the batch is fed as many positions
            if self.pool.room(w.seq_id) < len(w.new_ids) + steps - 1:
                self.pool.grow(w.seq_id, w.context + steps - 1 + GROW_SLACK_TOKENS)
        if (drafted := self._chain_in_c(work, steps)) is not None:
            for w, row in zip(work, drafted):
                w.drafts, w.probs = row[: w.num_drafts], None
                self.pool.truncate(w.seq_id, w.context + w.num_drafts - 1)
            return
        hidden = self._feed_context(work)
        for step in range(steps):
            tokens = self._sample(self.head.logits(hidden, step), work, sampled)
            if step + 1 == steps:
                break
            # The next pair: the draft just made with the head's own state, one position on.
            rows = [Row(w.seq_id, tokens[i : i + 1].cpu()) for i, w in enumerate(work)]
            hidden = torch.cat(self._decode(rows, list(hidden.unsqueeze(1)), step + 1))
        for w, drafted, probs in zip(work, *gather_drafts(sampled, [w.num_drafts for w in work])):
            w.drafts, w.probs = drafted, probs
            # keep the fed drafts (a sequence that needed fewer than the batch was fed more)
            self.pool.truncate(w.seq_id, w.context + w.num_drafts - 1)

    def _chain_in_c(self, work: list[_Work], steps: int) -> list[list[int]] | None:
        """`_run`'s greedy chain of a one-layer EAGLE-1, EAGLE-3 or DeepSeek MTP head, the
        context's forward included, in one C call (cpu_kernels.eagle_chain: the same kernels in
        the same order, so the same drafts and KV bits, without ~0.2 ms of Python a position);
        each row's `steps` drafts. None where it does not run (another head, sampled drafts,
        the op-by-op path, a first pair without its embedding) or logits held a NaN."""
        head = self.head
        greedy = self.sample_method != "probabilistic" or all(is_greedy(w.temperature) for w in work)
        if not (self.kernels and greedy) or (head.zero_first_embedding and any(w.start == 0 for w in work)):
            return None
        if (inputs := head.chain_inputs()) is None:
            return None
        width = head.config.hidden_size * (1 if "fc" in inputs else 2)  # the layer reads fc's output or both norms
        if self.decoder.layers[0].qkv.bounds[-1][1] != width:
            return None
        # One plan for the call: each row's new pairs, then its steps - 1 fed positions (the
        # causal key lists of single steps). The kernel takes the pairs row after row, then
        # the fed positions step-major.
        fed = steps - 1
        plan = self.decoder.plan(self.pool, [Row(w.seq_id, w.new_ids + [0] * fed) for w in work])
        starts = torch.tensor([start for start, _ in plan.spans])
        sizes = torch.tensor([len(w.new_ids) for w in work])
        pairs = torch.cat([torch.arange(a, a + n) for a, n in zip(starts.tolist(), sizes.tolist())])
        order = torch.cat([pairs, (starts + sizes + torch.arange(fed).unsqueeze(1)).flatten()])
        keys = cpu_kernels.KeyLists(plan.keys.slots, plan.keys.start[order], plan.keys.length[order])
        queries = (plan.slots[order], plan.cos.flatten(1)[order], plan.sin.flatten(1)[order], keys)
        ids = torch.tensor([t for w in work for t in w.new_ids])
        context = (ids, torch.cat([w.features for w in work]), sizes.cumsum(0) - 1)
        lm_head = inputs.pop("lm_head")
        chain = cpu_kernels.EagleChain(
            layer=self.decoder.layer_steps,
            sizes=self.decoder.sizes,
            eps=self.decoder.eps,
            kv=self.pool.kv,
            context=context,
            steps=steps,
            queries=queries,
            embed=head.embed_tokens.weight,
            lm_head=kernel_weights_of(lm_head),
            vocab=lm_head.out_features,
            to_target=head.draft_to_target,
            **inputs,
        )
        drafted = cpu_kernels.eagle_chain(chain)
        if drafted is None:  # a NaN: back to the kept entries, for the loop in torch
            for w in work:
                self.pool.truncate(w.seq_id, w.start)
        return drafted

    def _run_tree(self, work: list[_Work]) -> None:
        """A tree per sequence, level by level for the whole batch; the tree's entries are
        not kept (the accepted path comes back with the target's states)."""
        feed = _TreeFeed(self, work, self._feed_context(work))
        root = self.head.logits(feed.hidden[:, 0], 0).float()
        if self.dynamic_tree is not None:
            top_k = self.dynamic_tree["top_k"]
            trees = dynamic_trees(
                feed, root, top_k, [w.num_drafts for w in work], [w.num_nodes for w in work], self._target_ids
            )
        else:
            paths = [[p for p in self.token_tree if len(p) <= w.num_drafts][: w.num_nodes] for w in work]
            trees = static_trees(feed, root, paths, self._target_ids)
        for w, (token_ids, parents, scores) in zip(work, trees):
            w.drafts, w.parents, w.scores = token_ids, parents, scores
            self.pool.truncate(w.seq_id, w.context)

    def _target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.head.draft_to_target is None else self.head.draft_to_target[draft_ids]

    def _sample(self, logits: torch.Tensor, work: list[_Work], steps: list[tuple]) -> torch.Tensor:
        """One draft per row of draft-vocabulary `logits` [B, V_d] (row i: work[i]), as target
        ids [B] that stay on the device; `steps` collects (tokens, target-vocabulary probs) for
        `gather_drafts`."""
        tokens, probs = self.sample(logits, [w.temperature for w in work], [w.generator for w in work])
        steps.append((tokens, probs))
        return tokens


class Eagle3Proposer(EagleProposer):
    method = "eagle3"

    @classmethod
    def layers_for(cls, config: Any, target_model: Any = None) -> tuple[int, ...]:
        """The aux layers `load_eagle` will pick: the config's, else the checkpoint's, else
        vLLM's default; ascending, as vLLM collects them."""
        ids = config.eagle_aux_hidden_state_layer_ids
        if not ids:
            _, cfg = Checkpoint.open(cls.checkpoint(config), EagleCheckpointError)
            ids = checkpoint_aux_layer_ids(cfg, {"num_hidden_layers": TargetInfo.load(target_model).num_layers})
        return tuple(sorted(ids))


# ---------------------------------------------------------------------------- draft trees


class _TreeFeed:
    """Tree nodes fed to the head after each sequence's context, a level at a time, as many
    per sequence; fed slot 0 is the root (the last target pair, already in the context). A
    node's pool entry goes after the nodes fed before it; its mask shows it the context, its
    ancestors and itself."""

    def __init__(self, proposer: EagleProposer, work: list[_Work], context: torch.Tensor) -> None:
        self.proposer, self.work = proposer, work
        self.hidden = context.unsqueeze(1)  # [B, 1 + fed, D] each slot's output state
        # [B, 1 + fed, fed]: the fed nodes each slot sees (its ancestors and itself)
        self.seen = torch.zeros(len(work), 1, 0, dtype=torch.bool)

    @property
    def size(self) -> int:
        """Nodes fed so far (the next one's slot is size + 1)."""
        return self.seen.shape[2]

    def __call__(self, tokens: torch.Tensor, parents: torch.Tensor, depth: int) -> torch.Tensor:
        """Feed nodes `tokens` [B, P] (target ids) at `depth` (0: the root's children) whose
        parents are the fed slots `parents` [B, P]; their draft logits [B, P, V_d]."""
        batch, num = tokens.shape
        slots = parents.unsqueeze(-1)
        features = self.hidden.gather(1, slots.expand(-1, -1, self.hidden.shape[-1]))
        own = torch.eye(num, dtype=torch.bool).expand(batch, -1, -1)
        seen = torch.cat([self.seen.gather(1, slots.cpu().expand(-1, -1, self.size)), own], dim=-1)
        rows = [
            Row(
                w.seq_id,
                tokens[i].cpu(),
                torch.cat([torch.ones(num, w.context, dtype=torch.bool), seen[i]], dim=-1),
                torch.full((num,), w.context + depth),  # the root is the last pair, at context - 1
            )
            for i, w in enumerate(self.work)
        ]
        out = torch.stack(self.proposer._decode(rows, list(features), depth + 1))
        self.seen = torch.cat([F.pad(self.seen, (0, num)), seen], dim=1)
        self.hidden = torch.cat([self.hidden, out], dim=1)
        return self.proposer.head.logits(out, depth + 1).float()


def dynamic_trees(
    feed: _TreeFeed,
    root: torch.Tensor,
    top_k: int,
    depths: list[int],
    sizes: list[int],
    target_ids: Callable[[torch.Tensor], torch.Tensor],
) -> list[tuple[list[int], list[int], list[float]]]:
    """EAGLE-2's trees from the root's draft logits `root` [B, V_d]: at most depths[i] levels
    and sizes[i] nodes for sequence i. Every candidate is a (token, cumulative log-probability,
    parent) triple; each level feeds its top_k candidates. `target_ids` maps draft ids."""
    k = min(top_k, root.shape[-1])
    scores, ids = root.log_softmax(-1).topk(k)
    tokens, parents = target_ids(ids), torch.full_like(ids, ROOT)
    slots = torch.zeros_like(ids)  # each candidate's parent's fed slot (0: the root)
    levels, first = [(tokens, scores, parents)], 0  # first: the level's first candidate's index
    for depth in range(max(depths) - 1):
        frontier = scores.topk(k).indices
        base = feed.size + 1
        logits = feed(tokens.gather(1, frontier), slots.gather(1, frontier), depth)
        child_scores, child_ids = logits.log_softmax(-1).topk(k)  # [B, k frontier, k children]
        scores = (scores.gather(1, frontier).unsqueeze(-1) + child_scores).flatten(1)
        tokens = target_ids(child_ids).flatten(1)
        parents = (first + frontier).unsqueeze(-1).expand(-1, -1, k).flatten(1)
        slots = (base + torch.arange(k, device=ids.device)).repeat_interleave(k).expand_as(scores)
        first += levels[-1][0].shape[1]
        levels.append((tokens, scores, parents))
    depth_of = [d for d, (t, _, _) in enumerate(levels) for _ in range(t.shape[1])]
    tokens, scores, parents = (torch.cat(part, dim=1).tolist() for part in zip(*levels))
    return [best_subtree(t, s, p, depth_of, d, n) for t, s, p, d, n in zip(tokens, scores, parents, depths, sizes)]


def best_subtree(
    token_ids: list[int], scores: list[float], parents: list[int], depths: list[int], max_depth: int, size: int
) -> tuple[list[int], list[int], list[float]]:
    """EAGLE-2's rerank: the `size` candidates of the highest score (cumulative log-probability)
    within `max_depth` levels (ties: the shallower, then the earlier; a node never scores above
    its parent, so every kept node's parent is kept), ordered by depth, then score. Returns
    (tokens, parents, path probabilities)."""
    eligible = [i for i, d in enumerate(depths) if d < max_depth]
    kept = [eligible[j] for j in best_nodes([scores[i] for i in eligible], [depths[i] for i in eligible], size)]
    return [token_ids[i] for i in kept], subtree_parents(parents, kept), [math.exp(scores[i]) for i in kept]


def static_trees(
    feed: _TreeFeed,
    root: torch.Tensor,
    trees: list[list[tuple[int, ...]]],
    target_ids: Callable[[torch.Tensor], torch.Tensor],
) -> list[tuple[list[int], list[int], list[float]]]:
    """Static trees from the root's draft logits `root` [B, V_d]: trees[i] is sequence i's
    node paths (closed under parents, breadth-first). Their union runs for every sequence,
    a level at a time, feeding only the nodes that have children. Returns each tree's
    (tokens, parents, path probabilities under the head)."""
    paths = sorted(set().union(*trees), key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(paths)}
    has_children = {p[:-1] for p in paths}
    tokens = torch.zeros(len(root), len(paths), dtype=torch.long, device=root.device)
    scores = torch.ones(len(root), len(paths), device=root.device)
    logits, fed, slot = root.unsqueeze(1), [()], {(): 0}  # the distributions the next level ranks
    for depth in range(1, len(paths[-1]) + 1):
        level = [p for p in paths if len(p) == depth]
        ranked = logits.topk(max(p[-1] for p in level) + 1).indices  # [B, fed, ranks]
        where = {p: j for j, p in enumerate(fed)}
        parent_rows, ranks = [where[p[:-1]] for p in level], [p[-1] for p in level]
        chosen = ranked[:, parent_rows, ranks]
        tokens[:, [index[p] for p in level]] = target_ids(chosen)
        probs = logits.softmax(-1).gather(-1, ranked)[:, parent_rows, ranks]
        above = scores[:, [index[p[:-1]] for p in level]] if depth > 1 else 1.0
        scores[:, [index[p] for p in level]] = above * probs
        fed = [p for p in level if p in has_children]
        if not fed:
            break
        base = feed.size + 1
        parents = torch.tensor([slot[p[:-1]] for p in fed], device=root.device).expand(len(root), -1)
        logits = feed(tokens[:, [index[p] for p in fed]], parents, depth - 1)
        slot.update({p: base + j for j, p in enumerate(fed)})
    out = []
    for row, row_scores, own in zip(tokens.tolist(), scores.tolist(), trees):
        token_ids = [row[index[p]] for p in own]
        out.append((token_ids, list(DraftTree.from_paths(own, token_ids).parents), [row_scores[index[p]] for p in own]))
    return out
