"""Training data for drafter heads: the target's own greedy answers to the training prompts,
and the target's hidden states and greedy next-token predictions at every position.

All stages are cached under the data directory and resumable:
- `self_prompts.json` (only with `self_prompts`): user requests the target writes itself,
  Magpie's idea: prompts from the target's own distribution, made from nothing but the target.
- `generations.jsonl`: one line per prompt (its index, prompt length, prompt + answer ids),
  appended batch by batch; a rerun skips the prompts already answered.
- `states.safetensors`: for every position of every sequence, the hidden states of the
  requested layers (bfloat16, numbered as the verifier numbers them, `hf_engine.select_hidden`)
  and the target's argmax there (the token it would emit next). Recomputed only when a head
  asks for a layer the file lacks.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from backends.runtime.hf_engine import select_hidden
from backends.runtime.model_store import load_causal_lm, load_tokenizer
from backends.training.corpus import CHAT, OPENINGS, check_held_out, overlaps_held_out, training_prompts


@dataclass
class TrainingData:
    """Sequences laid end to end: sequence i is positions offsets[i]:offsets[i+1]."""

    token_ids: torch.Tensor  # [N] int64
    labels: torch.Tensor  # [N] the target's greedy next token after each position
    hidden: dict[int, torch.Tensor]  # layer id -> [N, H] bfloat16
    offsets: torch.Tensor  # [S + 1]
    prompt_lens: torch.Tensor  # [S]

    @property
    def num_sequences(self) -> int:
        return len(self.offsets) - 1

    def sequence(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def split(self, held_out: float = 0.05) -> tuple[list[int], list[int]]:
        """Train and validation sequence indices (every 1/held_out-th sequence validates)."""
        every = max(2, round(1 / held_out))
        indices = range(self.num_sequences)
        return [i for i in indices if i % every], [i for i in indices if not i % every]


def generate(target: Path, data_dir: Path, prompts: list[str], max_new_tokens: int, batch_size: int) -> list[dict]:
    """The target's greedy answer to each prompt, appended to generations.jsonl."""
    data_dir.mkdir(parents=True, exist_ok=True)
    _check_prompts(data_dir, prompts)
    path = data_dir / "generations.jsonl"
    done = [json.loads(line) for line in path.open()] if path.exists() else []
    todo = sorted(set(range(len(prompts))) - {d["prompt"] for d in done}, key=lambda i: len(prompts[i]))
    if todo:
        model, tokenizer = _batched_generator(target)
        pad = tokenizer.pad_token_id
        eos = set(_eos_ids(model, tokenizer))
        bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="target answers", unit="prompt")
        with path.open("a") as out:
            for start in range(0, len(todo), batch_size):
                batch = todo[start : start + batch_size]
                enc = tokenizer([prompts[i] for i in batch], return_tensors="pt", padding=True)
                with torch.inference_mode():
                    gen = model.generate(
                        **enc, max_new_tokens=max_new_tokens, do_sample=False, top_k=None, top_p=None, pad_token_id=pad
                    )
                width = enc["input_ids"].shape[1]
                for row, i in enumerate(batch):
                    prompt_ids = enc["input_ids"][row][enc["attention_mask"][row].bool()].tolist()
                    answer = _until_eos(gen[row, width:].tolist(), eos)
                    record = {"prompt": i, "prompt_len": len(prompt_ids), "token_ids": prompt_ids + answer}
                    out.write(json.dumps(record) + "\n")
                    done.append(record)
                out.flush()
                bar.update(len(batch))
        bar.close()
    return sorted((d for d in done if d["prompt"] < len(prompts)), key=lambda d: d["prompt"])


def self_written_prompts(target: Path, data_dir: Path, count: int, batch_size: int = 32, seed: int = 0) -> list[str]:
    """`count` user requests written by the target (cached in self_prompts.json): inside a
    user turn the target continues an opening from `OPENINGS`, sampled; a request counts once
    the target ends the turn, repeats and overlaps with the benchmark prompts are dropped."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / "self_prompts.json"
    prompts: list[str] = json.loads(path.read_text()) if path.exists() else []
    if len(prompts) >= count:
        return prompts[:count]
    model, tokenizer = _batched_generator(target)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if end is None or end == tokenizer.unk_token_id:
        raise ValueError(f"{target}: target-written prompts need a ChatML chat model (no <|im_end|> token)")
    system = "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n<|im_start|>user\n"
    rng = random.Random(seed + len(prompts))
    torch.manual_seed(seed + len(prompts))
    seen = set(prompts)
    bar = tqdm(total=count, initial=len(prompts), desc="target-written prompts", unit="prompt")
    idle = 0  # batches in a row that gave nothing usable
    while len(prompts) < count:
        if idle == 4:
            raise ValueError(
                f"{target} stopped writing usable requests after {len(prompts)} of {count} (none of "
                f"its last {4 * batch_size} ended its turn or was new); use fewer --self-prompts"
            )
        before = len(prompts)
        openings = [rng.choice(OPENINGS) for _ in range(batch_size)]
        enc = tokenizer([system + o for o in openings], return_tensors="pt", padding=True)
        with torch.inference_mode():
            gen = model.generate(
                **enc,
                max_new_tokens=64,
                do_sample=True,
                temperature=0.8,
                top_p=0.95,
                top_k=None,
                eos_token_id=end,
                pad_token_id=tokenizer.pad_token_id,
            )
        for opening, row in zip(openings, gen[:, enc["input_ids"].shape[1] :].tolist()):
            if end not in row or len(prompts) == count:
                continue  # ran out of tokens mid-request, or enough already
            request = (opening + tokenizer.decode(row[: row.index(end)])).strip()
            prompt = CHAT.format(request)
            if len(request) < len(opening) + 12 or prompt in seen or overlaps_held_out(prompt):
                continue
            seen.add(prompt)
            prompts.append(prompt)
            bar.update()
        idle = idle + 1 if len(prompts) == before else 0
        path.write_text(json.dumps(prompts, indent=0))
    bar.close()
    return prompts[:count]


def _batched_generator(target: Path):
    """The target (float32) and its tokenizer, set up to generate for left-padded batches."""
    model, tokenizer = load_causal_lm(target, "float32"), load_tokenizer(target)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out anyway
    return model, tokenizer


def _check_prompts(data_dir: Path, prompts: list[str]) -> None:
    """Answers are stored by prompt index: refuse a data directory made for other prompts."""
    path = data_dir / "prompts.json"
    known = json.loads(path.read_text()) if path.exists() else []
    if known[: len(prompts)] != prompts[: len(known)]:
        raise ValueError(
            f"{data_dir} holds the target's answers to other prompts; choose another --data-dir for this prompt list"
        )
    if len(prompts) > len(known):
        path.write_text(json.dumps(prompts, indent=0))


def _eos_ids(model, tokenizer) -> list[int]:
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    return [e for e in eos + [tokenizer.eos_token_id] if e is not None]


def _until_eos(ids: list[int], eos: set[int]) -> list[int]:
    for n, token in enumerate(ids):
        if token in eos:
            return ids[: n + 1]
    return ids


def target_states(
    target: Path, data_dir: Path, records: list[dict], layer_ids: tuple[int, ...], batch_size: int = 8
) -> TrainingData:
    """Hidden states of `layer_ids` and the target's argmax at every position (cached)."""
    path = data_dir / "states.safetensors"
    from safetensors.torch import load_file, save_file

    if path.exists():
        cached = load_file(path)
        if all(f"hidden.{i}" in cached for i in layer_ids) and cached["offsets"][-1] == sum(
            len(r["token_ids"]) for r in records
        ):
            return _as_data(cached, layer_ids)
        layer_ids = tuple(sorted(set(layer_ids) | {int(k.split(".")[1]) for k in cached if k.startswith("hidden.")}))
    model = load_causal_lm(target, "float32")
    hidden: dict[int, list[torch.Tensor]] = {i: [] for i in layer_ids}
    labels = []
    order = sorted(range(len(records)), key=lambda i: len(records[i]["token_ids"]))  # little padding
    per_record: dict[int, tuple] = {}
    for start in tqdm(range(0, len(order), batch_size), desc="target hidden states", unit="batch"):
        batch = [records[i]["token_ids"] for i in order[start : start + batch_size]]
        width = max(map(len, batch))
        ids = torch.tensor([s + [0] * (width - len(s)) for s in batch])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in batch])
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        for row, i in enumerate(order[start : start + batch_size]):
            n = len(batch[row])
            states = select_hidden(out.hidden_states, row, n, layer_ids).to(torch.bfloat16)
            per_record[i] = (states, out.logits[row, :n].argmax(-1))
    for i in range(len(records)):
        states, argmax = per_record[i]
        for j, layer in enumerate(layer_ids):
            hidden[layer].append(states[:, j])
        labels.append(argmax)
    lengths = torch.tensor([len(r["token_ids"]) for r in records])
    tensors = {
        "token_ids": torch.tensor([t for r in records for t in r["token_ids"]]),
        "labels": torch.cat(labels),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "prompt_lens": torch.tensor([r["prompt_len"] for r in records]),
        **{f"hidden.{i}": torch.cat(h).contiguous() for i, h in hidden.items()},
    }
    save_file(tensors, path)
    return _as_data(tensors, layer_ids)


def _as_data(tensors: dict[str, torch.Tensor], layer_ids: tuple[int, ...]) -> TrainingData:
    return TrainingData(
        tensors["token_ids"],
        tensors["labels"],
        {i: tensors[f"hidden.{i}"] for i in layer_ids},
        tensors["offsets"],
        tensors["prompt_lens"],
    )


def prepare(
    target: Path,
    data_dir: Path,
    layer_ids: tuple[int, ...],
    num_prompts: int | None = None,
    max_new_tokens: int = 128,
    batch_size: int = 16,
    prompts: list[str] | None = None,
    self_prompts: int = 0,
) -> TrainingData:
    """Generate (or reuse) the target's answers to the first `num_prompts` prompts (default:
    the built-in training prompts) followed by `self_prompts` requests the target writes
    itself, then (or reuse) their hidden states."""
    prompts = prompts or training_prompts()
    prompts = prompts[:num_prompts] if num_prompts else prompts
    if self_prompts < 0:
        raise ValueError(f"self_prompts must be >= 0, got {self_prompts}")
    if self_prompts:
        prompts = prompts + self_written_prompts(target, data_dir, self_prompts)
    check_held_out(prompts)
    records = generate(target, data_dir, prompts, max_new_tokens, batch_size)
    return target_states(target, data_dir, records, layer_ids)
