"""Churn inside one program: which simulated workers are present in a step, and how much
each present worker's contribution weighs (`present`).

Inside ``with present(collective, weights):``, at trace time, the `AxisCollective` over
``collective``'s axis reduces over the present workers only (``weights > 0``)::

    mean = sum_i w_i x_i / sum_i w_i          (over the present workers)
    sum  = sum_{i present} x_i,   max/min over the present workers

and the byte counts of its all-reduces (`shoal.comms.wire.all_reduce_bytes`) are those of
a ring among the ``P`` present workers, ``2 (P - 1) / P`` of the payload each way, and 0
for an absent worker: the counts become traced, looked up in a table of the ``N + 1``
exact values. Collectives that would hand a worker its peers' own values (all-gather,
all-to-all, reduce-scatter, ppermute, broadcast) refuse: they do not know who is absent.
`shoal.comms.MPICollective` refuses churn: its workers are processes, present or not.

With all ``N`` workers present and equal weights the reductions are those without churn,
bit for bit (the weights are scaled to a largest of 1 first).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from shoal.comms import AxisCollective
  >>> from shoal.comms.presence import present
  >>> coll = AxisCollective("workers", 3)
  >>> def mean(x):  # worker 1 absent; worker 2's tokens weigh twice worker 0's
  ...     with present(coll, jnp.array([1.0, 0.0, 2.0])):
  ...         return coll.all_reduce(x)
  >>> print(jax.vmap(mean, axis_name="workers")(jnp.array([3.0, 100.0, 6.0])))
  [5. 5. 5.]
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["ChurnError", "Presence", "current", "present", "refuse"]


class ChurnError(ValueError):
    """A collective or byte count that cannot leave absent workers out (`refuse`)."""


@dataclasses.dataclass(frozen=True)
class Presence:
    """The workers present in the step being traced (`present` makes one).

    Attributes:
      axis_name: the named axis of the workers.
      size: the number of workers ``N``, present or not.
      weights: ``[N]`` float32, every worker's weight (0: absent), the same on every
        worker (unbatched under vmap).
    """

    axis_name: str
    size: int
    weights: jax.Array

    @property
    def mask(self) -> jax.Array:
        """``[N]`` bool: who is present."""
        return self.weights > 0

    def count(self) -> jax.Array:
        """How many workers are present, an int32 scalar."""
        return jnp.sum(self.mask, dtype=jnp.int32)

    def first(self) -> jax.Array:
        """The lowest present worker's index, an int32 scalar."""
        return jnp.argmax(self.mask).astype(jnp.int32)

    def here(self) -> jax.Array:
        """Whether this worker (the one being traced) is present, a bool scalar."""
        return self.mask[lax.axis_index(self.axis_name)]

    def per_count(self, table: Callable[[int], int]) -> tuple[jax.Array, jax.Array]:
        """This worker's ``table(P)`` (an int of the present count ``P``; 0 when absent) as
        a `shoal.comms.ByteCount`'s two uint32 words ``(hi, lo)``: exact, traced."""
        values = [0] + [int(table(p)) for p in range(1, self.size + 1)]
        hi = jnp.asarray(np.array([v >> 32 for v in values], np.uint32))
        lo = jnp.asarray(np.array([v & 0xFFFFFFFF for v in values], np.uint32))
        p, mine = self.count(), self.here()
        zero = jnp.zeros((), jnp.uint32)
        return jnp.where(mine, hi[p], zero), jnp.where(mine, lo[p], zero)


_CURRENT: contextvars.ContextVar[Presence | None] = contextvars.ContextVar(
    "shoal_presence", default=None
)


@contextlib.contextmanager
def present(collective: Any, weights: Any) -> Iterator[Presence]:
    """Trace the collectives of ``collective`` inside this block over the present workers.

    Args:
      collective: an `shoal.comms.AxisCollective` (simulated workers or a mesh axis).
      weights: ``[N]`` floats, the same on every worker: worker ``i``'s weight in a mean
        (e.g. the tokens it processed since its contribution was last averaged), 0 when it
        is absent. At least one must be > 0 (not checked: it is traced).

    Yields:
      the `Presence`.

    Raises:
      ValueError: ``collective`` is not an ``AxisCollective``, or ``weights`` is not
        ``[N]``.
    """
    from shoal.comms.axis import AxisCollective  # axis.py reads this module

    if not isinstance(collective, AxisCollective):
        raise ValueError(
            f"churn needs simulated workers (an AxisCollective), not "
            f"{type(collective).__name__}: MPI ranks are processes that are either running "
            f"or gone; simulate churn with --backend sim"
        )
    weights = jnp.asarray(weights, jnp.float32)
    if weights.shape != (collective.size,):
        raise ValueError(
            f"present(): weights must have shape ({collective.size},), one per worker, "
            f"got {weights.shape}"
        )
    token = _CURRENT.set(Presence(collective.axis_name, collective.size, weights))
    try:
        yield _CURRENT.get()  # type: ignore[misc]
    finally:
        _CURRENT.reset(token)


def current(axis_name: str | None = None) -> Presence | None:
    """The `Presence` being traced (of ``axis_name``, when given), or None."""
    p = _CURRENT.get()
    if p is None or (axis_name is not None and p.axis_name != axis_name):
        return None
    return p


def refuse(what: str, axis_name: str | None = None) -> None:
    """Raise `ChurnError` when a `Presence` is active: ``what`` (a collective's method)
    cannot tell absent workers from present ones."""
    if current(axis_name) is not None:
        raise ChurnError(
            f"{what} under churn: only all_reduce and uniform reduce over the present "
            f"workers, and {what} would hand out absent workers' values; this algorithm "
            f"cannot run with churn (its exchange needs {what})"
        )
