"""The model runtime: one paged KV cache pool per model instance and a lean batched forward
for the decoder families we serve (Llama, Qwen2, Qwen3, Mistral without sliding window)."""
