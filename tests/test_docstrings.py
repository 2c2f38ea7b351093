"""Public docstrings stand on their own: sections present, examples run (doctest)."""

from __future__ import annotations

import doctest
import inspect

import pytest
from contract_table import TABLE

import shoal.comms as comms
import shoal.kernels as kernels
import shoal.optim as optim
import shoal.optim.helpers as helpers
from shoal.comms.axis import AxisCollective

# The exported functions of shoal.optim and of its helpers' namespace (take_raised is the
# runner's, a one-line accessor).
OPTIM_PUBLIC = {name: getattr(optim, name) for name in optim.__all__}
OPTIM_PUBLIC |= {name: getattr(helpers, name) for name in helpers.__all__ if name != "take_raised"}
FUNCTIONS = sorted(name for name, obj in OPTIM_PUBLIC.items() if inspect.isfunction(obj))
METHODS = sorted(
    name
    for name, member in vars(AxisCollective).items()
    if inspect.isfunction(member) and not name.startswith("_")
)


def _sections(doc: str) -> set[str]:
    return {line.strip() for line in doc.splitlines() if line.strip().endswith(":")}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_optim_docstring_sections(name):
    doc = inspect.getdoc(OPTIM_PUBLIC[name])
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


@pytest.mark.parametrize("name", sorted(TABLE))
def test_factory_docstring_names_its_state(name):
    # The factories are the contract table's rows (tests/contract_table.py); the other
    # exported functions read or run a transformation.
    doc = inspect.getdoc(TABLE[name].factory)
    returns = doc.split("Returns:")[1].split("Example:")[0]
    assert TABLE[name].state.__name__ in returns, f"{name}'s Returns does not name its state"


@pytest.mark.parametrize("name", FUNCTIONS)
def test_optim_docstring_example_runs(name):
    obj = OPTIM_PUBLIC[name]
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


# shoal.comms and shoal.kernels: every public function and class (constants excluded).
PUBLIC = sorted(
    (module.__name__, name)
    for module in (comms, kernels)
    for name in module.__all__
    if inspect.isfunction(getattr(module, name)) or inspect.isclass(getattr(module, name))
)
# Only usable under mpiexec: their Example is shown but skipped by doctest.
MPI_ONLY = {"MPICollective", "ParameterServers"}


def _public(module_name: str, name: str):
    return getattr(comms if module_name == comms.__name__ else kernels, name)


def _takes_args(obj) -> bool:
    try:
        parameters = inspect.signature(obj).parameters.values()
    except ValueError:
        return False
    named = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return any(p.kind not in named and p.name != "self" for p in parameters)


@pytest.mark.parametrize(("module_name", "name"), PUBLIC)
def test_comms_kernels_docstring_sections(module_name, name):
    obj = _public(module_name, name)
    doc = inspect.getdoc(obj)
    assert doc, f"{name} has no docstring"
    lines = doc.splitlines()
    one_line = lines[0].strip() and (len(lines) == 1 or not lines[1].strip())
    assert one_line, f"{name}: the docstring must open with a one-line summary"
    sections = _sections(doc)
    required = ["Example:"]
    if _takes_args(obj):
        required.append("Args:")
    if inspect.isfunction(obj):
        required.append("Returns:")
    for section in required:
        assert section in sections, f"{name}'s docstring has no {section} section"
    assert ">>>" in doc, f"{name}'s Example has no doctest"
    if name in MPI_ONLY:
        assert "+SKIP" in doc, f"{name}'s MPI example must be marked doctest: +SKIP"
    for pointer in ("above", "module docstring"):
        assert pointer not in doc, f"{name}'s docstring points to text it does not contain"


@pytest.mark.parametrize(("module_name", "name"), PUBLIC)
def test_comms_kernels_docstring_example_runs(module_name, name):
    obj = _public(module_name, name)
    tests = doctest.DocTestFinder(recurse=False).find(obj, name, globs={})
    assert tests and tests[0].examples, f"{name} has no doctest examples"
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} doctest example(s) failed"
    if name not in MPI_ONLY:
        assert result.attempted > 0


@pytest.mark.parametrize(
    ("module", "examples"),
    [
        ("shoal.checks", 2),
        ("shoal.dtypes", 2),
        ("shoal.experiments.config", 2),
        # Where an algorithm's hyper-parameters live, and how a new one is written.
        ("shoal.experiments.algorithms", 2),
        ("shoal.experiments.algorithms._registry", 2),
        ("shoal.experiments.algorithms.parts", 2),
        ("shoal.experiments.algorithms.renamed", 1),
    ],
)
def test_module_docstring_examples_run(module, examples):
    # What a newcomer reads first: help(Config), and the check every layer shares.
    import importlib

    result = doctest.testmod(
        importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE
    )
    assert result.failed == 0 and result.attempted >= examples
