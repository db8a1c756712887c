"""The embedded default model, SmolLM2-135M-Instruct: the checkpoint fetched is the pinned one
(served: tests/e2e/test_smollm2_server.py)."""

from __future__ import annotations


def test_checkpoint_is_the_pinned_one(smollm2_dir):
    from backends.runtime.model_store import NAMED_MODELS, cache_dir, sha256_file

    spec = NAMED_MODELS["smollm2-135m"]
    assert sha256_file(cache_dir() / "gguf" / spec.gguf_name) == spec.sha256
