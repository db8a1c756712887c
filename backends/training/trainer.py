"""`tritonspec train METHOD --target MODEL --out DIR`: train a drafter head on CPU.

One loop for every method; what differs per method lives in a `HeadTrainer` (registered by
name in `TRAINERS`, like proposers): which target layers it reads, how the head starts, its
loss, and how it is written in the method's published checkpoint layout (so the result also
loads in vLLM).

Resumable: every `save_every` steps the head, the optimizer and the step go to
`OUT/train_state.pt`; a rerun with the same arguments continues from there (the batch order
is a function of the seed, so it picks up exactly where it stopped). The target's answers and
hidden states are cached separately (`data.py`) and shared by all methods.

Validation: every `1/held_out`-th sequence is never trained on. After each epoch the report
gives, per draft step, the head's top-1 agreement with the target there and the estimated
mean acceptance length of a chain of that many drafts (1 + sum of the running products).
The benchmark prompts (`tritonspec bench`) are a second, independent held-out set.
"""

from __future__ import annotations

import importlib
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from backends.methods.head_checkpoint import TargetInfo
from backends.training import TOKEN_MAP_FILE, TRAINERS
from backends.training.data import TrainingData, prepare


@dataclass
class Batch:
    """Windows of training sequences, right-padded to one length T."""

    token_ids: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T] the target's greedy token after each position
    hidden: torch.Tensor  # [B, T, layers, H] float32, layers in the trainer's layer_ids order
    positions: torch.Tensor  # [B, T] absolute positions (rotary)
    valid: torch.Tensor  # [B, T] bool


@dataclass
class StepMetrics:
    loss: torch.Tensor
    correct: list[int]  # per draft step: positions where the head's top-1 = the target's
    counted: list[int]


# The trainers' draft vocabulary (eagle3, medusa, dflash, dspark) and token map (eagle, mtp,
# mlp_speculator) size unless --draft-vocab-size says otherwise.
DRAFT_VOCAB_SIZE = 8192


def draft_vocabulary(
    data: TrainingData, target: TargetInfo, options: dict[str, Any], method: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft vocabulary: the `options["draft_vocab_size"]` (default DRAFT_VOCAB_SIZE) tokens
    the target emits most often (target ids, in order), and each target id's draft id (-1: not
    in it)."""
    size = min(int(options.get("draft_vocab_size", DRAFT_VOCAB_SIZE)), target.vocab_size)
    counts = torch.bincount(data.labels, minlength=target.vocab_size)
    keep = counts.topk(size).indices.sort().values
    coverage = counts[keep].sum().item() / max(counts.sum().item(), 1)
    print(f"{method} draft vocabulary: {size} tokens cover {coverage:.1%} of the target's training tokens")
    target_to_draft = torch.full((target.vocab_size,), -1, dtype=torch.long)
    target_to_draft[keep] = torch.arange(size)
    return keep, target_to_draft


class HeadTrainer:
    """One method's head: what it reads, how it starts, what it learns, how it is saved."""

    method: str
    num_steps = 3  # draft steps trained unless asked otherwise: the k the head is served with
    # True: the head drafts over the target's whole vocabulary, and a token map to cut its LM
    # head to is written beside it (eagle, mtp, mlp_speculator; the others have a draft vocabulary).
    writes_token_map = False

    def layer_ids(self, target: TargetInfo) -> tuple[int, ...]:
        raise NotImplementedError

    def build(self, target: TargetInfo, data: TrainingData, options: dict[str, Any]) -> nn.Module:
        raise NotImplementedError

    def loss(self, head: nn.Module, batch: Batch, num_steps: int) -> StepMetrics:
        raise NotImplementedError

    def save(self, head: nn.Module, out: Path) -> None:
        raise NotImplementedError


def head_trainer(method: str) -> HeadTrainer:
    if method not in TRAINERS:
        raise ValueError(f"no trainer for method {method!r}; trainable: {', '.join(sorted(TRAINERS))}")
    module, _, name = TRAINERS[method].partition(":")
    return getattr(importlib.import_module(module), name)()


def windows(data: TrainingData, sequences: list[int], length: int) -> list[tuple[int, int]]:
    """(start, end) spans of at most `length` positions covering each sequence; consecutive
    windows overlap by one position so every (position, next position) pair is seen."""
    spans = []
    for i in sequences:
        s = data.sequence(i)
        for start in range(s.start, max(s.stop - 1, s.start + 1), length - 1):
            spans.append((start, min(start + length, s.stop)))
    return spans


def grouped_by_length(
    spans: list[tuple[int, int]], per_batch: int, rng: random.Random, batches: int = 50
) -> list[tuple[int, int]]:
    """Shuffled windows regrouped so that each optimizer step's windows have similar lengths:
    every `batches` steps' worth sorted by length into steps, those steps then in random order
    (transformers' LengthGroupedSampler, without its long-to-short sweep). A batch is padded to
    its longest window; on SmolLM2's answers random batches of 4 were 1.4x their real
    positions, grouped ones 1.05x."""
    size, out = per_batch * batches, []
    for i in range(0, len(spans), size):
        group = sorted(spans[i : i + size], key=lambda s: s[0] - s[1])
        steps = [group[j : j + per_batch] for j in range(0, len(group), per_batch)]
        rng.shuffle(steps)
        out += [s for step in steps for s in step]
    return out


def make_batch(data: TrainingData, spans: list[tuple[int, int]], layer_ids: tuple[int, ...]) -> Batch:
    width = max(end - start for start, end in spans)
    starts = [int(torch.searchsorted(data.offsets, start, right=True)) - 1 for start, _ in spans]

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.stack([nn.functional.pad(t[a:b], (0, 0) * (t.dim() - 1) + (0, width - (b - a))) for a, b in spans])

    hidden = torch.stack([pad(data.hidden[i]) for i in layer_ids], dim=2).float()
    positions = torch.stack([torch.arange(a, a + width) - data.offsets[s] for (a, _), s in zip(spans, starts)])
    valid = torch.stack([torch.arange(width) < b - a for a, b in spans])
    return Batch(pad(data.token_ids), pad(data.labels), hidden, positions, valid)


def train(
    method: str,
    target: Path,
    out: Path,
    *,
    data_dir: Path,
    epochs: int = 2,
    lr: float = 1e-3,
    batch_tokens: int = 1024,
    window: int = 256,
    num_steps: int | None = None,
    num_prompts: int | None = None,
    max_new_tokens: int = 128,
    held_out: float = 0.05,
    save_every: int = 20,
    seed: int = 0,
    options: dict | None = None,
    prompts: list[str] | None = None,
    self_prompts: int = 0,
    dtype: str = "bfloat16",
    group_by_length: bool = True,
) -> dict:
    """Train `method`'s head for `target` on its answers to `prompts` (default: the built-in
    training prompts) and to `self_prompts` requests it writes itself; write it to `out` in
    the published layout and return the report (also written as `out/training_report.json`)."""
    trainer, info = head_trainer(method), TargetInfo.load(target)
    num_steps = num_steps or trainer.num_steps
    layer_ids = trainer.layer_ids(info)
    data = prepare(
        target,
        data_dir,
        layer_ids,
        num_prompts,
        max_new_tokens,
        prompts=prompts,
        self_prompts=self_prompts,
        dtype=dtype,
    )
    train_seqs, val_seqs = data.split(held_out)
    torch.manual_seed(seed)
    head = trainer.build(info, data, {"num_steps": num_steps, **(options or {})})
    per_batch = max(1, batch_tokens // window)
    spans = windows(data, train_seqs, window)
    run = _Run(
        trainer, head, data, layer_ids, spans, val_seqs, window, per_batch, num_steps, seed, epochs, group_by_length
    )
    optimization = _Optimization.for_head(head, lr, run.total)
    out.mkdir(parents=True, exist_ok=True)
    _write_validation_prompts(data_dir, out, val_seqs)
    settings = _settings(run, method, lr, batch_tokens, options)
    checkpoint = _Checkpoint(out / "train_state.pt", settings, save_every)
    step, history = checkpoint.resume_or_start(head, optimization, method, run.total)
    started = time.monotonic()
    _train_steps(run, optimization, checkpoint, step, history, method)
    trainer.save(head, out)
    if trainer.writes_token_map:
        _write_token_map(data, info, out, method, options)
    report = _report(settings, target, run, len(train_seqs), time.monotonic() - started, history)
    (out / "training_report.json").write_text(json.dumps(report, indent=2))
    return report


def _write_token_map(data: TrainingData, target: TargetInfo, out: Path, method: str, options: dict | None) -> None:
    """Beside a head that drafts over the target's vocabulary, a token map to cut its LM head
    to (speculative_token_map): the most frequent tokens of its training answers."""
    keep, _ = draft_vocabulary(data, target, options or {}, method)
    (out / TOKEN_MAP_FILE).write_text(json.dumps(keep.tolist()))


@dataclass
class _Run:
    """One training run's fixed parts: the head, its data, the windows and their order."""

    trainer: HeadTrainer
    head: nn.Module
    data: TrainingData
    layer_ids: tuple[int, ...]
    spans: list[tuple[int, int]]  # the training windows
    val_seqs: list[int]
    window: int
    per_batch: int  # windows per optimizer step
    num_steps: int  # draft steps trained
    seed: int
    epochs: int
    group_by_length: bool  # a step's windows of similar lengths (grouped_by_length)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.spans) / self.per_batch)

    @property
    def total(self) -> int:
        return self.epochs * self.steps_per_epoch

    def batch(self, step: int) -> Batch:
        """Optimizer step `step`'s windows: each epoch's order is a function of the seed, so a
        resumed run picks up exactly where it stopped."""
        epoch, index = divmod(step, self.steps_per_epoch)
        order, rng = list(self.spans), random.Random(self.seed + epoch)
        rng.shuffle(order)
        if self.group_by_length:
            order = grouped_by_length(order, self.per_batch, rng)
        return make_batch(self.data, order[index * self.per_batch : (index + 1) * self.per_batch], self.layer_ids)

    def validate(self) -> dict:
        return evaluate(
            self.trainer,
            self.head,
            self.data,
            self.val_seqs,
            self.layer_ids,
            self.window,
            self.per_batch,
            self.num_steps,
        )


@dataclass
class _Optimization:
    """AdamW on the head's trainable parameters, a 20-step warm-up and a cosine decay."""

    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR

    @classmethod
    def for_head(cls, head: nn.Module, lr: float, total: int) -> _Optimization:
        params = [p for p in head.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
        )
        return cls(params, optimizer, schedule)

    def step(self, loss: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(self.params, 0.5)
        self.optimizer.step()
        self.schedule.step()


@dataclass
class _Checkpoint:
    """`OUT/train_state.pt` every `every` steps: the head, the optimizer, the step, the RNG."""

    path: Path
    settings: dict  # a saved state continues only the run that made it: same data, same schedule
    every: int

    def resume(self, head: nn.Module, optimization: _Optimization) -> tuple[int, list[dict]]:
        """Load the saved state into `head` and `optimization`; its step and history."""
        state = torch.load(self.path, weights_only=True)  # tensors and plain data: a file runs no code
        if state.get("settings") != self.settings:
            changed = sorted(k for k in self.settings if state.get("settings", {}).get(k) != self.settings[k])
            raise ValueError(
                f"{self.path} belongs to a training run with other settings ({', '.join(changed)}); "
                "delete it to start over, or choose another --out"
            )
        head.load_state_dict(state["head"])
        optimization.optimizer.load_state_dict(state["optimizer"])
        optimization.schedule.load_state_dict(state["schedule"])
        torch.set_rng_state(state["rng"])  # the same token-loss samples as an uninterrupted run
        return state["step"], state["history"]

    def resume_or_start(
        self, head: nn.Module, optimization: _Optimization, method: str, total: int
    ) -> tuple[int, list[dict]]:
        """The step and history to go on from: a saved state's, loaded as `resume` does (and
        said), or a fresh run's."""
        if not self.path.exists():
            return 0, []
        step, history = self.resume(head, optimization)
        print(f"resuming {method} training at step {step}/{total}")
        return step, history

    def save(self, head: nn.Module, optimization: _Optimization, step: int, history: list[dict]) -> None:
        torch.save(
            {
                "head": head.state_dict(),
                "optimizer": optimization.optimizer.state_dict(),
                "schedule": optimization.schedule.state_dict(),
                "step": step,
                "history": history,
                "rng": torch.get_rng_state(),
                "settings": self.settings,
            },
            self.path,
        )


def _settings(run: _Run, method: str, lr: float, batch_tokens: int, options: dict | None) -> dict:
    """What a saved state must have been made with to be continued (`_Checkpoint.settings`)."""
    return {
        "method": method,
        "epochs": run.epochs,
        "lr": lr,
        "batch_tokens": batch_tokens,
        "window": run.window,
        "num_steps": run.num_steps,
        "seed": run.seed,
        "group_by_length": run.group_by_length,
        "options": options or {},
        "num_train_tokens": sum(b - a for a, b in run.spans),
    }


def _report(settings: dict, target: Path, run: _Run, num_train_sequences: int, seconds: float, history: list) -> dict:
    return {
        "method": settings["method"],
        "target": str(target),
        "epochs": settings["epochs"],
        "steps": run.total,
        "lr": settings["lr"],
        "num_train_sequences": num_train_sequences,
        "num_validation_sequences": len(run.val_seqs),
        "num_train_tokens": settings["num_train_tokens"],
        "train_seconds_this_run": seconds,
        "history": history,
    }


def _write_validation_prompts(data_dir: Path, out: Path, val_seqs: list[int]) -> None:
    """The validation sequences' prompts (never trained on), for `tritonspec bench --prompt-file`."""
    prompt_list = json.loads((data_dir / "prompts.json").read_text())
    (out / "validation_prompts.json").write_text(json.dumps([prompt_list[i] for i in val_seqs], indent=0))


def _train_steps(
    run: _Run, optimization: _Optimization, checkpoint: _Checkpoint, step: int, history: list[dict], method: str
) -> None:
    """Optimizer steps from `step` to the run's end, validating after each epoch (into
    `history`) and saving the state every `checkpoint.every` steps and at the end."""
    bar = tqdm(total=run.total, initial=step, desc=f"train {method}", unit="step")
    while step < run.total:
        epoch = step // run.steps_per_epoch
        batch = run.batch(step)
        run.head.train()
        metrics = run.trainer.loss(run.head, batch, run.num_steps)
        optimization.step(metrics.loss)
        step += 1
        bar.update()
        bar.set_postfix(
            loss=f"{metrics.loss.item():.3f}",
            acc="/".join(f"{c / max(n, 1):.2f}" for c, n in zip(metrics.correct, metrics.counted)),
        )
        if step % run.steps_per_epoch == 0 or step == run.total:
            history.append({"epoch": epoch + 1, "step": step, **run.validate()})
            tqdm.write(f"epoch {epoch + 1}: validation {history[-1]}")
        if step % checkpoint.every == 0 or step == run.total:
            checkpoint.save(run.head, optimization, step, history)
    bar.close()


@torch.no_grad()
def evaluate(
    trainer: HeadTrainer,
    head: nn.Module,
    data: TrainingData,
    sequences: list[int],
    layer_ids: tuple[int, ...],
    window: int,
    per_batch: int,
    num_steps: int,
) -> dict:
    """Per-step top-1 agreement with the target on held-out sequences, and the estimated mean
    acceptance length of a chain (step s is accepted only if steps 1..s are)."""
    head.eval()
    spans = windows(data, sequences, window)
    correct, counted = [0] * num_steps, [0] * num_steps
    for i in range(0, len(spans), per_batch):
        m = trainer.loss(head, make_batch(data, spans[i : i + per_batch], layer_ids), num_steps)
        correct = [a + b for a, b in zip(correct, m.correct)]
        counted = [a + b for a, b in zip(counted, m.counted)]
    accuracy = [c / max(n, 1) for c, n in zip(correct, counted)]
    tau, run = 1.0, 1.0
    for a in accuracy:
        run *= a
        tau += run
    return {"step_accuracy": [round(a, 4) for a in accuracy], "estimated_acceptance_length": round(tau, 3)}
