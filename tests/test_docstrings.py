"""Public docstrings stand on their own: sections present, examples run (doctest)."""

from __future__ import annotations

import doctest
import inspect

import pytest

import shoal.optim as optim
from shoal.comms.axis import AxisCollective

FUNCTIONS = sorted(name for name in optim.__all__ if inspect.isfunction(getattr(optim, name)))
# Factories return a GradientTransformation; the rest are helpers that read one.
HELPERS = {"noise_scale", "peer_permutation", "pgx_partition"}
METHODS = sorted(
    name
    for name, member in vars(AxisCollective).items()
    if inspect.isfunction(member) and not name.startswith("_")
)


def _sections(doc: str) -> set[str]:
    return {line.strip() for line in doc.splitlines() if line.strip().endswith(":")}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_optim_docstring_sections(name):
    doc = inspect.getdoc(getattr(optim, name))
    assert doc, f"{name} has no docstring"
    lines = doc.splitlines()
    one_line = lines[0].strip() and (len(lines) == 1 or not lines[1].strip())
    assert one_line, f"{name}: the docstring must open with a one-line summary"
    sections = _sections(doc)
    for section in ("Args:", "Returns:", "Example:", "References:"):
        assert section in sections, f"{name}'s docstring has no {section} section"
    assert ">>>" in doc, f"{name}'s Example has no doctest"
    # help() shows only this docstring: no pointers to equations it does not contain.
    assert "above" not in doc, f"{name}'s docstring refers to text above it"


@pytest.mark.parametrize("name", FUNCTIONS)
def test_optim_docstring_example_runs(name):
    obj = getattr(optim, name)
    tests = doctest.DocTestFinder(recurse=False).find(obj, name, globs={})
    assert tests and tests[0].examples, f"{name} has no doctest examples"
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} doctest example(s) failed"
    assert result.attempted > 0


@pytest.mark.parametrize("name", METHODS)
def test_axis_collective_docstrings(name):
    method = getattr(AxisCollective, name)
    doc = inspect.getdoc(method)
    assert doc, f"AxisCollective.{name} has no docstring"
    sections = _sections(doc)
    assert "Returns:" in sections, f"AxisCollective.{name} has no Returns section"
    takes_args = len(inspect.signature(method).parameters) > 1  # beyond self
    if takes_args:
        assert "Args:" in sections, f"AxisCollective.{name} has no Args section"
