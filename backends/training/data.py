"""Training data for drafter heads: the target's own greedy answers to the training prompts,
and the target's hidden states and greedy next-token predictions at every position, all
generated on the lean runtime the verifier serves with, many sequences at a time
(`generation.py`), in the serving dtype: a head learns the numbers it is served.

All stages are cached under the data directory (stamped `format.json`: a directory another
generator filled is refused) and resumable:
- `self_prompts.json` (only with `self_prompts`): user requests the target writes itself,
  Magpie's idea: prompts from the target's own distribution, made from nothing but the target.
- `generations.jsonl`: one line per prompt (its index, prompt length, prompt + answer ids),
  appended part by part; a rerun skips the prompts already answered.
- `states.safetensors`: for every position of every sequence, the hidden states of the
  requested layers (bfloat16, numbered as the verifier numbers them: `LeanCausalLM.forward`'s
  `hidden_layers`) and the target's argmax there (the token it would emit next), recorded
  while the answers are generated (`parts/` until every answer is in). When a head asks for a
  layer the file lacks, every sequence is run again as one prefill for it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from backends.runtime.model_store import load_tokenizer
from backends.training.corpus import CHAT, OPENINGS, check_held_out, overlaps_held_out, training_prompts
from backends.training.generation import Generated, Sampling, TargetGenerator, load_lean_target

# The data directory's format: 1 was transformers' float32 answers, 2 the lean runtime's.
DATA_VERSION = 2


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


def self_written_prompts(
    target: Path, data_dir: Path, count: int, batch_size: int = 64, seed: int = 0, dtype: str = "bfloat16"
) -> list[str]:
    """`count` user requests written by the target (cached in self_prompts.json): inside a
    user turn the target continues an opening from `OPENINGS`, sampled; a request counts once
    the target ends the turn, repeats and overlaps with the benchmark prompts are dropped."""
    data_dir.mkdir(parents=True, exist_ok=True)
    _check_format(data_dir, dtype)
    path = data_dir / "self_prompts.json"
    prompts: list[str] = json.loads(path.read_text()) if path.exists() else []
    if len(prompts) >= count:
        return prompts[:count]
    tokenizer = load_tokenizer(target)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if end is None or end == tokenizer.unk_token_id:
        raise ValueError(f"{target}: target-written prompts need a ChatML chat model (no <|im_end|> token)")
    system = "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n<|im_start|>user\n"
    rng = random.Random(seed + len(prompts))
    sampling = Sampling(0.8, 0.95, torch.Generator().manual_seed(seed + len(prompts)))
    seen = set(prompts)
    generator: TargetGenerator | None = None
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
        starts = [tokenizer(system + o)["input_ids"] for o in openings]
        if generator is None:
            longest = max(len(tokenizer(system + o)["input_ids"]) for o in OPENINGS)
            generator = TargetGenerator(load_lean_target(target, dtype), longest + 64)
        written = sorted(generator.generate(starts, 64, {end}, sampling=sampling), key=lambda g: g.index)
        for opening, g in zip(openings, written):
            row = g.token_ids[g.prompt_len :]
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


def _check_format(data_dir: Path, dtype: str) -> None:
    """Refuse a data directory another generator filled (its answers and states are not this
    runtime's numbers); a new one is stamped with this one's."""
    path = data_dir / "format.json"
    made = {"version": DATA_VERSION, "generator": "lean runtime", "dtype": dtype}
    found = json.loads(path.read_text()) if path.exists() else None
    if found is None and any(data_dir.glob("*.json*")):
        found = {"version": 1, "generator": "transformers", "dtype": "float32"}
    if found is None:
        data_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(made))
    elif found != made:
        raise ValueError(
            f"{data_dir} holds training data made by {found['generator']} in {found['dtype']} (format "
            f"{found['version']}), not by the {made['generator']} in {dtype} (format {DATA_VERSION}); "
            "choose another --data-dir or delete it"
        )


def _stop_ids(target: Path, tokenizer) -> set[int]:
    """The target's end-of-answer tokens: its generation config's, and its tokenizer's."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(target).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    eos = eos if isinstance(eos, list) else [eos]
    return {e for e in eos + [tokenizer.eos_token_id] if e is not None}


def answer(
    target: Path,
    data_dir: Path,
    prompts: list[str],
    max_new_tokens: int,
    layer_ids: tuple[int, ...],
    dtype: str = "bfloat16",
) -> TrainingData:
    """The target's greedy answers to `prompts` with their states at every position (cached:
    `states.safetensors` when complete; while under way `generations.jsonl` and `parts/`)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    _check_format(data_dir, dtype)
    _check_prompts(data_dir, prompts)
    parts = _Parts(data_dir)
    cached = parts.layers()
    if cached is not None and set(layer_ids) <= cached and parts.covers(range(len(prompts))):
        return parts.assemble(range(len(prompts)), layer_ids)
    layers = tuple(sorted(set(layer_ids) | (cached or set())))  # what the file had stays
    path = data_dir / "generations.jsonl"
    done = {d["prompt"]: d for d in map(json.loads, path.open())} if path.exists() else {}
    tokenizer = load_tokenizer(target)
    todo = [i for i in range(len(prompts)) if i not in done]
    asked = [tokenizer(prompts[i])["input_ids"] for i in todo]
    # Answers already written without their states (another head's layers, an older run):
    # the whole sequence is one prefill, no new tokens.
    again = [i for i in sorted(done) if i < len(prompts) and not parts.has(i, layers)]
    longest = max([len(ids) + max_new_tokens for ids in asked] + [len(done[i]["token_ids"]) for i in again] + [1])
    generator = TargetGenerator(load_lean_target(target, dtype), longest)
    with path.open("a") as book:
        if again:
            runs = generator.generate([done[i]["token_ids"] for i in again], 0, set(), layers)
            parts.write_all(runs, again, layers, "target states (answers written before)", book=None)
        if todo:
            runs = generator.generate(asked, max_new_tokens, _stop_ids(target, tokenizer), layers)
            parts.write_all(runs, todo, layers, "target answers and states", book=book)
    return parts.assemble(range(len(prompts)), layer_ids, merge=True)


class _Parts:
    """Recorded sequences on disk, a few hundred per file, so a stopped run loses little:
    `parts/NNNNN.safetensors` while under way, merged into `states.safetensors` at the end;
    each file holds its sequences' prompt indices, token ids, prompt lengths, labels and
    hidden states (`hidden.LAYER`), laid end to end by `offsets`."""

    every = 256  # sequences per part file

    def __init__(self, data_dir: Path) -> None:
        self.dir, self.merged = data_dir / "parts", data_dir / "states.safetensors"
        files = ([self.merged] if self.merged.exists() else []) + sorted(self.dir.glob("*.safetensors"))
        self.index: dict[int, tuple[Path, int]] = {}  # prompt -> (file, sequence in it); the newest file wins
        self.file_layers: dict[Path, set[int]] = {}
        for f in files:
            with safe_open(f, "pt") as h:
                self.file_layers[f] = {int(k.split(".")[1]) for k in h.keys() if k.startswith("hidden.")}
                for n, prompt in enumerate(h.get_tensor("prompts").tolist()):
                    self.index[prompt] = (f, n)

    def layers(self) -> set[int] | None:
        """The layers every file holds (None: no file yet)."""
        return set.intersection(*self.file_layers.values()) if self.file_layers else None

    def has(self, prompt: int, layers: tuple[int, ...]) -> bool:
        return prompt in self.index and set(layers) <= self.file_layers[self.index[prompt][0]]

    def covers(self, prompts: range) -> bool:
        return all(i in self.index for i in prompts)

    def write_all(
        self, runs: Iterator[Generated], prompts: list[int], layers: tuple[int, ...], desc: str, book: IO[str] | None
    ) -> None:
        """Write the generated sequences of `prompts` (yielded as they finish, states of
        `layers`) part by part, with a progress bar and its ETA on stderr; `book`:
        generations.jsonl, where each part's answers are listed once the part is written."""
        bar = tqdm(total=len(prompts), desc=desc, unit="seq", smoothing=0.1)
        pending: list[Generated] = []
        tokens = 0
        for g in runs:
            pending.append(replace(g, index=prompts[g.index]))
            tokens += len(g.token_ids)
            bar.set_postfix(tokens=tokens, refresh=False)
            bar.update()
            if len(pending) == self.every or bar.n == bar.total:
                self._write(pending, layers, book)
                pending = []
        bar.close()

    def _write(self, seqs: list[Generated], layers: tuple[int, ...], book: IO[str] | None) -> None:
        self.dir.mkdir(exist_ok=True)
        path = self.dir / f"{len(list(self.dir.glob('*.safetensors'))):05d}.safetensors"
        save_file(_tensors(seqs, list(layers)), path)
        self.file_layers[path] = set(layers)
        self.index.update({g.index: (path, n) for n, g in enumerate(seqs)})
        if book is not None:
            for g in seqs:
                book.write(json.dumps({"prompt": g.index, "prompt_len": g.prompt_len, "token_ids": g.token_ids}) + "\n")
            book.flush()

    def assemble(self, prompts: range, layer_ids: tuple[int, ...], merge: bool = False) -> TrainingData:
        """The sequences of `prompts`, in order; `merge`: written as the one states file."""
        loaded = {f: load_file(f) for f in {self.index[i][0] for i in prompts}}
        layers = sorted(set.intersection(*(self.file_layers[f] for f in loaded)))
        seqs = []
        for i in prompts:
            f, n = self.index[i]
            t = loaded[f]
            span = slice(int(t["offsets"][n]), int(t["offsets"][n + 1]))
            hidden = torch.stack([t[f"hidden.{layer}"][span] for layer in layers], dim=1)  # [n, layers, H]
            seqs.append(
                Generated(i, t["token_ids"][span].tolist(), int(t["prompt_lens"][n]), hidden, t["labels"][span])
            )
        tensors = _tensors(seqs, layers)
        if merge:
            save_file(tensors, self.merged)
            for f in self.dir.glob("*.safetensors"):
                f.unlink()
        return _as_data(tensors, layer_ids)


def _tensors(seqs: list[Generated], layers: list[int]) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([len(g.token_ids) for g in seqs], dtype=torch.long)
    hidden = torch.cat([g.hidden for g in seqs]).to(torch.bfloat16)  # [N, layers, H]
    return {
        "prompts": torch.tensor([g.index for g in seqs], dtype=torch.long),
        "token_ids": torch.tensor([t for g in seqs for t in g.token_ids], dtype=torch.long),
        "labels": torch.cat([g.labels for g in seqs]).long(),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "prompt_lens": torch.tensor([g.prompt_len for g in seqs], dtype=torch.long),
        **{f"hidden.{layer}": hidden[:, j].contiguous() for j, layer in enumerate(layers)},
    }


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
    prompts: list[str] | None = None,
    self_prompts: int = 0,
    dtype: str = "bfloat16",
) -> TrainingData:
    """Generate (or reuse) the target's answers to the first `num_prompts` prompts (default:
    the built-in training prompts) followed by `self_prompts` requests the target writes
    itself, with their hidden states; the target runs in `dtype` (as it is served)."""
    prompts = prompts or training_prompts()
    prompts = prompts[:num_prompts] if num_prompts else prompts
    if self_prompts < 0:
        raise ValueError(f"self_prompts must be >= 0, got {self_prompts}")
    if self_prompts:
        prompts = prompts + self_written_prompts(target, data_dir, self_prompts, dtype=dtype)
    check_held_out(prompts)
    return answer(target, data_dir, prompts, max_new_tokens, layer_ids, dtype)
