"""The engine interface (backends/runtime/engine.py) on both engines: the lean runtime's
adapter and transformers' (hf_engine.py). The same calls must give the same logits and caches
whichever way a step is cut, batched or alone, rolled back or not."""

from __future__ import annotations

import pytest
import torch

from backends.runtime.engine import Engine, LeanEngine, Row
from backends.runtime.hf_engine import HFEngine
from backends.runtime.kv_cache import KVCacheFullError, SequenceError
from backends.runtime.lean_lm import LeanCausalLM
from backends.runtime.model_store import load_causal_lm

PROMPTS = {1: [5, 17, 29, 3, 41, 8, 60], 2: [11, 2, 90], 3: [7, 7, 31, 44, 12]}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir, "float32")


@pytest.fixture(params=["lean", "hf"])
def make(request, model):
    """A new engine of the tiny model each call (its own caches)."""
    if request.param == "lean":
        lean = LeanCausalLM.from_hf(model, batch_invariant=True)
        return lambda: LeanEngine.with_pool(lean, capacity_tokens=1024)
    return lambda: HFEngine(model)


def fresh_logits(engine: Engine, seq_id: int, tokens: list[int]) -> torch.Tensor:
    """[1, V] after `tokens` on a new sequence, alone: the reference."""
    engine.admit(seq_id, 64)
    logits = engine.forward([Row(seq_id, tokens)]).logits[0]
    engine.release(seq_id)
    return logits


def test_batched_steps_and_rollback_give_the_lone_logits(make):
    """Prompts alone, then the running sequences batched: several tokens, a rollback, then one
    token at a time (the drafter's continuation on transformers' stacked cache); every row's
    logits are those of a fresh forward over its tokens, and its cache holds exactly them."""
    engine, reference = make(), make()
    history = {}
    for seq_id, prompt in PROMPTS.items():
        engine.admit(seq_id, 64)
        engine.forward([Row(seq_id, prompt)], 0)
        history[seq_id] = list(prompt)
    new = {1: [4, 9, 22], 2: [13], 3: [50, 51]}
    out = engine.forward([Row(s, t) for s, t in new.items()], [len(t) for t in new.values()])
    for (seq_id, tokens), logits in zip(new.items(), out.logits):
        assert logits.shape[0] == len(tokens)
        want = fresh_logits(reference, 99, history[seq_id] + tokens)
        torch.testing.assert_close(logits[-1:], want, rtol=1e-5, atol=1e-5)
        engine.truncate(seq_id, len(history[seq_id]) + 1)  # all but the first new token rejected
        history[seq_id] += tokens[:1]
    for step in range(3):
        out = engine.forward([Row(s, torch.tensor([20 + step])) for s in PROMPTS])
        for seq_id, logits in zip(PROMPTS, out.logits):
            history[seq_id].append(20 + step)
            torch.testing.assert_close(logits, fresh_logits(reference, 99, history[seq_id]), rtol=1e-5, atol=1e-5)
    for seq_id in PROMPTS:
        assert engine.length(seq_id) == len(history[seq_id])
        engine.commit(seq_id, history[seq_id])
        engine.release(seq_id)
    assert engine.reserved_tokens == 0


def test_hidden_states_of_the_asked_layers(make, model):
    """{layer id: [n, hidden]} per row in vLLM's numbering: transformers' hidden_states[i] for
    the input of layer i, the final normed state for -1."""
    engine = make()
    engine.admit(1, 64)
    engine.admit(2, 64)
    engine.forward([Row(1, PROMPTS[1])], 0)
    engine.forward([Row(2, PROMPTS[2])], 0)
    out = engine.forward([Row(1, [4, 9]), Row(2, [13])], [2, 1], hidden_layers=(0, 1, -1))
    for seq_id, new, hidden in zip((1, 2), ([4, 9], [13]), out.hidden):
        with torch.inference_mode():
            want = model(input_ids=torch.tensor([PROMPTS[seq_id] + new]), output_hidden_states=True).hidden_states
        for layer in (0, 1, -1):
            assert hidden[layer].shape == (len(new), model.config.hidden_size)
            torch.testing.assert_close(hidden[layer], want[layer][0, -len(new) :], rtol=1e-4, atol=1e-4)


def test_what_transformers_cannot_do_is_refused_in_words(model):
    engine = HFEngine(model, capacity_tokens=100)
    assert not engine.ragged and not engine.tree_attention and not engine.prefix_caching
    engine.admit(1, 60)
    with pytest.raises(KVCacheFullError, match="KV cache budget full: this request may need 50 tokens"):
        engine.admit(2, 50)
    with pytest.raises(SequenceError, match="already admitted"):
        engine.admit(1, 10)
    with pytest.raises(SequenceError, match="no tree attention"):
        engine.forward([Row(1, [3, 4], mask=torch.ones(2, 2, dtype=torch.bool))])
    with pytest.raises(NotImplementedError, match="no tree attention"):
        engine.compact(1, [0], 0)
    engine.forward([Row(1, [3, 4, 5])])
    assert engine.share_prefix(1, [3, 4, 5, 6]) == 0 and engine.final_tokens(1) == 0 and engine.room(1) == 57
    with pytest.raises(SequenceError, match="cannot truncate length 3 to 4"):
        engine.truncate(1, 4)
    engine.release(1)
    engine.release(1)  # unknown now: nothing to do
    with pytest.raises(SequenceError, match="not in the KV cache"):
        engine.length(1)


def test_a_failed_batched_forward_leaves_every_cache_as_it_was(model, monkeypatch):
    """Transformers' padded batch runs on a stacked copy: a forward that fails (a one-token step
    on it, or a new stack's first) leaves each sequence's own cache where its last good step left it."""
    engine = HFEngine(model)
    for seq_id in (1, 2):
        engine.admit(seq_id, 64)
        engine.forward([Row(seq_id, PROMPTS[seq_id])], 0)
    engine.forward([Row(1, [4]), Row(2, [5])])
    assert [engine.length(s) for s in (1, 2)] == [8, 4]  # written back when touched
    engine.forward([Row(1, [6]), Row(2, [7])])
    forward = model.forward

    def failing(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(model, "forward", failing)
    with pytest.raises(RuntimeError):
        engine.forward([Row(1, [8]), Row(2, [9])])
    monkeypatch.setattr(model, "forward", forward)
    # the step before is kept, none of the failed one's entries
    assert [engine.length(s) for s in (1, 2)] == [9, 5]
    monkeypatch.setattr(model, "forward", failing)
    with pytest.raises(RuntimeError):  # a new stack that fails: nothing to write back
        engine.forward([Row(1, [8, 9]), Row(2, [9])])
    monkeypatch.setattr(model, "forward", forward)
    assert [engine.length(s) for s in (1, 2)] == [9, 5]
