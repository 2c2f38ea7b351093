"""Write each notebook here (``01_tour.ipynb``, ...) from its source (``01_tour.py``, ...).

The sources are jupytext percent-format scripts (``# %%`` code cells, ``# %% [markdown]``
cells), so ruff lints and formats the notebooks' code like the rest of the project. Edit a
source, then run ``make notebooks`` (or ``.venv/bin/python notebooks/build.py``). The
.ipynb, what a user opens in Jupyter, are committed with empty outputs;
``tests/test_notebooks_sync.py`` fails when one differs from what its source builds. The
docs build executes them top to bottom as they are, into the site's tutorials (``make
docs``, in ``make test``; ``make test-nb`` runs them alone): each has one size, small
enough to run in about a minute.
"""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat

HERE = Path(__file__).resolve().parent

KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def sources() -> list[Path]:
    """The notebook sources, ``NN_name.py`` (not this file)."""
    return sorted(HERE.glob("[0-9][0-9]_*.py"))


def build(source: Path) -> nbformat.NotebookNode:
    nb = jupytext.read(source, fmt="py:percent")
    for i, cell in enumerate(nb.cells):
        # jupytext's hints on blank lines between cells are layout of the .py, not content
        cell.metadata = {}
        cell.id = f"{source.stem}-{i:02d}"  # stable ids: a rebuild changes nothing
    # No jupytext metadata either: the .ipynb is not paired, the .py is its only source.
    nb.metadata = {"kernelspec": KERNELSPEC, "language_info": {"name": "python"}}
    nbformat.validate(nb)
    return nb


def main() -> None:
    for source in sources():
        target = source.with_suffix(".ipynb")
        nbformat.write(build(source), target)
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
