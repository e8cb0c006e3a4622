"""Every relative link in the user docs (README.md, docs/*.md, benchmarks/README.md) points at a file
that exists, and a `#anchor` into a markdown file at one of its headings (GitHub's anchor rules)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))  # links inside code blocks are code
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {_shown(dest)}")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{frag} in {_shown(dest)}")
    return broken


def test_the_pages_exist_and_have_links():
    assert (ROOT / "docs").is_dir() and len(PAGES) >= 10
    assert sum(len(LINK.findall(p.read_text(encoding="utf-8"))) for p in PAGES) > 50


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_a_broken_link_and_a_wrong_anchor_are_found(tmp_path):
    (tmp_path / "other.md").write_text("# A heading (`x.py`)\n\n## Settings: two words\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-heading-xpy) [ok](other.md#settings-two-words) [web](https://example.org)\n"
        "[gone](missing.md) [bad](other.md#no-such-heading) ![img](img/none.png)\n"
        "```\n[in code](not-checked.md)\n```\n"
    )
    found = broken_links(page)
    assert [f.split(":")[0] for f in found] == ["missing.md", "other.md#no-such-heading", "img/none.png"]
