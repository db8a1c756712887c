"""Training prompts for drafter heads, built from what every machine has: a fixed list of
chat instructions and topics written here, and functions of the Python standard library.

The target answers these prompts itself (`data.py`), so a head learns the target's own
greedy continuations. The benchmark prompts (`client/data/bench_prompts.json`) are the
held-out evaluation set: `check_held_out` refuses a training prompt that shares a run of
words with any of them.
"""

from __future__ import annotations

import ast
import functools
import json
import random
import re
import sysconfig
from pathlib import Path

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
BENCH_PROMPTS = Path(__file__).resolve().parents[2] / "client" / "data" / "bench_prompts.json"

TOPICS = [
    "photosynthesis",
    "volcanoes",
    "the water cycle",
    "compound interest",
    "black holes",
    "the printing press",
    "vaccines",
    "plate tectonics",
    "the internet",
    "honey bees",
    "electric cars",
    "the moon landing",
    "recycling",
    "the human heart",
    "rainbows",
    "solar panels",
    "the Roman aqueducts",
    "coral reefs",
    "machine learning",
    "the stock market",
    "earthquakes",
    "the immune system",
    "bicycles",
    "chess",
    "the ancient pyramids",
    "climate change",
    "sleep",
    "coffee",
    "the periodic table",
    "democracy",
    "tides",
    "bread baking",
    "friction",
    "the speed of light",
    "migratory birds",
    "batteries",
    "the Renaissance",
    "gravity",
    "supply and demand",
    "rain forests",
    "password security",
    "glaciers",
    "the telephone",
    "meditation",
    "DNA",
    "wind turbines",
    "inflation",
    "the Olympic games",
    "octopuses",
    "magnets",
    "the Silk Road",
    "deserts",
    "public libraries",
    "thunderstorms",
    "compilers",
    "the metric system",
    "origami",
    "time zones",
    "recursion",
    "sourdough",
    "satellites",
    "the violin",
    "penguins",
    "antibiotics",
    "opera",
    "lighthouses",
    "spreadsheets",
    "fungi",
    "the Great Wall of China",
    "typewriters",
    "open source software",
    "clouds",
    "bridges",
    "trains",
]

INSTRUCTIONS = [
    "Explain {} in simple terms.",
    "Give me three facts about {}.",
    "Write a short paragraph about {}.",
    "What are the pros and cons of {}?",
    "Summarize what you know about {} in two sentences.",
    "Why is {} important?",
    "Write a haiku about {}.",
    "Describe {} to someone who has never heard of it.",
    "List five words related to {}.",
    "What is a common misconception about {}?",
    "Write a short story that involves {}.",
    "How would you teach a child about {}?",
    "Give a one-sentence definition of {}.",
    "What questions would a student ask about {}?",
]

COUNTRIES = [
    ("Spain", "Madrid"),
    ("Germany", "Berlin"),
    ("Japan", "Tokyo"),
    ("Canada", "Ottawa"),
    ("Egypt", "Cairo"),
    ("Brazil", "Brasilia"),
    ("Norway", "Oslo"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Greece", "Athens"),
    ("Poland", "Warsaw"),
    ("Chile", "Santiago"),
]

ITEMS = [
    "carrot",
    "violin",
    "maple",
    "granite",
    "teapot",
    "comet",
    "lantern",
    "walnut",
    "harbor",
    "pepper",
    "saddle",
    "meadow",
    "copper",
    "pillow",
    "falcon",
    "ribbon",
    "canyon",
    "pebble",
    "tulip",
    "anchor",
]

# Standard-library modules whose documented functions become code prompts.
CODE_MODULES = [
    "textwrap",
    "statistics",
    "fractions",
    "heapq",
    "bisect",
    "calendar",
    "shutil",
    "glob",
    "fnmatch",
    "difflib",
    "ipaddress",
    "colorsys",
    "base64",
    "html/__init__",
    "random",
    "posixpath",
    "string",
    "csv",
    "json/__init__",
    "quopri",
    "shlex",
    "tokenize",
    "copy",
    "functools",
    "operator",
    "filecmp",
    "gettext",
    "locale",
    "mimetypes",
    "netrc",
    "ntpath",
    "pprint",
    "secrets",
    "uuid",
    "zipfile/__init__",
    "tarfile",
    "imghdr",
    "wave",
    "plistlib",
    "urllib/parse",
    "email/utils",
]


# How the target's own requests begin (`data.self_written_prompts`): a spread of openings
# keeps sampled requests from collapsing onto the few the model likes best.
OPENINGS = [
    "Write a Python function",
    "Write a Python script",
    "How do I",
    "How can I",
    "What is",
    "What are",
    "Explain",
    "Can you explain",
    "Can you help me",
    "Give me",
    "Why do",
    "Why is",
    "Write a short",
    "Summarize",
    "List",
    "Compare",
    "Describe",
    "Create a",
    "I'm trying to",
    "I need",
    "What's the difference",
    "Suggest",
    "Tell me about",
    "Write an email",
    "Write a poem",
    "Help me write",
    "Is it true that",
    "Rewrite",
    "Translate",
    "Fix this Python code:",
    "What happens when",
    "Plan",
    "Write a story",
    "In Python,",
    "Write a function that",
    "Outline",
    "Which",
    "When should I",
    "Teach me",
]


def chat_prompts(rng: random.Random) -> list[str]:
    prompts = [CHAT.format(i.format(t)) for t in TOPICS for i in INSTRUCTIONS]
    for (country, capital), (other, _) in zip(COUNTRIES, COUNTRIES[1:] + COUNTRIES[:1]):
        prompts.append(
            CHAT.format(f"Which city is the capital of {country}?")
            + f"{capital} is the capital city of {country}.<|im_end|>\n"
            + CHAT.format(f"Now {other}, please, in the same form.")
        )
    for _ in range(40):
        words = rng.sample(ITEMS, 6)
        task = rng.choice(
            [
                "Sort this list alphabetically",
                "Rewrite this list in capital letters",
                "Write one sentence using each of these words",
                "Number these items",
            ]
        )
        prompts.append(CHAT.format(f"{task}: {', '.join(words)}."))
    return prompts


def code_prompts(rng: random.Random) -> list[str]:
    """For each documented public function: its header and docstring line as a completion
    prompt, and a chat request to write it."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for name in CODE_MODULES:
        path = stdlib / f"{name}.py"
        if not path.exists():
            continue  # modules come and go between Python versions
        source = path.read_text(encoding="utf-8", errors="replace")
        lines = source.splitlines()
        for node in ast.parse(source).body:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if not doc or node.name.startswith("_"):
                continue
            summary = doc.strip().splitlines()[0].strip()
            header = "\n".join(lines[node.lineno - 1 : node.body[0].lineno - 1])
            if rng.random() < 0.5:
                prompts.append(f'{header}\n    """{summary}"""\n')
            else:
                args = ", ".join(a.arg for a in node.args.args)
                prompts.append(
                    CHAT.format(f"Write a Python function {node.name}({args}). It should do this: {summary}")
                )
    return prompts


def document_prompts(rng: random.Random) -> list[str]:
    """Questions about a paragraph to quote from (module docstrings as documents)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for name in CODE_MODULES:
        path = stdlib / f"{name}.py"
        doc = (
            ast.get_docstring(ast.parse(path.read_text(encoding="utf-8", errors="replace"))) if path.exists() else None
        )
        if not doc or len(doc) < 120:
            continue
        question = rng.choice(
            [
                "What is this document about?",
                "Summarize the document in one sentence.",
                "Which functions or terms does the document mention?",
            ]
        )
        prompts.append(
            "<|im_start|>system\nReply from the given text only, citing its words.<|im_end|>\n"
            + CHAT.format(f"Document: {doc[:600]}\nQuestion: {question}")
        )
    return prompts


def training_prompts(limit: int | None = None, seed: int = 0) -> list[str]:
    """The fixed, shuffled training prompt list (chat, code, documents)."""
    rng = random.Random(seed)
    prompts = chat_prompts(rng) + code_prompts(rng) + document_prompts(rng)
    rng.shuffle(prompts)
    return prompts[:limit] if limit else prompts


def _shingles(text: str, n: int = 6) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", re.sub(r"<\|im_(start|end)\|>(system|user|assistant)?", " ", text).lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@functools.cache
def _held_out_shingles() -> frozenset[tuple[str, ...]]:
    bench = json.loads(BENCH_PROMPTS.read_text())["prompts"]
    return frozenset().union(*(_shingles(p) for ps in bench.values() for p in ps))


def overlaps_held_out(prompt: str) -> set[tuple[str, ...]]:
    """The six-word runs `prompt` shares with the benchmark prompts (empty: none)."""
    return _shingles(prompt) & _held_out_shingles()


def check_held_out(prompts: list[str]) -> None:
    """Refuse training prompts that share six consecutive words with a benchmark prompt."""
    for prompt in prompts:
        shared = overlaps_held_out(prompt)
        if shared:
            raise ValueError(
                f"training prompt overlaps the held-out benchmark prompts ({' '.join(min(shared))!r}): {prompt[:80]!r}"
            )
