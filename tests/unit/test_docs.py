"""The README and the pages of docs/: every relative link reaches a file of the repository,
every #anchor a heading of its page (GitHub's anchors: lower case, punctuation dropped, spaces
to hyphens), and every repository path they name (`backends/...`, `scripts/...`, or
`serving/...` for backends/serving/) is there. And the sources cite what a reader can follow:
no path outside the repository, no section of a document the repository does not hold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")
# A repository path as the pages name it: from a top-level folder, or from one of backends/'s
# rooms (README's "one request's path" names `serving/target.TargetRunner`).
TOP = ("backends", "client", "kernels", "scripts", "tests", "deploy", "docs")
ROOMS = ("config", "methods", "runtime", "serving", "training", "triton_models")
REPO_PATH = re.compile(rf"(?<![\w./~-])((?:{'|'.join(TOP + ROOMS)})/[\w./-]*)")
# Citations a reader cannot follow: a file on the machine the code was written on (a work or
# home directory), or a numbered section of a reference document that is not in the repository.
UNFOLLOWABLE = re.compile(r"/work/|/home/|/root/|shared/reference|\w+_reference\.md|checkpoint_formats\.md|\u00a7\s?\d")
SOURCES = ("backends", "client", "kernels", "scripts", "tests", "docs", "deploy")


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


def named_paths(text: str) -> list[str]:
    """The repository paths `text` names, globs left out."""
    return [p.rstrip(".") for p in REPO_PATH.findall(text) if "*" not in p]


def resolves(path: str) -> bool:
    """A path of the repository, or of backends/ for a room's; `serving/drafting.DraftService`
    names backends/serving/drafting.py."""
    for base in (ROOT, ROOT / "backends"):
        module, _, _ = path.partition(".")
        if (base / path).exists() or (path.split("/")[0] in ROOMS and (base / f"{module}.py").exists()):
            return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_a_page_names_is_in_the_repository(page):
    missing = sorted({p for p in named_paths(page.read_text()) if not resolves(p)})
    assert not missing, f"{page.relative_to(ROOT)} names paths the repository does not have: {missing}"


def test_a_stale_path_is_caught():
    assert not resolves("scripts/bench_kernels_ab.py") and resolves("scripts/bench_runtime_ab.py")
    assert named_paths("run `scripts/bench_kernels_ab.py` or `serving/target.TargetRunner`") == [
        "scripts/bench_kernels_ab.py",
        "serving/target.TargetRunner",
    ]
    assert resolves("serving/target.TargetRunner") and not resolves("serving/targets.TargetRunner")


def source_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    for top in SOURCES:
        files += [p for p in (ROOT / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return [p for p in files if p != Path(__file__).resolve() and p.suffix not in (".safetensors", ".so", ".png")]


def test_sources_cite_only_what_a_reader_can_follow():
    cited = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in source_files()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if UNFOLLOWABLE.search(line)
    ]
    assert not cited, "cite the public source (vLLM's file at its commit, the paper, the spec):\n" + "\n".join(cited)
