"""The documentation's links resolve, and its pages stay short.

README.md, BENCHMARKS.md and docs/*.md link to each other by relative paths
and heading anchors; a page split or a renamed heading that breaks one fails
here instead of on GitHub. Anchors follow GitHub's rule: the heading
lower-cased, punctuation other than '-' and '_' dropped, spaces to '-'.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Set

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES: List[Path] = [ROOT / "README.md", ROOT / "BENCHMARKS.md"] + sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
MAX_PAGE_LINES = 450  # one topic a page (docs/); README is the front door


def anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> Set[str]:
    prose = FENCE.sub("", page.read_text())
    return {anchor(line.lstrip("#")) for line in prose.splitlines() if line.startswith("#")}


def test_pages_found() -> None:
    assert (ROOT / "docs" / "README.md").exists()
    assert len(PAGES) > 5


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page: Path) -> None:
    known: Dict[Path, Set[str]] = {}
    broken = []
    for link in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto: not checked offline
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page.resolve()
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif fragment and target.suffix == ".md":
            if fragment not in known.setdefault(target, anchors(target)):
                broken.append(f"{link} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_docs_pages_are_short(page: Path) -> None:
    lines = page.read_text().count("\n")
    assert lines <= MAX_PAGE_LINES, f"docs/{page.name} has {lines} lines: split it by topic"


def test_every_page_is_indexed() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md")
               if p.name != "README.md" and f"]({p.name})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


def test_docs_pages_named_in_code_exist() -> None:
    """Docstrings, error messages and examples name docs pages by path: each must exist."""
    named = re.compile(r"docs/([\w\-]+\.md)")
    missing = set()
    for folder in ("src", "examples", "benchmarks", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            for page in named.findall(path.read_text()):
                if not (ROOT / "docs" / page).exists():
                    missing.add(f"{path.relative_to(ROOT)}: docs/{page}")
    assert not missing, f"no such docs page: {sorted(missing)}"
