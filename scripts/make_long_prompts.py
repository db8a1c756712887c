"""Build client/data/long_prompts.json: the long-context benchmark prompts (`tritonspec bench
--prompt-set long`), from this repository's own documentation and sources (Apache-2.0), so the
project may ship them.

Four shapes, two prompts each, sized in SmolLM2's tokens (the default model's tokenizer):
- `rag-2k`, `rag-8k`: a document of ~1.9k / ~7.6k tokens and a question about it (an 8k prompt
  plus 128 answer tokens still fits SmolLM2's 8192-token window);
- `code-edit`: a source file and an edit request whose answer repeats most of the file (where
  prompt lookup and suffix decoding shine);
- `chat-30`: a 30-turn chat whose answers quote the documentation's paragraphs, then a
  question about an early turn.

The texts are a snapshot: the file keeps them, so later edits of the docs do not change the
benchmark. Run it again (and bump `version`) only to change the prompts:

    .venv/bin/python scripts/make_long_prompts.py [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "client" / "data" / "long_prompts.json"
VERSION = "long-1"


def turn(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def trimmed(tok, text: str, tokens: int) -> str:
    """`text` cut at a line end so that it has at most `tokens` tokens."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= tokens:
        return text
    cut = tok.decode(ids[:tokens])
    return cut[: cut.rfind("\n")] if "\n" in cut else cut


def rag(tok, doc: str, tokens: int, question: str) -> str:
    return (
        turn("system", "Answer using the document. Quote it where you can.")
        + turn("user", f"Document:\n{trimmed(tok, (ROOT / doc).read_text(), tokens)}\n\nQuestion: {question}")
        + "<|im_start|>assistant\n"
    )


def code_edit(path: str, request: str) -> str:
    source = (ROOT / path).read_text()
    return (
        turn("user", f"Here is `{path}`:\n```python\n{source}```\n{request} Answer with the whole file.")
        + "<|im_start|>assistant\n```python\n"
    )


def paragraphs(doc: str) -> list[tuple[str, str]]:
    """(its first words, its first two sentences) for each prose paragraph of a Markdown page."""
    out = []
    for paragraph in (ROOT / doc).read_text().split("\n\n"):
        text = " ".join(paragraph.split()).lstrip("-* ")
        if len(text) < 200 or text.startswith(("#", "|", "```", "<")):
            continue
        sentences = re.split(r"(?<=[.!?])\s", text, maxsplit=2)
        out.append((" ".join(text.split()[:6]).strip("*`:,"), " ".join(sentences[:2])))
    return out


def chat(docs: list[str], turns: int, back_to: int) -> str:
    pairs = [pair for doc in docs for pair in paragraphs(doc)][:turns]
    if len(pairs) < turns:
        raise SystemExit(f"{docs} have {len(pairs)} paragraphs, not {turns}")
    text = "".join(turn("user", f"Tell me about '{h}...', briefly.") + turn("assistant", s) for h, s in pairs)
    return (
        text
        + turn("user", f"Back to '{pairs[back_to][0]}...': explain it again in more detail, with an example.")
        + "<|im_start|>assistant\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache/tritonspec/models/smollm2-135m"))
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = {
        "rag-2k": [
            rag(tok, "docs/serving-under-load.md", 1900, "How does chunked prefill keep other streams moving?"),
            rag(tok, "docs/deployment.md", 1900, "Which endpoints must not be exposed, and why?"),
        ],
        "rag-8k": [
            rag(tok, "docs/runtime.md", 7600, "What does batch invariance guarantee, and what does it cost?"),
            rag(tok, "docs/configuration.md", 7600, "How do I configure a draft tree for EAGLE-3?"),
        ],
        "code-edit": [
            code_edit("backends/serving/adaptive.py", "Rename the class `StepCost` to `StepTimer` everywhere."),
            code_edit("backends/serving/tree.py", "Add a one-line docstring to every function that has none."),
        ],
        "chat-30": [
            chat(["docs/runtime.md", "docs/serving-under-load.md", "docs/gpu.md", "docs/deployment.md"], 30, 3),
            chat(["docs/configuration.md", "docs/model-repository.md", "docs/training.md"], 30, 5),
        ],
    }
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    data = {
        "version": VERSION,
        "note": "Long-context benchmark prompts built by scripts/make_long_prompts.py from this repository's "
        f"docs and sources at commit {commit.strip()} (Apache-2.0). Change the version when a prompt changes.",
        "prompts": prompts,
    }
    OUT.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    for category, texts in prompts.items():
        sizes = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
        print(f"{category:10} prompt tokens {sizes}")
    print(f"written: {OUT}")


if __name__ == "__main__":
    main()
