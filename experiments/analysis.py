"""Analyses: configs that compute tables and plots on the host instead of training.

A config file whose ``get_config()`` returns an `Analysis` makes ``shoal-run CONFIG
[--out DIR]`` call ``analysis.run(DIR)`` (default ``runs/<name>/``), which writes its
files there and returns a markdown summary; the runner writes it to ``DIR/summary.md``
and prints it. Examples: shape-level reproductions of a paper's tables, such as
Herring's Table III (``experiments/configs/herring_table3.py``), which need no workers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

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
