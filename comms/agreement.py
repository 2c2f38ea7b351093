"""Checks that all workers hold the same kind of pytree before they start talking.

Workers whose parameters differ in shape or dtype would otherwise hang in a collective of
mismatched sizes, or silently mix unrelated values. The check is host-side and static
(paths, shapes, dtypes): it runs when a transformation is initialised, at trace time.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _describe(tree: Any) -> list[tuple[str, tuple[int, ...], str]]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return [
        (jax.tree_util.keystr(p), tuple(int(d) for d in np.shape(x)), str(np.dtype(x.dtype)))
        for p, x in leaves
    ]


def check_same_structure(tree: Any, collective: Any, *, name: str = "params") -> None:
    """Check that every worker holds a ``tree`` of the same structure as worker 0's.

    One `Collective.host_allgather` of the description (paths, shapes, dtypes): with MPI
    an ``allgather`` on the communicator, so call it on every worker at the same point,
    outside running computations. Simulated workers (`AxisCollective`) share one trace,
    so they cannot differ: then nothing is sent.

    Args:
      tree: this worker's pytree, e.g. its parameters.
      collective: the workers (`shoal.comms.Collective`).
      name: what ``tree`` is, for the error message.

    Returns:
      None.

    Raises:
      ValueError: on every worker alike, naming the first leaf where a worker's tree
        differs from worker 0's (path, shape or dtype).

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.comms import AxisCollective, check_same_structure
      >>> check_same_structure({"w": jnp.zeros(3)}, AxisCollective("workers", 2))
      >>> # under mpiexec, with a worker whose "w" has another shape:
      >>> from shoal.comms import MPICollective  # doctest: +SKIP
      >>> check_same_structure(params, MPICollective())  # doctest: +SKIP
      Traceback (most recent call last):
      ValueError: ...
    """
    everyone = collective.host_allgather(_describe(tree))
    ref = everyone[0]
    for rank, mine in enumerate(everyone[1:], start=1):
        if mine == ref:
            continue
        for i, (a, b) in enumerate(zip(ref, mine)):
            if a != b:
                theirs = f"{b[0]} " if b[0] != a[0] else ""
                raise ValueError(
                    f"{name} differ between workers at leaf {i} {a[0]}: worker 0 has shape "
                    f"{a[1]} {a[2]}, worker {rank} has {theirs}shape {b[1]} {b[2]}"
                )
        raise ValueError(
            f"{name} differ between workers: worker 0 has {len(ref)} leaves, worker {rank} "
            f"has {len(mine)}"
        )
