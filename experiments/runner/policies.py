"""Closed-loop adaptation of the synchronisation, the step KungFu's thesis left manual.

A `Policy` maps the monitored metrics of the steps so far (the runner's per-step records:
``loss``, ``bytes_sent``, ``noise_scale``, ...) to new values of an algorithm's
hyper-parameters, e.g. a partial-exchange fraction. The runner asks it after every step
it says is ``due``; when it answers with a change, the runner rebuilds the algorithm with
the new values, keeps the parameters and every part of the optimizer state whose structure
did not change (e.g. the local optimizer's momentum), and logs the change in that step's
record (``"policy"``).

An algorithm gives its policy at registration (``register(..., policy=Policy(...))``); the
adaptive algorithm's is in `shoal.experiments.algorithms.adaptive`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

Decision = dict[str, Any] | None


@dataclasses.dataclass(frozen=True)
class Policy:
    """``due(step, params)``: whether to ask after ``step``; ``decide(records, params)``:
    the changes to make to the algorithm's hyper-parameters ``params`` now, or None.
    ``records`` are this run's per-step records so far (on the root; the runner sends the
    answer to every worker), ``params`` the hyper-parameters it currently runs with."""

    due: Callable[[int, Any], bool]
    decide: Callable[[Sequence[dict[str, Any]], Any], Decision]


def describe(changes: dict[str, Any]) -> str:
    """``{"a": 1, "b": "x"}`` -> ``"a=1;b=x"`` (the metrics' ``policy`` field)."""
    return ";".join(f"{k}={v}" for k, v in changes.items())
