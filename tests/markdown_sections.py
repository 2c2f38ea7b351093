"""Sections and code blocks of the project's Markdown: README.md and the pages under docs/
that hold its longer sections (docs/guide/*.md, docs/experiments/*.md, docs/layout.md), for
the tests that run their examples or compare them with the files they show."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# The pages README.md's sections moved to: their code and paths are checked as the README's were.
MOVED = (
    sorted((ROOT / "docs" / "guide").glob("*.md"))
    + sorted((ROOT / "docs" / "experiments").glob("*.md"))
    + [ROOT / "docs" / "layout.md"]
)


def section(path: Path | str, title: str) -> str:
    """The section of the Markdown file ``path`` (from the repository root) headed ``title``
    at any level (``# title`` is a page's own title), up to the next heading of its level
    or above outside a code fence, heading included; `KeyError` if there is none."""
    out: list[str] = []
    level = 0
    fence = None
    for line in (ROOT / path).read_text().splitlines():
        heading = re.match(r"(#{1,6}) (.*)$", line) if fence is None else None
        if out and heading and len(heading.group(1)) <= level:
            break
        if not out and heading and heading.group(2) == title:
            level = len(heading.group(1))
        if level:
            out.append(line)
            stripped = line.lstrip()
            if stripped.startswith(("```", "~~~")):
                fence = None if fence == stripped[:3] else (fence or stripped[:3])
    if not out:
        raise KeyError(f"{path} has no section '{title}'")
    return "\n".join(out) + "\n"


def python_blocks(text: str) -> list[str]:
    """The code of every ```python block of a Markdown text, in order."""
    return re.findall(r"```python\n(.*?)```", text, re.S)
