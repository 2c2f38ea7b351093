"""The contract table (tests/contract_table.py) is complete: every transformation factory
`shoal.optim` exports has a row, so none escapes the contracts (the non-finite one
included), and every row either has a case for each contract or says why not."""

import inspect
from pathlib import Path

import pytest
from contract_table import ROWS, TABLE, public_factories, public_helpers

import shoal.optim as optim


def test_every_public_factory_has_a_row():
    assert len(TABLE) == len(ROWS)  # one row per name
    assert set(TABLE) == public_factories()


def test_every_exported_function_says_what_it_returns():
    # The table's completeness rests on return annotations: a factory is an exported
    # function annotated to return a GradientTransformation, the rest (noise_scale,
    # partial_exchange_bins, update_and_apply...) read or run one. An unannotated function could
    # be a factory without a row.
    for name in public_factories() | public_helpers():
        returns = inspect.signature(getattr(optim, name)).return_annotation
        assert returns is not inspect.Signature.empty, f"{name} has no return annotation"
    assert public_helpers() and not public_helpers() & set(TABLE)


def test_every_exported_state_is_a_rows_state():
    states = {name for name in optim.__all__ if name.endswith("State")}
    assert states == {row.state.__name__ for row in ROWS}
    for row in ROWS:
        assert getattr(optim, row.state.__name__) is row.state


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_every_row_has_a_case_or_a_reason(row):
    for field in ("nonfinite", "parabola", "inject"):
        case = getattr(row, field)
        if isinstance(case, str):
            assert len(case) > 20, f"{row.name}.{field}: say why there is no case"
        else:
            assert case is not None
    assert row.skip_in_place in (None, True, False, "apply")
    # wraps: the factory's first parameter is the inner optimizer.
    first = next(iter(inspect.signature(row.factory).parameters))
    assert (first == "inner") == row.wraps, (row.name, first)


def test_only_the_wrapper_escapes_the_nonfinite_contract():
    assert [row.name for row in ROWS if isinstance(row.nonfinite, str)] == ["skip_nonfinite"]


def test_the_shard_map_job_runs_every_row():
    # tests/jobs/mesh_cases.py (run by tests/test_shard_map.py in a process of its own,
    # on 8 host devices) builds its cases by hand: each row's factory must be among them.
    source = (Path(__file__).parent / "jobs" / "mesh_cases.py").read_text()
    missing = [row.name for row in ROWS if f"optim.{row.name}(" not in source]
    assert not missing, f"tests/jobs/mesh_cases.py runs no case of {missing}"
