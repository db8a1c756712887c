"""A tiny random Llama with a real byte-level BPE tokenizer, saved like any HF model
directory (config.json + safetensors + tokenizer.json), so it loads through the same code
as real weights."""
from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "Speculative decoding drafts tokens cheaply and verifies them with the target model.",
    "for i in range(10):\n    print(i, i * i)\n",
    "Triton Inference Server serves models over HTTP and gRPC; café, naïve, 東京, ✓.",
] * 20


def build_tiny_model(out: Path, seed: int = 0, vocab_size: int = 384, num_layers: int = 2) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, eos_token_id=0, bos_token_id=None, pad_token_id=None,
        initializer_range=0.2,  # decisive logits: no near-ties for argmax to flip on
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    _fit(model, tokenizer, steps=60)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _fit(model, tokenizer, steps: int) -> None:
    """A few optimizer steps on the corpus: the model then continues text the way the corpus
    does, so prompt-lookup drafts get accepted (a purely random model rarely repeats)."""
    batch = tokenizer(sorted(set(CORPUS)), padding=False)["input_ids"]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        ids = torch.tensor([batch[step % len(batch)]])
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
