"""The target's engine, built from its checkpoint and the verifier's settings: the lean runtime
(its own KV pool, batch-invariant where it can be) where it runs, else transformers."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from backends.runtime.engine import Engine, LeanEngine
from backends.runtime.kv_cache import KVCachePool
from backends.runtime.lean_lm import LeanCausalLM, UnsupportedArchitecture, read_checkpoint
from backends.runtime.model_store import context_window, hand_back_freed_memory, load_causal_lm
from backends.serving.rejection import MAX_SPEC_LEN

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger("tritonspec.target")


def kv_bytes_per_token(config, dtype: str) -> int:
    """Keys and values of one token over all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.finfo(getattr(torch, dtype)).bits // 8


def check_sliding_window(config, max_model_len: int) -> None:
    """Refuse a target whose attention is windowed below its context: its cache would keep
    only the window, which verification (crop on rejection, positions past the window) does
    not handle, so it would load and then fail past the window."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    windowed = "sliding_attention" in layer_types or (
        bool(window) and getattr(config, "use_sliding_window", True) is not False
    )
    if windowed and window and window < max_model_len:
        raise ValueError(
            f"the target uses sliding-window attention over {window} tokens, below its context of "
            f"{max_model_len}; this server does not run windowed attention: serve it with max_model_len "
            f"<= {window} (tritonspec serve --max-model-len {window}, or the max_model_len parameter)"
        )


def load_target_engine(
    model_path: Path,
    dtype: str,
    device: torch.device,
    max_model_len: int | None,
    kv_cache_memory_gb: float | None,
    runtime: str,
    batch_invariant: str,
    prefix_caching: bool,
    prefix_cache_namespace: str = "",
) -> Engine:
    """The target's engine (TargetRunner's arguments): the lean runtime where it runs, else transformers."""
    # The lean runtime reads the weights itself where it can; transformers loads the rest.
    checkpoint = None if runtime == "hf" else read_checkpoint(Path(model_path), getattr(torch, dtype), device)
    model = checkpoint or load_causal_lm(model_path, dtype).to(device)
    config = model.config
    lean = _lean_target(model, runtime, batch_invariant, device)
    if lean is not None:  # it holds its own copy of the weights: the source it was made from goes
        del model, checkpoint
        hand_back_freed_memory()
        window = context_window(config, max_model_len)
        pool = _target_pool(lean, kv_cache_memory_gb, prefix_caching, window)
        pool.namespace = prefix_cache_namespace
        return LeanEngine(lean, pool)
    if checkpoint is not None:  # read for a runtime that then did not run
        model = load_causal_lm(model_path, dtype).to(device)
    budget = int(kv_cache_memory_gb * 2**30 / kv_bytes_per_token(config, dtype)) if kv_cache_memory_gb else None
    from backends.runtime.hf_engine import HFEngine  # transformers' config classes: only where it runs

    return HFEngine(model, budget)


def _lean_target(
    model: PreTrainedModel | SimpleNamespace, runtime: str, batch_invariant: str, device: torch.device
) -> LeanCausalLM | None:
    """The target on the lean runtime, when this model and device have it (else None: transformers)."""
    # On a GPU the lean runtime is its batch-invariant Triton path (scripts/gpu_speed.py: on an
    # H200 a 170M-parameter verify step took 2.6-3.1 ms there, 42-60 ms through transformers).
    if runtime == "hf":
        log.info("target runs through transformers (runtime=%s, device %s), not batch-invariant", runtime, device)
        return None
    lean = None
    if batch_invariant != "off":
        try:
            lean = LeanCausalLM.from_hf(model, batch_invariant=True)
        except UnsupportedArchitecture as e:
            if batch_invariant == "on" or runtime == "lean":
                raise
            log.warning("target is not batch-invariant (bf16 speculative output may differ from plain): %s", e)
    try:
        return lean or LeanCausalLM.from_hf(model)
    except UnsupportedArchitecture as e:
        if runtime == "lean":
            raise
        log.info("target runs through transformers, not batch-invariant: %s", e)
        return None


def _target_pool(lean: LeanCausalLM, memory_gb: float | None, prefix_caching: bool, max_model_len: int) -> KVCachePool:
    """The target's KV pool: `memory_gb` of it, or without a budget room for 8 sequences at
    the full context window."""
    pool = (
        lean.new_pool(memory_gb=memory_gb, prefix_caching=prefix_caching)
        if memory_gb
        else lean.new_pool(capacity_tokens=8 * (max_model_len + MAX_SPEC_LEN), prefix_caching=prefix_caching)
    )
    log.info(
        "target runs on the lean runtime, batch-invariant %s, prefix caching %s: weights %.2f GB, "
        "KV pool of %d tokens (%.2f GB)",
        "on" if lean.batch_invariant else "off",
        "on" if prefix_caching else "off",
        lean.weight_bytes() / 2**30,
        pool.capacity_tokens,
        pool.capacity_tokens * pool.bytes_per_token / 2**30,
    )
    return pool
