"""Time to first token with and without prefix caching: a long document question, the same
request again, and the chat's next turn (the first answer and a new question appended).

Each repeat starts its prompt with a fresh tag, so only its own earlier requests can be
cached. Run against servers started each way (one at a time, on a quiet machine):

    tritonspec serve --no-speculation --no-enable-prefix-caching   # then, in another shell:
    .venv/bin/python scripts/bench_prefix_cache.py --url localhost:8001

`--speculate` lets the server draft, so a model drafter's own pass over the prompt counts too
(`tritonspec serve --profile qwen-coder`; `--sections 15` keeps a 1.5B target's prefill short).
"""

from __future__ import annotations

import argparse
import time

from client.api.triton import Generation, grpc_generate


def document(sections: int) -> str:
    return " ".join(
        f"Section {i}: the reactor cooling loop {i} carries water at {20 + i} degrees to exchanger {i % 7}."
        for i in range(sections)
    )


def first_token_ms(url: str, prompt: str, speculate: bool) -> tuple[float, Generation]:
    start, first = time.perf_counter(), []
    generation = grpc_generate(
        url,
        prompt,
        max_tokens=32,
        ignore_eos=True,
        on_text=lambda _: first or first.append(time.perf_counter()),
        **({} if speculate else {"num_draft_tokens": 0}),
    )
    return (first[0] - start) * 1e3, generation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="localhost:8001", help="the server's gRPC address")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sections", type=int, default=60, help="document length (60: ~1450 tokens)")
    parser.add_argument("--speculate", action="store_true", help="let the server draft (default: plain)")
    args = parser.parse_args()
    for _ in range(args.repeats):
        question = f"[{time.time()}] {document(args.sections)}\nQuestion: which exchanger does loop 12 feed?"
        first, answer = first_token_ms(args.url, question, args.speculate)
        again, _ = first_token_ms(args.url, question, args.speculate)
        turn, _ = first_token_ms(args.url, question + answer.text + "\nQuestion: and loop 30?", args.speculate)
        print(
            f"prompt of {answer.num_input_tokens} tokens: first request {first:.0f} ms, "
            f"same prompt again {again:.0f} ms, next turn {turn:.0f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
