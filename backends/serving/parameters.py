"""The `speculative` model's config.pbtxt parameters that count tokens or seconds, read as
the server reads them (a ValueError naming the parameter). Apart from the serving modules (no
torch), so the command line checks its flags with the same functions at no import cost."""

from __future__ import annotations

# Prompt tokens per verifier step when prefilling a long prompt. Served on SmolLM2-135M bf16
# here (scripts/bench_prefill_stall.py), a 2450-token prompt stalled a running stream for
# 9.2-9.6 s in one step, 1.1-1.9 s with 256-token chunks and 0.7-0.8 s with 128, and itself
# took 9.7-10.1 s, 7.8 s and 7.6-7.9 s: chunks cost nothing (attention over one long pass
# costs more than the extra weight passes). With attention on bf16 dot products (issue 58), in
# process on one thread (scripts/bench_prefill.py --threads 1): 2000 tokens in 3.51 s with
# 128-token chunks, 3.40 s with 512, whose longest step is 0.98 s against 0.28: 3% sooner first
# token for 3.5x the stall of other streams, so 128 stays.
DEFAULT_PREFILL_CHUNK = 128


def prefill_chunk_tokens(value: str) -> int:
    """The `prefill_chunk_tokens` parameter: a positive number of tokens, or 0 (no chunking)."""
    return _whole_tokens("prefill_chunk_tokens", value, 0, "0: no chunking")


def _whole_tokens(name: str, value: str, least: int, meaning: str) -> int:
    """A config parameter that counts tokens: a whole number >= `least` (ValueError naming it)."""
    try:
        tokens = int(value)
    except ValueError:
        tokens = least - 1
    if tokens < least:
        raise ValueError(f"{name} must be a whole number of tokens >= {least} ({meaning}), got {value!r}")
    return tokens


def stream_interval(value: str) -> int:
    """The `stream_interval` parameter: tokens per streamed response, a whole number >= 1."""
    return _whole_tokens("stream_interval", value, 1, "1: every step")


DEFAULT_MAX_QUEUE_TIME_S = 60.0


def max_queue_time_s(value: str) -> float:
    """The `max_queue_time_s` parameter: seconds > 0 ("": the default)."""
    try:
        seconds = float(value) if value.strip() else DEFAULT_MAX_QUEUE_TIME_S
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"max_queue_time_s must be a number of seconds > 0, got {value!r}")
    return seconds
