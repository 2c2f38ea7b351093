"""The `Collective` protocol: the only way shoal's algorithms talk to their peers.

A collective is a frozen, hashable, non-callable value with a static ``size``.
Engines: `shoal.comms.AxisCollective` (named JAX axes: ``vmap``/``shard_map``)
and `shoal.comms.MPICollective` (mpi4jax, one worker per process).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jax import lax

from shoal.checks import check_int
from shoal.dtypes import promote_types

REDUCE_OPS = ("mean", "sum", "max", "min")


@runtime_checkable
class Collective(Protocol):
    """What an algorithm may ask of its peers: the protocol every engine implements.

    A collective is a frozen, hashable, non-callable object with a static ``size`` and
    the methods ``rank``, ``uniform``, ``all_reduce``, ``all_gather``, ``all_to_all``,
    ``broadcast`` and ``ppermute``, all traceable under ``jax.jit``; ``split`` for
    two-tier groups; and two host-side agreements (``host_allgather``,
    ``host_broadcast``) for checks and plans made outside ``jit``. `MEMBERS` lists
    them all. Engines:
    `AxisCollective` (simulated workers under ``vmap``, or devices under
    ``shard_map``), `MPICollective` (MPI processes) and `RecordingCollective`
    (one process, logging what would be sent).

    Example:
      >>> from shoal.comms import AxisCollective, Collective
      >>> isinstance(AxisCollective("workers", 4), Collective)
      True
    """

    size: int

    def rank(self) -> jax.Array:
        """This worker's index in ``[0, size)`` as an int32 scalar."""

    def all_reduce(self, tree: Any, op: str = "mean") -> Any:
        """Element-wise reduction of every leaf over all workers (``op`` in `REDUCE_OPS`)."""

    def uniform(self, x: Any) -> Any:
        """``x``, known to be the same on every worker, in the form ``lax.cond`` branches on
        cheaply (under vmap: unbatched); no communication."""

    def all_gather(self, x: jax.Array) -> jax.Array:
        """``[size, *x.shape]``: row ``j`` is worker ``j``'s ``x``."""

    def all_to_all(self, x: jax.Array) -> jax.Array:
        """``x.shape[0] == size``: worker ``r`` receives row ``r`` of every worker, by source."""

    def broadcast(self, tree: Any, root: int = 0) -> Any:
        """Every worker gets worker ``root``'s value of every leaf (bit-exact)."""

    def ppermute(self, x: jax.Array, perm: Sequence[tuple[int, int]]) -> jax.Array:
        """Point-to-point exchange with JAX's ``perm`` convention: ``(source, dest)`` pairs;
        a worker that is nobody's destination receives zeros."""

    def split(self, group_size: int) -> tuple[Collective, Collective]:
        """``(intra, inter)``: collectives over groups of ``group_size`` consecutive
        workers and over the workers with the same place in every group."""

    def host_allgather(self, obj: Any) -> list[Any]:
        """Every worker's Python ``obj``, by rank: host side, outside ``jit``, called by
        every worker at the same point. Workers that share one trace (``vmap``) share
        ``obj`` too, so engines that run them return ``[obj] * size`` without
        communicating."""

    def host_broadcast(self, obj: Any, root: int = 0) -> Any:
        """Worker ``root``'s Python ``obj`` on every worker (host side, as
        ``host_allgather``)."""


# Every member an engine must have (the Protocol's, spelled out: Python 3.10 has no
# public way to list them). `missing_members` checks a value against it. An engine may
# also have faster forms of composite exchanges, which the free functions of the same
# names use when present (`ppermute_switch`, `reduce_scatter`), and ``simulated()``,
# True when its workers are rows of arrays in one program (`AxisCollective` under vmap).
MEMBERS = (
    "size",
    "rank",
    "uniform",
    "all_reduce",
    "all_gather",
    "all_to_all",
    "broadcast",
    "ppermute",
    "split",
    "host_allgather",
    "host_broadcast",
)


def missing_members(obj: Any) -> list[str]:
    """The `MEMBERS` of the `Collective` protocol that ``obj`` lacks (empty: none)."""
    return [m for m in MEMBERS if not hasattr(obj, m)]


def check_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
    return op


def check_size(size: Any) -> int:
    return check_int("size", size, 1)


def check_root(root: Any, size: int) -> int:
    return check_int("root", root, 0, size - 1)


def check_perm(perm: Sequence[tuple[int, int]], size: int) -> tuple[tuple[int, int], ...]:
    """Validate a JAX-style permutation: pairs in range, no repeated source or destination."""
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"perm must be a sequence of (source, dest) int pairs, got {perm!r}"
        ) from e
    for s, d in pairs:
        if not (0 <= s < size and 0 <= d < size):
            raise ValueError(f"perm pair {(s, d)} is out of range for {size} workers")
    srcs = [s for s, _ in pairs]
    dsts = [d for _, d in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"perm must not repeat a source or a destination, got {pairs}")
    return pairs


def check_perms(perms: Sequence[Sequence[int]], size: int) -> tuple[tuple[int, ...], ...]:
    """Validate a non-empty list of permutations of ``range(size)`` (``perm[r]``: where
    worker ``r`` sends)."""
    try:
        out = tuple(tuple(int(d) for d in p) for p in perms)
    except (TypeError, ValueError) as e:
        raise ValueError(f"perms must be sequences of ints, got {perms!r}") from e
    if not out:
        raise ValueError("perms must hold at least one permutation")
    for p in out:
        if sorted(p) != list(range(size)):
            raise ValueError(f"perms: each must be a permutation of range({size}), got {p}")
    return out


def ppermute_switch(
    collective: Collective, x: jax.Array, perms: Sequence[Sequence[int]], index: Any
) -> jax.Array:
    """``x`` sent along the permutation ``perms[index]``, chosen alike on every worker.

    Worker ``r`` sends to ``perms[index][r]`` and receives from the worker that sends to
    it. ``index`` (an int scalar, clamped to ``[0, len(perms) - 1]`` like
    ``lax.switch``'s) must be the same on every worker. Only the chosen permutation moves
    data: a ``lax.switch`` over the collective's `Collective.ppermute`, or the collective's
    own ``ppermute_switch`` when it has one (`AxisCollective` under vmap: one gather of the
    workers' rows, instead of a switch whose result XLA writes to a fresh buffer).

    Args:
      collective: the workers (`Collective`).
      x: an array of the same shape and dtype on every worker.
      perms: permutations of ``range(collective.size)``.
      index: which one, the same on every worker.

    Returns:
      the array this worker received (a bit-exact copy of the sender's).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective, ppermute_switch
      >>> coll = AxisCollective("workers", 3)
      >>> perms = [(1, 2, 0), (2, 0, 1)]  # shift by one, by two
      >>> f = lambda x, k: ppermute_switch(coll, x, perms, k)
      >>> print(jax.vmap(f, (0, None), axis_name="workers")(jnp.arange(3.0), 1))
      [1. 2. 0.]
    """
    own = getattr(collective, "ppermute_switch", None)
    if own is not None:
        return own(x, perms, index)
    return switch_ppermute(collective, x, check_perms(perms, collective.size), index)


def reduce_scatter(collective: Collective, x: jax.Array) -> jax.Array:
    """The sum over the workers of ``x``'s rows, worker ``r`` keeping row ``r``.

    ``x`` is ``[size, ...]``; worker ``r`` gets ``sum_j x_j[r]`` (``x_j`` worker ``j``'s
    ``x``), summed in ``float32`` or wider. An all-to-all, then this worker's rows summed
    (`sum_rows`), or the collective's own ``reduce_scatter`` when it has one
    (`AxisCollective` under vmap: the sum of the gathered rows, one read of them, instead
    of an all-to-all that writes a transposed copy of every worker's buffer first).

    Args:
      collective: the workers (`Collective`).
      x: a floating array with ``x.shape[0] == collective.size``, the same shape on every
        worker.

    Returns:
      an array of shape ``x.shape[1:]`` and dtype ``promote_types(x.dtype, float32)``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective, reduce_scatter
      >>> coll = AxisCollective("workers", 2)
      >>> x = jnp.array([[[1.0], [2.0]], [[10.0], [20.0]]])  # worker j holds x[j]
      >>> print(jax.vmap(lambda v: reduce_scatter(coll, v), axis_name="workers")(x))
      [[11.]
       [22.]]
    """
    check_all_to_all(x, collective.size, "reduce_scatter")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"reduce_scatter needs a floating x, got dtype {x.dtype}")
    own = getattr(collective, "reduce_scatter", None)
    if own is not None:
        return own(x)
    return all_to_all_sum(collective, x)


def all_to_all_sum(collective: Collective, x: jax.Array) -> jax.Array:
    """`reduce_scatter` as an all-to-all over ``collective``, then this worker's rows summed
    (`sum_rows`) in ``float32`` or wider."""
    acc = promote_types(x.dtype, jnp.float32)
    return sum_rows(collective.all_to_all(x).astype(acc))


def is_simulated(collective: Collective) -> bool:
    """Whether ``collective``'s workers are rows of arrays in one program: its own
    ``simulated()`` when it has one (`AxisCollective`, at trace time: True under vmap),
    else False (MPI ranks, devices)."""
    simulated = getattr(collective, "simulated", None)
    return bool(simulated()) if simulated is not None else False


def switch_ppermute(
    collective: Collective, x: jax.Array, perms: Sequence[tuple[int, ...]], index: Any
) -> jax.Array:
    """`ppermute_switch` as a ``lax.switch`` over ``collective.ppermute``, one branch per
    permutation (checked ones): only the taken branch moves data."""
    branches = [lambda v, p=p: collective.ppermute(v, tuple(enumerate(p))) for p in perms]
    return lax.switch(index, branches, x)


def check_all_to_all(x: jax.Array, size: int, what: str = "all_to_all") -> None:
    if x.ndim == 0 or x.shape[0] != size:
        raise ValueError(f"{what} needs x.shape[0] == collective size {size}, got shape {x.shape}")


def uniform_over(collectives: Collective | Sequence[Collective], x: Any) -> Any:
    """`Collective.uniform` over every collective in ``collectives`` (two-tier workers are
    indexed by two axes, ``(intra, inter)``): a predicate built from the result keeps
    ``lax.cond``/``lax.switch`` a real branch on every engine."""
    if not isinstance(collectives, (list, tuple)):
        collectives = (collectives,)
    for c in collectives:
        x = c.uniform(x)
    return x


def sum_rows(rows: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """``rows.sum(0)`` at memory bandwidth, for every engine (XLA:CPU reduces over a
    leading axis ~30x slower, and fuses an add chain into each consumer): a dot with a
    ones vector for floats (f32 accumulation, full precision also on GPUs that would use
    TF32), a plain sum for the small integer flags and counts. With ``weights`` (``[n]``
    floats; floating rows only) the weighted sum ``weights @ rows``, in the same dot."""
    if not jnp.issubdtype(rows.dtype, jnp.floating):
        return jnp.sum(rows, axis=0, dtype=rows.dtype)
    n = rows.shape[0]
    flat = rows.reshape(n, -1)
    acc = jnp.float32 if rows.dtype.itemsize < 4 else rows.dtype
    w = jnp.ones((n,), acc) if weights is None else jnp.asarray(weights).astype(acc)
    total = jnp.dot(w, flat.astype(acc), precision=lax.Precision.HIGHEST)
    return total.reshape(rows.shape[1:]).astype(rows.dtype)
