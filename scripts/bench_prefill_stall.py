"""How long a streaming request stalls while another client's long prompt is prefilled.

One client streams a plain answer (160 tokens); a second later another client sends a long
prompt (about 2,000 tokens). Printed per repeat: the stream's median and longest gap between
tokens, and the long request's time. Run against servers started with different
`--prefill-chunk-tokens` (one at a time, on a quiet machine):

    tritonspec serve --no-speculation --prefill-chunk-tokens 0     # then, in another shell:
    .venv/bin/python scripts/bench_prefill_stall.py --url http://localhost:8000
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import requests

STREAM_PROMPT = "Write a long story about a lighthouse keeper."
LONG_PROMPT = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(160))


def stream(url: str, times: list[float]) -> None:
    body = {"text_input": STREAM_PROMPT, "max_tokens": 160, "ignore_eos": True, "num_draft_tokens": 0, "stream": True}
    with requests.post(f"{url}/v2/models/speculative/generate_stream", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data:"):
                times.append(time.perf_counter())


def long_request(url: str, out: dict) -> None:
    start = time.perf_counter()
    body = {"text_input": LONG_PROMPT, "max_tokens": 8, "num_draft_tokens": 0, "return_num_input_tokens": True}
    r = requests.post(f"{url}/v2/models/speculative/generate", json=body, timeout=600)
    r.raise_for_status()
    out["seconds"] = time.perf_counter() - start
    out["prompt_tokens"] = r.json().get("num_input_tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://localhost:8000")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.repeats):
        times: list[float] = []
        out: dict = {}
        streamer = threading.Thread(target=stream, args=(args.url, times))
        streamer.start()
        time.sleep(1.0)
        long_request(args.url, out)
        streamer.join()
        gaps = [b - a for a, b in zip(times, times[1:])]
        print(
            f"stream: {len(times)} responses, median gap {statistics.median(gaps) * 1e3:.0f} ms, longest gap "
            f"{max(gaps) * 1e3:.0f} ms; long request ({out['prompt_tokens']} prompt tokens) {out['seconds']:.2f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
