"""The README and the pages of docs/: every relative link reaches a file of the repository, and
every #anchor a heading of its page (GitHub's anchors: lower case, punctuation dropped, spaces
to hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")


def outside_code(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(re.sub(r"`[^`]*`", "", line) if not line.startswith("#") else line)
    return lines


def anchors(page: Path) -> set[str]:
    headings = [line.lstrip("#").strip() for line in outside_code(page.read_text()) if re.match(r"#{1,6} ", line)]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def links(page: Path) -> list[str]:
    return [m for line in outside_code(page.read_text()) for m in LINK.findall(line) if "://" not in m]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_of_a_page_reaches_a_file_and_a_heading(page):
    for target in links(page):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target} names no file"
        if anchor:
            assert anchor in anchors(linked), f"{page.name}: {target} names no heading of {linked.name}"


def test_the_readme_indexes_every_page_of_docs():
    indexed = {(ROOT / target).resolve() for target in links(ROOT / "README.md")}
    assert set(PAGES[1:]) <= indexed, sorted(p.name for p in set(PAGES[1:]) - indexed)
