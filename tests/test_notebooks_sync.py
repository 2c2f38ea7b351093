"""The committed notebooks/*.ipynb are what notebooks/build.py writes from their .py sources.

Users open the .ipynb, ruff and reviewers read the .py: an edit to one side only would let
them drift apart unseen. The fix for a failure here is ``make notebooks``.
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _load_build():
    # notebooks/ is not a package (and must not become one that pytest imports), so load
    # the build script by path, as `make notebooks` runs it.
    spec = importlib.util.spec_from_file_location("shoal_notebooks_build", NOTEBOOKS / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build()
SOURCES = build.sources()


def _cells(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in nb.cells]


def _describe(cells: list[tuple[str, str]]) -> list[str]:
    # One line per source line, each cell headed by its type, so a diff points at the cell.
    lines = []
    for i, (kind, source) in enumerate(cells):
        lines.append(f"--- cell {i} ({kind})")
        lines.extend(source.splitlines())
    return lines


def test_every_notebook_has_a_source():
    assert SOURCES, "no notebooks/NN_*.py sources found"
    built = {p.with_suffix(".ipynb").name for p in SOURCES}
    committed = {p.name for p in NOTEBOOKS.glob("*.ipynb")}
    assert committed == built, (
        f"without a source: {sorted(committed - built)}; not built: {sorted(built - committed)}"
    )


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_committed_notebook_matches_its_source(source):
    committed = nbformat.read(source.with_suffix(".ipynb"), as_version=4)
    want, got = _cells(build.build(source)), _cells(committed)
    if got != want:
        diff = difflib.unified_diff(
            _describe(want), _describe(got), f"{source.name} (built)", "committed", lineterm=""
        )
        pytest.fail(
            f"{source.with_suffix('.ipynb').name} differs from what {source.name} builds; "
            "run `make notebooks`:\n" + "\n".join(diff)
        )


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_committed_notebook_has_no_outputs(source):
    # Committed as built: a notebook saved from Jupyter after a run carries outputs.
    committed = nbformat.read(source.with_suffix(".ipynb"), as_version=4)
    ran = [
        i
        for i, cell in enumerate(committed.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    name = source.with_suffix(".ipynb").name
    assert not ran, f"{name}: outputs in cells {ran}; run `make notebooks`"
