"""The model runtime: one paged KV cache pool per model instance and a lean batched forward
for the decoder families we serve (Llama, Qwen2, Qwen3, Mistral without sliding window)."""

# How the target's step is asked to be batch-invariant (TargetRunner, the verifier's config.pbtxt,
# `tritonspec serve/bench/verify-cost --batch-invariant`): on where the lean runtime runs, required, none.
BATCH_INVARIANT_MODES = ("auto", "on", "off")

# The thread count `tritonspec serve --threads N` hands every model through the server's
# environment (threads.py reads it; here so the launcher need not import torch to set it).
THREADS_ENV = "TRITONSPEC_THREADS"
