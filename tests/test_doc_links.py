"""Every relative link in the README, docs/ and the chart README points at a file that exists,
and every `#anchor` into a markdown file names one of its headings (GitHub's slugs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
        REPO / "helm" / "rollout-sidecar" / "README.md"]


def prose(md: Path) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", md.read_text(), flags=re.S | re.M)


def anchors(md: Path) -> set[str]:
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#+ (.*)$", prose(md), re.M)
    }


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(doc)):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, fragment = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no such heading")
    assert not broken, broken
