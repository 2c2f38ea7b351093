"""Simulated workers taking turns: steps that exchange nothing, traced for one worker at a
time instead of under ``vmap`` (`in_turn`).

Between two exchanges a DiLoCo worker trains alone. Run under ``vmap``, the ``N``
workers' local steps work on ``N`` models, optimizer states and activations at once, and
once these outgrow the caches every step pays for it (the 1M-parameter MLP of
``benchmarks/sim_vs_jax_peer.py`` at 16 workers: 1.2x the time of 16 one-worker steps).
Run in turn (a loop over the workers, each scanning its own local steps) each worker's
working set is one worker's, as on a machine of its own.

Inside ``with in_turn(collective, rank):``, at trace time, the `AxisCollective` over
``collective``'s axis stands for worker ``rank`` alone:

* ``rank()`` is ``rank``, ``simulated()`` is True and ``size`` is still ``N``;
* ``uniform(x)`` is ``x``: the caller's promise that it is the same on every worker;
* every exchange (all-reduce, all-gather, all-to-all, reduce-scatter, broadcast,
  ppermute) raises `TurnError`: the schedule that called the step local was wrong, and
  one worker cannot reduce over the others.

A transformation whose exchange hides behind a branch on its step counter (DiLoCo's
outer step) asks `taking_turns`, leaves the branch out and hands its predicate to
`leave_out`: if the schedule was wrong and the exchange was due after all, the program
raises `TurnError` when it runs (`take_due` gives a host loop the error, to run the
steps again with the workers together). One that does not ask traces its exchange and
raises when traced. Neither computes a wrong mean.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from shoal.comms import AxisCollective
  >>> from shoal.comms.turns import in_turn
  >>> coll = AxisCollective("workers", 4)
  >>> def local(x, rank):  # worker ``rank``'s local step, outside any vmap
  ...     with in_turn(coll, rank):
  ...         return x + coll.rank()
  >>> print(jax.lax.map(lambda a: local(*a), (jnp.zeros(4), jnp.arange(4))))
  [0. 1. 2. 3.]
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["Turn", "TurnError", "current", "in_turn", "leave_out", "take_due", "taking_turns"]


class TurnError(ValueError):
    """An exchange traced inside a step that was to be one worker's own (`in_turn`)."""


@dataclasses.dataclass(frozen=True)
class Turn:
    """The worker whose local steps are being traced (`in_turn` makes one).

    Attributes:
      axis_name: the named axis of the workers.
      size: the number of workers ``N``.
      rank: whose turn it is, an int32 scalar (traced inside a loop over the workers).
    """

    axis_name: str
    size: int
    rank: jax.Array


_TURN: contextvars.ContextVar[Turn | None] = contextvars.ContextVar("shoal_turn", default=None)


@contextlib.contextmanager
def in_turn(collective: Any, rank: Any) -> Iterator[Turn]:
    """Trace the steps inside as worker ``rank``'s alone (module docstring).

    Args:
      collective: the `shoal.comms.AxisCollective` of the simulated workers.
      rank: the worker, an int (or int32 scalar) in ``[0, collective.size)``.

    Yields:
      The `Turn`.

    Raises:
      ValueError: ``collective`` is not an ``AxisCollective`` (an MPI rank or a device
        runs its own steps already), or a turn is already being traced.
    """
    from shoal.comms.axis import AxisCollective  # axis.py reads this module

    if not isinstance(collective, AxisCollective):
        raise ValueError(
            f"in_turn needs simulated workers (an AxisCollective), not "
            f"{type(collective).__name__}: its workers already run their own steps"
        )
    if _TURN.get() is not None:
        raise ValueError("in_turn: a turn is already being traced (turns do not nest)")
    turn = Turn(collective.axis_name, collective.size, jnp.asarray(rank, jnp.int32))
    token = _TURN.set(turn)
    try:
        yield turn
    finally:
        _TURN.reset(token)


def current(axis_name: str) -> Turn | None:
    """The `Turn` being traced over ``axis_name``, or None."""
    turn = _TURN.get()
    return turn if turn is not None and turn.axis_name == axis_name else None


def taking_turns(collective: Any) -> bool:
    """Whether ``collective``'s workers take turns in the step being traced: its exchanges
    are known not to happen there (`in_turn`)."""
    axis_name = getattr(collective, "axis_name", None)
    return isinstance(axis_name, str) and current(axis_name) is not None


_DUE: list[TurnError] = []  # the latest one, for `take_due`


def leave_out(collective: Any, due: Any) -> None:
    """An exchange left out of the turn being traced: if it is ``due`` when the program
    runs, the program raises `TurnError` (from a host callback, which runs only then).
    Nothing outside a turn.

    Args:
      collective: the collective the exchange would have run over.
      due: a boolean scalar, whether the exchange should run at this step (DiLoCo's
        ``(step + 1) % H == 0``).
    """
    turn = current(getattr(collective, "axis_name", None) or "")
    if turn is None:
        return

    def fail(rank):
        error = TurnError(
            f"worker {int(rank)}'s step was traced as local (in_turn), but its exchange "
            f"over {turn.axis_name!r} was due: run the steps with the workers together"
        )
        _DUE[:] = [error]
        raise error

    lax.cond(jnp.asarray(due, bool), lambda r: jax.debug.callback(fail, r), lambda r: None,
             turn.rank)  # fmt: skip


def take_due() -> TurnError | None:
    """The `TurnError` a program raised in this process for an exchange that was due in
    a turn (`leave_out`), since the last call (None: none), and forget it. JAX reports
    it as a ``jax.errors.JaxRuntimeError``.

    Returns:
      the error, or None.
    """
    return _DUE.pop() if _DUE else None


def refuse(what: str, axis_name: str) -> None:
    """Raise `TurnError` if ``what`` (an exchange over ``axis_name``) is traced in a turn."""
    if current(axis_name) is not None:
        raise TurnError(
            f"{what} inside a step traced for one worker at a time (in_turn): the schedule "
            f"called this step local, but it exchanges over {axis_name!r}"
        )
