"""`extract_hidden_states`: no drafting; every request returns the target's hidden states of
the configured layers (training data for drafter heads), as vLLM's method of that name.

Config (vLLM's, https://github.com/vllm-project/vllm/blob/c314af1abfddff7b6cce9af578be72c496c6a5e4/vllm/v1/spec_decode/extract_hidden_states.py): `num_speculative_tokens` 1 (or absent) and
the layer ids in `draft_model_config: {"hf_config": {"eagle_aux_hidden_state_layer_ids":
[...]}}` (or top-level `eagle_aux_hidden_state_layer_ids`); `model` may be omitted.

Layer ids use the verifier's numbering (backends/serving/target.py): id i is the residual stream
entering decoder layer i = Hugging Face's `output_hidden_states[i]` (0 = the embedding
output), and id L (the number of layers) is HF's last entry, the final hidden state after
the final norm (vLLM saves the un-normalized one there).

The data path: the drafter answers its first call with these layer ids and k = 0 (it never
drafts); the orchestrator then runs plain decoding, asking the verifier for those layers on
every step, and yields each step's rows; the `speculative` model returns them all with the
final response as `hidden_states` (FP32 [tokens, layers, hidden]) and `hidden_layer_ids`,
and, when its `hidden_states_dir` parameter is set, writes them to
`<hidden_states_dir>/<request>.safetensors` (`save_hidden_states`), naming the file in
`hidden_states_file`.

Which positions: row t is the target's state at position t of prompt + output, for
t = 0 .. len(prompt) + len(output) - 2, i.e. every token that went through the target (the
state at t is the one that predicted token t+1); the last output token never went through
it. A request with `num_draft_tokens: 0` skips the drafter, so it returns no hidden states.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from backends.config import DrafterConfig
from backends.methods.head_checkpoint import TargetInfo
from backends.serving.proposer import Draft, DraftRequest, Proposer, ProposerContext


class ExtractHiddenStatesProposer(Proposer):
    method = "extract_hidden_states"
    proposes_drafts = False

    def __init__(self, layer_ids: list[int], num_layers: int) -> None:
        if (
            not layer_ids
            or len(set(layer_ids)) != len(layer_ids)
            or not all(isinstance(i, int) and 0 <= i <= num_layers for i in layer_ids)
        ):
            raise ValueError(
                f"eagle_aux_hidden_state_layer_ids {layer_ids} must be distinct layer ids in "
                f"[0, {num_layers}] (i = the input of decoder layer i, {num_layers} = the final "
                "normed state)"
            )
        self.hidden_layer_ids = tuple(layer_ids)

    @classmethod
    def from_config(cls, config: DrafterConfig, ctx: ProposerContext) -> ExtractHiddenStatesProposer:
        # The config accepts missing ids, as vLLM's does; like vLLM, building refuses them.
        if not config.eagle_aux_hidden_state_layer_ids:
            raise ValueError(
                "eagle_aux_hidden_state_layer_ids must be set in the draft model config for "
                "extract_hidden_states method"
            )
        if ctx.target_model is None:
            raise ValueError("extract_hidden_states needs the target model (its number of layers)")
        return cls(list(config.eagle_aux_hidden_state_layer_ids), TargetInfo.load(ctx.target_model).num_layers)

    @classmethod
    def layers_for(cls, config: Any, target_model: Any = None) -> tuple[int, ...]:
        return tuple(config.eagle_aux_hidden_state_layer_ids or ())

    def propose(self, batch: list[DraftRequest]) -> list[Draft]:
        return [Draft() for _ in batch]


def save_hidden_states(
    path: Path, hidden_states: torch.Tensor, token_ids: list[int], layer_ids: tuple[int, ...], num_prompt_tokens: int
) -> Path:
    """One request's safetensors file: `hidden_states` FP32 [T, layers, H] (row t = position
    t), `token_ids` int64 [T + 1] (prompt + output), `layer_ids` int64 [layers]; the prompt
    length in the metadata. Written to `path`, or to `<stem>-N<suffix>` when that exists
    (another run's or replica's file is never overwritten); returns the path written."""
    from safetensors.torch import save

    data = save(
        {
            "hidden_states": hidden_states.float().contiguous(),
            "token_ids": torch.tensor(token_ids, dtype=torch.int64),
            "layer_ids": torch.tensor(layer_ids, dtype=torch.int64),
        },
        metadata={"num_prompt_tokens": str(num_prompt_tokens)},
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count():
        candidate = path if n == 0 else path.with_name(f"{path.stem}-{n}{path.suffix}")
        try:
            with open(candidate, "xb") as f:  # exclusive: fails instead of overwriting
                f.write(data)
            return candidate
        except FileExistsError:
            continue
