"""Time to first token with and without prefix caching: a long document question, the same
request again, and the chat's next turn (the first answer and a new question appended).

Each repeat starts its prompt with a fresh tag, so only its own earlier requests can be
cached. Run against servers started each way (one at a time, on a quiet machine):

    tritonspec serve --no-speculation --no-enable-prefix-caching   # then, in another shell:
    .venv/bin/python scripts/bench_prefix_cache.py --url localhost:8001
"""

from __future__ import annotations

import argparse
import time

from client.api.triton import Generation, grpc_generate

DOCUMENT = " ".join(
    f"Section {i}: the reactor cooling loop {i} carries water at {20 + i} degrees to exchanger {i % 7}."
    for i in range(60)
)


def first_token_ms(url: str, prompt: str) -> tuple[float, Generation]:
    start, first = time.perf_counter(), []
    generation = grpc_generate(
        url,
        prompt,
        max_tokens=32,
        ignore_eos=True,
        num_draft_tokens=0,
        on_text=lambda _: first or first.append(time.perf_counter()),
    )
    return (first[0] - start) * 1e3, generation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="localhost:8001", help="the server's gRPC address")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.repeats):
        question = f"[{time.time()}] {DOCUMENT}\nQuestion: which exchanger does loop 12 feed?"
        first, answer = first_token_ms(args.url, question)
        again, _ = first_token_ms(args.url, question)
        turn, _ = first_token_ms(args.url, question + answer.text + "\nQuestion: and loop 30?")
        print(
            f"prompt of {answer.num_input_tokens} tokens: first request {first:.0f} ms, "
            f"same prompt again {again:.0f} ms, next turn {turn:.0f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
