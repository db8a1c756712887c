"""DSpark: semi-autoregressive block drafting (DeepSeek's DeepSpec; vLLM's `dspark`).

The backbone is DFlash's (backends/methods/dflash.py: one non-causal forward of the block
[anchor, MASK, ...] over the context made from the target's hidden states). On top, a cheap
sequential stage restores the dependency between the block's drafts: a low-rank Markov
head adds to each slot's logits a bias from the previous token (DeepSpec's
deepspec/modeling/dspark/markov_head.py, https://github.com/deepseek-ai/DeepSpec; vLLM's
https://github.com/vllm-project/vllm/blob/c314af1abfddff7b6cce9af578be72c496c6a5e4/vllm/model_executor/models/qwen3_dspark.py):

    vanilla: logits_i = base_i + markov_w2(markov_w1[prev])
    gated:   logits_i = base_i + markov_w2(sigmoid(gate_proj([h_i; w1[prev]])) * w1[prev])
    rnn:     s_i, out = GRU-like step of joint_proj([s_{i-1}; w1[prev]; h_i])  (s_0 = 0)
             logits_i = base_i + markov_w2(tanh(out))
    prev starts at the anchor and is then each draft just chosen (sampled or argmax);
    h_i is slot i's normed backbone output. markov_rank 0: no Markov head.

Slot conventions (which block slot predicts which position); mixing them up gives an
acceptance length near 1 without any error, so the loader decides from the config and
refuses to guess:
- anchor (DeepSpec, `sample_from_anchor: true`): every slot i = 0..B-1 predicts the token
  after it, at position p+i+1: B drafts per pass. DeepSpec's Qwen3DSparkModel exports.
- fill-in (speculators, `sample_from_anchor: false`): slot j = 1..B-1 predicts position p+j
  (DFlash's layout; slot 0 is not trained): B-1 drafts. Speculators-format checkpoints
  (`speculators_model_type: dspark`) are this one.
`sample_from_anchor` (top level or in dflash_config, e.g. through `hf_overrides`) decides;
without it, only the Qwen3DSparkModel architecture implies the anchor convention. Anything
else (a DFlashDraftModel with projector_type "dspark", whose `shift_label` is not a
documented switch) is refused, naming the field to set.

Checkpoint (DeepSpec's build_draft_config and save_pretrained): DeepSpec's config.json has block_size, mask_token_id,
target_layer_ids (layer outputs, 0-based: verifier id = id + 1; -1 = the embedding output,
verifier id 0), markov_rank, markov_head_type, enable_confidence_head,
confidence_head_with_markov at the top level (the speculators-trained variant has them in
dflash_config); the state dict is DFlash's plus `embed_tokens` / `lm_head` (frozen copies
of the target's, borrowed when absent), `markov_head.*` and `confidence_head.proj.*`. The
confidence head is loaded and checked but not used to cut drafts (as in vLLM). DeepSeek-V4
drafters bundled in the target checkpoint are refused.

Drafts per pass: the convention's count, at most k (the block always runs at its trained
size; the sequential stage stops after k). vLLM requires k >= dspark_block_size for the
V4 drafter (backends/config/ checks it); here k only caps the drafts.

`draft_sample_method`: greedy (argmax, one-hot in rejection) or probabilistic (each draft
sampled from its Markov-corrected softmax at the request's temperature, which then
conditions the next draft's bias; the probabilities travel to the verifier, so sampled
decoding stays lossless).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch
from torch import nn

from backends.methods.block_checkpoint import BlockCheckpointError, config_field
from backends.methods.block_checkpoint import default_config as dflash_default_config
from backends.methods.dflash import BlockWork, DFlashHead, DFlashProposer
from backends.methods.drafts import gather_drafts
from backends.methods.head_checkpoint import TargetInfo
from backends.runtime import linear_kernels
from backends.runtime.lean_lm import KernelLinear
from backends.serving.request import is_greedy

MARKOV_HEADS = ("vanilla", "gated", "rnn")


def sample_from_anchor(cfg: dict[str, Any], where: str) -> bool:
    """Which slot convention a DSpark config.json uses (see the module docstring)."""
    given = {cfg.get("sample_from_anchor"), (cfg.get("dflash_config") or {}).get("sample_from_anchor")} - {None}
    if len(given) > 1:
        raise BlockCheckpointError(f"{where}: sample_from_anchor is both true and false (top level and dflash_config)")
    if given:
        value = given.pop()
        if not isinstance(value, bool):
            raise BlockCheckpointError(f"{where}: sample_from_anchor={value!r}; expected true or false")
        return value
    if "Qwen3DSparkModel" in (cfg.get("architectures") or []):
        return True  # DeepSpec's export: vLLM's default for dense HF checkpoints
    raise BlockCheckpointError(
        f"{where}: cannot tell which slot convention this DSpark checkpoint was trained with (no "
        "sample_from_anchor, architectures not Qwen3DSparkModel); set hf_overrides "
        '{"sample_from_anchor": true} if slot i predicts the token after it (DeepSpec), false if slot j '
        "fills position anchor+j (speculators)"
    )


class _MarkovHead(nn.Module):
    def __init__(self, kind: str, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def forward(
        self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logit bias [B, V_d] for previous target ids `prev` [B] and slot states `hidden`
        [B, H]; `state` is the rnn head's recurrent state (None before the first slot)."""
        embedded = self.markov_w1(prev)
        if self.kind == "vanilla":
            return self.markov_w2(embedded), None
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, embedded], dim=-1)))
            return self.markov_w2(gate * embedded), None
        if state is None:
            state = embedded.new_zeros(len(prev), self.rank)
        gate, candidate, out = self.joint_proj(torch.cat([state, embedded, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(out)), state


class _ConfidenceHead(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)


class DSparkHead(DFlashHead):
    layout = "dspark"
    borrows = ("embed_tokens.weight", "lm_head.weight")
    omitted_on_save = ()  # DeepSpec's save_pretrained writes the frozen copies too

    def __init__(self, cfg: dict[str, Any], target: TargetInfo, where: str = "DSpark head") -> None:
        super().__init__(cfg, target, where)
        self.omitted_on_save = ()
        self.sample_from_anchor = sample_from_anchor(cfg, where)
        h = cfg["hidden_size"]
        rank = config_field(cfg, "markov_rank") or 0
        kind = config_field(cfg, "markov_head_type") or "vanilla"
        if not isinstance(rank, int) or rank < 0:
            raise BlockCheckpointError(f"{where}: markov_rank={rank!r}; expected an integer >= 0")
        if kind not in MARKOV_HEADS:
            raise BlockCheckpointError(f"{where}: markov_head_type={kind!r} is not one of {MARKOV_HEADS}")
        self.markov_head = _MarkovHead(kind, target.vocab_size, self.spec.draft_vocab_size, rank, h) if rank else None
        self.confidence_head = None
        if config_field(cfg, "enable_confidence_head", "use_confidence_head"):
            with_markov = bool(config_field(cfg, "confidence_head_with_markov"))
            if with_markov and not rank:
                raise BlockCheckpointError(
                    f"{where}: confidence_head_with_markov needs a Markov head (markov_rank > 0)"
                )
            self.confidence_head = _ConfidenceHead(h + (rank if with_markov else 0))

    @property
    def draft_slots(self) -> range:
        return range(0 if self.sample_from_anchor else 1, self.spec.block_size)

    def defaults(self) -> dict[str, torch.Tensor]:
        # Some exports write the confidence projection without its bias.
        return {"confidence_head.proj.bias": torch.zeros(1)} if self.confidence_head is not None else {}

    def step_logits(
        self, base: torch.Tensor, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One sequential step: slot logits `base` [B, V_d] plus the Markov bias for the
        previous tokens `prev` [B]; float32."""
        if self.markov_head is None:
            return base, None
        bias, state = self.markov_head(prev, hidden, state)
        return base + bias.float(), state


class DSparkProposer(DFlashProposer):
    method = "dspark"
    head_class = DSparkHead

    def _draft(self, hidden: torch.Tensor, work: list[BlockWork]) -> None:
        """The block's base logits at once, then the Markov chain slot by slot (greedy with a
        vanilla head: the whole chain in one C call); the drafts cross to the host once."""
        steps = max(w.num_drafts for w in work)
        slots = list(self.head.draft_slots)[:steps]
        base = self.head.logits(hidden[:, slots]).float()
        temperatures, generators = [w.temperature for w in work], [w.generator for w in work]
        anchors = torch.tensor([w.anchor for w in work], device=self.device)
        sampled = self._greedy_chain(base, anchors, temperatures)
        if sampled is None:
            prev, state, sampled = anchors, None, []
            for i, slot in enumerate(slots):
                logits, state = self.head.step_logits(base[:, i], prev, hidden[:, slot], state)
                prev, probs = self.sample(logits, temperatures, generators)
                sampled.append((prev, probs))
        for w, drafted, probs in zip(work, *gather_drafts(sampled, [w.num_drafts for w in work])):
            w.drafts, w.probs = drafted, probs

    def _greedy_chain(
        self, base: torch.Tensor, anchors: torch.Tensor, temperatures: list[float]
    ) -> list[tuple[torch.Tensor, None]] | None:
        """Every step's greedy drafts of a vanilla Markov head from `base` [B, steps, V_d] in one
        call (`linear_kernels.markov_greedy`: a draft of ~0.1 ms of small torch calls per step, cold,
        is one pass over the 64 x V_d weight), the bits of the step-by-step chain; None where it
        does not apply (sampled drafts, another head, not the packed kernel, a NaN)."""
        if self._markov_weights is None or not (
            self.sample_method == "greedy" or all(is_greedy(t) for t in temperatures)
        ):
            return None
        w1, w2 = self._markov_weights
        ids = linear_kernels.markov_greedy(base, w1, w2, self.head.draft_to_target, anchors)
        return None if ids is None else [(ids[:, i], None) for i in range(ids.shape[1])]

    @cached_property
    def _markov_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A vanilla Markov head's w1 and packed w2, where its w2 runs on the packed bf16 kernel
        (looked at on first use: `from_config` may turn it int8 after construction)."""
        markov = self.head.markov_head
        if markov is None or markov.kind != "vanilla":
            return None
        w2 = markov.markov_w2
        if type(w2) is not KernelLinear or w2.int8 or w2.weight.dtype != torch.bfloat16:
            return None
        return markov.markov_w1.weight.detach().contiguous(), linear_kernels.pack_linear(w2.weight.detach())


def default_config(
    target: TargetInfo,
    *,
    block_size: int = 7,
    markov_rank: int = 64,
    markov_head_type: str = "vanilla",
    confidence_head: bool = True,
    **backbone: Any,
) -> dict[str, Any]:
    """A DeepSpec Qwen3DSparkModel config.json for a new head on `target`: DFlash's backbone
    (`backbone`: dflash.default_config's mask_token_id, num_hidden_layers, target_layer_ids)
    and the Markov head."""
    cfg = dflash_default_config(target, block_size=block_size, **backbone)
    dflash = cfg.pop("dflash_config")
    cfg.pop("auto_map", None)
    return {
        **cfg,
        "architectures": ["Qwen3DSparkModel"],
        "mask_token_id": dflash["mask_token_id"],
        "target_layer_ids": dflash["target_layer_ids"],
        "markov_rank": markov_rank,
        "markov_head_type": markov_head_type,
        "enable_confidence_head": confidence_head,
        "confidence_head_with_markov": confidence_head and markov_rank > 0,
        "num_anchors": 512,
    }
