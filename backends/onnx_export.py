"""ONNX export of drafter heads (`tritonspec export-onnx`), so a head can be served by
Triton's onnxruntime backend on hosts that have it, and a check of the exported graph
against the torch head with onnxruntime on CPU.

Each method contributes one builder in `_BUILDERS` ("module:function"): it loads the head
from its checkpoint (through the method's own loader, so a bad checkpoint is refused the
same way) and wraps one draft step as a plain module with named inputs and outputs
(`OnnxStep`). Adding a head type is one builder and one entry.

EAGLE / EAGLE-3 step (no KV cache: one causal forward over T + S pairs):
  inputs   input_ids [B, T] int64 and hidden_states [B, T, layers, H_t] float32: the pairs
           made from target states (layers in the head's `hidden_layer_ids` order; 1 for
           eagle), at position_ids [B, T] int64;
           draft_ids [B, S] int64 and draft_hidden [B, S, H] float32: the pairs made from the
           head's own earlier outputs (S = 0 for the first draft), at the S positions after
           the last of position_ids
  outputs  logits [B, T+S, V] float32 over the *target* vocabulary (EAGLE-3's draft vocabulary
           is mapped through d2t; target ids outside it get -inf, i.e. probability 0, as the
           proposer treats them), hidden [B, T+S, H] (what the next step takes as draft_hidden)
The one-token shift is the caller's, as in backends/methods/eagle.py: the pair at position t is
(x_{t+1}, h_t); k drafts = k steps, each appending the last draft and its hidden state.

Medusa / MLP speculator step (heads on the target's last hidden state; backends/methods/last_hidden.py):
  inputs   hidden_states [B, H_t] float32: the target's final normed state at t,
           token_ids [B, K] int64: the token each of the K = num_steps stages reads
           (x_{t+1}, then drafts 1..K-1; Medusa's heads ignore them)
  outputs  logits [B, K, V] float32 over the target vocabulary (a truncated Medusa vocabulary
           is mapped through token_map, -inf elsewhere)
Stage i depends on token_ids[:, :i+1] only: Medusa drafts all K at once, an MLP speculator
drafts greedily in K calls, each filling in the draft just made.
"""

from __future__ import annotations

import importlib
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

OPSET = 18  # what the exporter emits natively; Triton 24.10's onnxruntime (1.19) runs up to 21


class OnnxExportError(ValueError):
    """The method has no exporter, or the exported graph does not match the torch head."""


@dataclass
class OnnxStep:
    """One draft step of a head: `module(*example_inputs.values())` returns the outputs in
    the order of `outputs`; `dynamic_axes` names the input axes that vary (batch, tokens)."""

    module: nn.Module
    example_inputs: dict[str, torch.Tensor]
    outputs: tuple[str, ...]
    dynamic_axes: dict[str, dict[int, str]]
    metadata: dict[str, str] = field(default_factory=dict)
    # Fresh inputs for a shape tuple (its meaning is the builder's), and the shapes to check
    # the graph at: others than the export's.
    make_inputs: Callable[..., dict[str, torch.Tensor]] | None = None
    check_shapes: tuple[tuple[int, ...], ...] = ()


_BUILDERS: dict[str, str] = {
    "eagle": "backends.onnx_export:eagle_step",
    "eagle3": "backends.onnx_export:eagle_step",
    "medusa": "backends.onnx_export:medusa_step",
    "mlp_speculator": "backends.onnx_export:mlp_speculator_step",
}


def exportable_methods() -> list[str]:
    return sorted(_BUILDERS)


def build_step(method: str, checkpoint: Path | str, target: Path | str) -> OnnxStep:
    """The draft step of `method`'s head in `checkpoint`, drafting for `target`."""
    if method not in _BUILDERS:
        raise OnnxExportError(f"method {method!r} has no ONNX exporter; available: {', '.join(exportable_methods())}")
    module_name, _, func = _BUILDERS[method].partition(":")
    return getattr(importlib.import_module(module_name), func)(method, Path(checkpoint), Path(target))


# ---------------------------------------------------------------------------- EAGLE


class _TargetVocab(nn.Module):
    """Draft-vocabulary logits [..., V_d] -> target-vocabulary logits [..., V] (-inf for target
    ids outside the draft vocabulary); the identity when the vocabularies are one."""

    def __init__(self, draft_to_target: torch.Tensor | None, vocab_size: int) -> None:
        super().__init__()
        self.identity = draft_to_target is None
        if not self.identity:
            ids = draft_to_target.long().cpu()
            index = torch.zeros(vocab_size, dtype=torch.long).index_copy_(0, ids, torch.arange(len(ids)))
            present = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
            self.register_buffer("target_to_draft", index, persistent=False)
            self.register_buffer("in_draft_vocab", present, persistent=False)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        if self.identity:
            return logits
        return torch.where(
            self.in_draft_vocab, logits[..., self.target_to_draft], torch.full_like(logits[..., :1], float("-inf"))
        )


class _EagleStep(nn.Module):
    def __init__(self, head, vocab_size: int) -> None:
        super().__init__()
        self.head = head
        self.vocab = _TargetVocab(head.draft_to_target, vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        draft_ids: torch.Tensor,
        draft_hidden: torch.Tensor,
    ):
        batch, tokens = input_ids.shape
        features = self.head.features(hidden_states.flatten(0, 1)).unflatten(0, (batch, tokens))
        drafted = torch.arange(1, draft_ids.shape[1] + 1, device=input_ids.device)
        ids = torch.cat([input_ids, draft_ids], dim=1)
        features = torch.cat([features, draft_hidden], dim=1)
        positions = torch.cat([position_ids, position_ids[:, -1:] + drafted], dim=1)
        steps = torch.arange(ids.shape[1], device=input_ids.device)
        mask = (steps[None, :] <= steps[:, None])[None, None]  # broadcast over the batch
        hidden = self.head(ids, features, positions, mask, None)
        return self.vocab(self.head.logits(hidden)), hidden


def eagle_step(method: str, checkpoint: Path, target: Path) -> OnnxStep:
    from backends.methods.eagle_head import load_eagle
    from backends.methods.head_checkpoint import TargetInfo

    info = TargetInfo.load(target)
    head = load_eagle(checkpoint, info, "float32", method)
    layers, width, size = len(head.hidden_layer_ids), info.hidden_size, head.config.hidden_size

    def make_inputs(batch: int, tokens: int, drafted: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.randint(0, info.vocab_size, (batch, tokens), generator=gen),
            "hidden_states": torch.randn(batch, tokens, layers, width, generator=gen),
            "position_ids": torch.arange(tokens).repeat(batch, 1) + torch.randint(0, 8, (batch, 1), generator=gen),
            "draft_ids": torch.randint(0, info.vocab_size, (batch, drafted), generator=gen),
            "draft_hidden": torch.randn(batch, drafted, size, generator=gen),
        }

    pairs, drafts = {0: "batch", 1: "tokens"}, {0: "batch", 1: "drafted"}
    return OnnxStep(
        module=_EagleStep(head, info.vocab_size).eval(),
        example_inputs=make_inputs(2, 5, 3, torch.Generator().manual_seed(0)),
        outputs=("logits", "hidden"),
        dynamic_axes={
            "input_ids": pairs,
            "hidden_states": pairs,
            "position_ids": pairs,
            "draft_ids": drafts,
            "draft_hidden": drafts,
        },
        metadata={
            "method": method,
            "hidden_layer_ids": json.dumps(list(head.hidden_layer_ids)),
            "target_vocab_size": str(info.vocab_size),
            "hidden_size": str(head.config.hidden_size),
        },
        make_inputs=make_inputs,
        check_shapes=((1, 1, 0), (3, 7, 0), (2, 4, 1), (1, 6, 5)),  # (batch, tokens, drafted)
    )


# ---------------------------------------------------------------------------- last-hidden heads


class _LastHiddenStep(nn.Module):
    """All K stages of a begin/step head, each reading its token from token_ids."""

    def __init__(self, head, vocab_size: int) -> None:
        super().__init__()
        self.head = head
        self.vocab = _TargetVocab(head.draft_to_target, vocab_size)

    def forward(self, hidden_states: torch.Tensor, token_ids: torch.Tensor):
        state, logits = self.head.begin(hidden_states), []
        for i in range(self.head.num_steps):
            out, state = self.head.step(i, state, token_ids[:, i])
            logits.append(out)
        return (self.vocab(torch.stack(logits, dim=1)),)


def _last_hidden_step(method: str, head, info) -> OnnxStep:
    steps = head.num_steps

    def make_inputs(batch: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
        return {
            "hidden_states": torch.randn(batch, info.hidden_size, generator=gen),
            "token_ids": torch.randint(0, info.vocab_size, (batch, steps), generator=gen),
        }

    return OnnxStep(
        module=_LastHiddenStep(head, info.vocab_size).eval(),
        example_inputs=make_inputs(2, torch.Generator().manual_seed(0)),
        outputs=("logits",),
        dynamic_axes={"hidden_states": {0: "batch"}, "token_ids": {0: "batch"}},
        metadata={
            "method": method,
            "num_steps": str(steps),
            "hidden_layer_ids": json.dumps([-1]),
            "target_vocab_size": str(info.vocab_size),
        },
        make_inputs=make_inputs,
        check_shapes=((1,), (5,)),  # (batch,)
    )


def medusa_step(method: str, checkpoint: Path, target: Path) -> OnnxStep:
    from backends.methods.head_checkpoint import TargetInfo
    from backends.methods.medusa import load_medusa

    info = TargetInfo.load(target)
    return _last_hidden_step(method, load_medusa(checkpoint, info, "float32"), info)


def mlp_speculator_step(method: str, checkpoint: Path, target: Path) -> OnnxStep:
    from backends.methods.head_checkpoint import TargetInfo
    from backends.methods.mlp_speculator import load_mlp_speculator

    info = TargetInfo.load(target)
    return _last_hidden_step(method, load_mlp_speculator(checkpoint, info, "float32"), info)


# ---------------------------------------------------------------------------- export + check


def export_step(step: OnnxStep, out: Path | str) -> Path:
    """Write the step as one self-contained ONNX file (weights inside), metadata attached."""
    import onnx

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    dims: dict[str, torch.export.Dim] = {}
    shapes = {
        name: {axis: dims.setdefault(label, torch.export.Dim(label)) for axis, label in axes.items()}
        for name, axes in step.dynamic_axes.items()
    }
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on axis names and deprecations
        torch.onnx.export(
            step.module,
            tuple(step.example_inputs.values()),
            str(out),
            dynamo=True,
            external_data=False,
            input_names=list(step.example_inputs),
            output_names=list(step.outputs),
            dynamic_shapes=shapes,
            opset_version=OPSET,
            verbose=False,
        )
    model = onnx.load(str(out))
    for key, value in step.metadata.items():
        model.metadata_props.add(key=key, value=value)
    onnx.checker.check_model(model)
    onnx.save(model, str(out))
    return out


def check_step(
    step: OnnxStep,
    path: Path | str,
    shapes: tuple[tuple[int, ...], ...] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-4,
    seed: int = 0,
) -> float:
    """Run the ONNX file with onnxruntime (CPU) and the torch step on fresh inputs of other
    shapes than the export's (default: the step's check_shapes); the largest absolute
    difference, or OnnxExportError naming the output that differs beyond tolerance."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for shape in shapes or step.check_shapes:
        inputs = step.make_inputs(*shape, gen)
        with torch.inference_mode():
            expected = [t.numpy() for t in step.module(*inputs.values())]
        got = session.run(list(step.outputs), {k: v.numpy() for k, v in inputs.items()})
        for name, want, have in zip(step.outputs, expected, got):
            if want.shape != have.shape:
                raise OnnxExportError(
                    f"{path}: output {name!r} has shape {list(have.shape)} at input shape "
                    f"{shape}; the torch head gives {list(want.shape)}"
                )
            finite = np.isfinite(want)
            if not np.array_equal(finite, np.isfinite(have)) or not np.array_equal(want[~finite], have[~finite]):
                raise OnnxExportError(
                    f"{path}: output {name!r} has infinities where the torch head has none (or the reverse)"
                )
            diff = float(np.abs(want[finite] - have[finite]).max(initial=0.0))
            if not np.allclose(want[finite], have[finite], rtol=rtol, atol=atol):
                raise OnnxExportError(
                    f"{path}: output {name!r} differs from the torch head by up to {diff:.3g} "
                    f"at input shape {shape} (tolerance rtol={rtol}, atol={atol})"
                )
            worst = max(worst, diff)
    return worst


_TRITON_TYPES = {1: "TYPE_FP32", 7: "TYPE_INT64", 10: "TYPE_FP16", 16: "TYPE_BF16"}


def triton_config(name: str, onnx_path: Path | str) -> str:
    """A config.pbtxt for Triton's onnxruntime backend serving this file (no batching by
    Triton: the batch is the graph's own first axis; no instance_group, so Triton puts it on
    the GPUs when there are any, else on the CPU)."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph

    def tensors(values) -> str:
        rows = []
        for v in values:
            dims = ", ".join(
                str(d.dim_value) if d.HasField("dim_value") else "-1" for d in v.type.tensor_type.shape.dim
            )
            rows.append(
                f'  {{ name: "{v.name}" data_type: {_TRITON_TYPES[v.type.tensor_type.elem_type]} dims: [ {dims} ] }}'
            )
        return ",\n".join(rows)

    return (
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
        f"input [\n{tensors(graph.input)}\n]\noutput [\n{tensors(graph.output)}\n]\n"
    )


def export_head(
    method: str, checkpoint: Path | str, target: Path | str, out_dir: Path | str, check: bool = True
) -> tuple[Path, float | None]:
    """Export `method`'s head as a Triton model directory (`out_dir/1/model.onnx` +
    `out_dir/config.pbtxt`) and, by default, check it against the torch head; the ONNX file
    and the largest difference found."""
    out_dir = Path(out_dir)
    step = build_step(method, checkpoint, target)
    path = export_step(step, out_dir / "1" / "model.onnx")
    (out_dir / "config.pbtxt").write_text(triton_config(out_dir.name, path))
    return path, check_step(step, path) if check else None
