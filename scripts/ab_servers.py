"""Two running servers (e.g. two checkouts' `tritonspec serve`) measured in turn on the bench
prompts: every prompt greedy, plain (`num_draft_tokens` 0) and speculative, sent to one server
then the other (which goes first alternates by round), never two requests at once. Separate
`tritonspec bench` runs of one tree differ by up to ±0.1x on a shared 2-core host; requests
interleaved this way see the same host.

    (cd /tmp/base && .venv/bin/tritonspec serve --http-port 18000 --grpc-port 18001 \
        --metrics-port 18002 --no-enable-prefix-caching) &
    .venv/bin/tritonspec serve --http-port 18100 --grpc-port 18101 --metrics-port 18102 \
        --no-enable-prefix-caching &
    .venv/bin/python scripts/ab_servers.py 18000 18100 --rounds 4 --max-tokens 128

Prints tok/s per family and mode for each server with B/A, whether A's and B's outputs are the
same tokens, and whether each server's speculative output is its plain output.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter, defaultdict
from pathlib import Path

from client.api.triton import Generation, http_generate

PROMPTS = Path(__file__).resolve().parents[1] / "client" / "data" / "bench_prompts.json"
MODES = {"plain": 0, "speculative": None}  # num_draft_tokens (None: the drafter's own k)


def generate(port: int, prompt: str, num_draft_tokens: int | None, max_tokens: int) -> Generation:
    """One greedy /generate request of exactly `max_tokens` tokens."""
    fields = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if num_draft_tokens is not None:
        fields["num_draft_tokens"] = num_draft_tokens
    return http_generate(f"127.0.0.1:{port}", prompt, timeout_s=600, **fields)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("port_a", type=int, help="server A's HTTP port (the base)")
    parser.add_argument("port_b", type=int, help="server B's HTTP port")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    prompts = json.loads(PROMPTS.read_text())["prompts"]
    ports = {"A": args.port_a, "B": args.port_b}
    seconds, tokens, outputs = Counter(), Counter(), defaultdict(list)
    total = args.rounds * sum(map(len, prompts.values())) * len(MODES) * 2
    done, started = 0, time.monotonic()
    for r in range(args.rounds):
        order = "AB" if r % 2 == 0 else "BA"
        for family, texts in prompts.items():
            for text in texts:
                for mode, k in MODES.items():
                    for side in order:
                        result = generate(ports[side], text, k, args.max_tokens)
                        seconds[side, family, mode] += result.seconds
                        tokens[side, family, mode] += len(result.output_ids)
                        outputs[side, family, mode].append(result.output_ids)
                        done += 1
        left = (time.monotonic() - started) / done * (total - done)
        print(f"round {r + 1}/{args.rounds} done, about {left / 60:.1f} min left", flush=True)
    for family in prompts:
        cells = []
        for mode in MODES:
            a, b = (tokens[s, family, mode] / seconds[s, family, mode] for s in "AB")
            cells.append(f"{mode} A {a:6.1f} B {b:6.1f} tok/s B/A {b / a:.3f}")
        same = all(outputs["A", family, m] == outputs["B", family, m] for m in MODES)
        lossless = all(outputs[s, family, "plain"] == outputs[s, family, "speculative"] for s in "AB")
        print(f"{family:11s} " + " | ".join(cells) + f" | A == B: {same}, speculative == plain: {lossless}")


if __name__ == "__main__":
    main()
