"""Analyses: configs that compute tables and plots on the host instead of training.

A config file whose ``get_config()`` returns an `Analysis` makes ``shoal-run CONFIG
[--out DIR]`` call ``analysis.run(DIR)`` (default ``runs/<name>/``), which writes its
files there and returns a markdown summary; the runner writes it to ``DIR/summary.md``
and prints it. Examples: shape-level reproductions of a paper's tables, such as
Herring's Table III (``experiments/configs/herring_table3.py``), which need no workers.
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shoal.experiments.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Analysis:
    """A named host computation: ``run(out_dir)`` writes its files into ``out_dir`` (which
    exists) and returns the markdown summary."""

    name: str
    run: Callable[[Path], str]
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ConfigError(f"an analysis name must be a non-empty str without '/', got "
                              f"{self.name!r}")  # fmt: skip
        if not callable(self.run):
            raise ConfigError(f"analysis {self.name!r}: run must be callable, got {self.run!r}")


def run_analysis(analysis: Analysis, out: Path) -> str:
    """Run ``analysis`` into ``out`` (created if needed), write ``out/summary.md`` and
    return the summary."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = analysis.run(out)
    if not isinstance(summary, str):
        raise TypeError(f"analysis {analysis.name!r}: run must return the markdown summary "
                        f"(a str), got {type(summary).__name__}")  # fmt: skip
    (out / "summary.md").write_text(summary)
    return summary


def write_rows_csv(
    path: Path, rows: Sequence[dict[str, Any]], float_format: str | None = None
) -> None:
    """``rows`` (dicts with the same keys, in column order) as a CSV with a header; floats
    through ``float_format`` (e.g. ``"{:.4f}"``) when given."""

    def fmt(v):
        return float_format.format(v) if float_format and isinstance(v, float) else v

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows({k: fmt(v) for k, v in r.items()} for r in rows)


def markdown_table(heads: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """A markdown table; ``align`` has one letter per column, "r" (right) or "l" (left);
    columns without one are right-aligned."""
    marks = ["---" if align[i : i + 1] == "l" else "---:" for i in range(len(heads))]
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join(marks) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
