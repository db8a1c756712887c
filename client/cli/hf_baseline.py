"""Hugging Face `generate` on the same prompts, for comparison with the server: plain greedy,
assisted generation with a draft model, and prompt lookup. All greedy, batch 1, in process.

Each function returns one dict per prompt: `text` (the new text), `ids` (the new token ids),
`num_tokens`, `seconds` and `tokens_per_s`. A model spec is whatever `--model` takes: a named
model, an HF directory or a GGUF file.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from backends.runtime.model_store import load_causal_lm, load_tokenizer, resolve_model


def hf_greedy_timed(
    target_dir: str | Path, prompts: list[str], max_new_tokens: int, dtype: str = "bfloat16"
) -> list[dict]:
    """The target alone."""
    model, tokenizer = _load(target_dir, dtype)
    return _generate(model, tokenizer, prompts, max_new_tokens)


def hf_assisted(
    target_dir: str | Path, draft_dir: str | Path, prompts: list[str], max_new_tokens: int, dtype: str = "bfloat16"
) -> list[dict]:
    """`generate(assistant_model=...)`: HF's speculative decoding with a draft model that
    shares the target's tokenizer."""
    model, tokenizer = _load(target_dir, dtype)
    assistant = load_causal_lm(resolve_model(str(draft_dir)), dtype)
    return _generate(model, tokenizer, prompts, max_new_tokens, assistant_model=assistant)


def hf_prompt_lookup(
    target_dir: str | Path, prompts: list[str], max_new_tokens: int, num_tokens: int = 10, dtype: str = "bfloat16"
) -> list[dict]:
    """`generate(prompt_lookup_num_tokens=...)`: HF's n-gram drafting."""
    model, tokenizer = _load(target_dir, dtype)
    return _generate(model, tokenizer, prompts, max_new_tokens, prompt_lookup_num_tokens=num_tokens)


def _load(spec: str | Path, dtype: str) -> tuple[Any, Any]:
    path = resolve_model(str(spec))
    return load_causal_lm(path, dtype), load_tokenizer(path)


@torch.inference_mode()
def _generate(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int, **kwargs: Any) -> list[dict]:
    results = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            top_k=None,
            top_p=None,
            **kwargs,
        )
        seconds = time.perf_counter() - start
        new = out[0, ids.shape[1] :].tolist()
        results.append(
            {
                "prompt": prompt,
                "text": tokenizer.decode(new, skip_special_tokens=True),
                "ids": new,
                "num_tokens": len(new),
                "seconds": seconds,
                "tokens_per_s": len(new) / seconds if seconds > 0 else None,
            }
        )
    return results
