"""`MPICollective`: one worker per process, collectives through mpi4jax.

Works inside ``jax.jit``, ``lax.cond`` and loops (mpi4jax uses ordered effects, so
use one device per process). MPI carries no 16-bit floats: reductions are upcast to
float32 and cast back, data movement (gather, all-to-all, broadcast, permute) is
bitcast to uint16 and back, so values arrive bit-exact.

Speed: each call writes a fresh result buffer that XLA:CPU takes from ``malloc``. With
glibc's defaults a result over 32 MB is mapped afresh and page-faulted on every call
(``all_reduce`` of 16M float32 on 4 ranks: 1.7x mpi4py's ``Allreduce`` of NumPy arrays);
with the heap kept (``GLIBC_TUNABLES`` as in `shoal.experiments.runner.malloc`, which
``shoal-run --backend mpi`` sets) it is 1.1x. ``benchmarks/mpi_allreduce.py`` measures
both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from shoal.comms.collective import (
    check_all_to_all,
    check_op,
    check_perm,
    check_root,
    check_size,
)

_MPI_DTYPES = frozenset(
    jnp.dtype(t)
    for t in (
        jnp.float32, jnp.float64, jnp.complex64, jnp.complex128,
        jnp.int8, jnp.int16, jnp.int32, jnp.int64,
        jnp.uint8, jnp.uint16, jnp.uint32, jnp.uint64, jnp.bool_,
    )
)  # fmt: skip
_HALF = frozenset(jnp.dtype(t) for t in (jnp.bfloat16, jnp.float16))


def _import_mpi():
    try:
        import mpi4jax
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ImportError(
            "MPICollective needs mpi4py and mpi4jax: run install.sh from shoal's clone (it "
            "builds mpi4jax against the mpich wheel; docs/guide/install.md, 'Use shoal in "
            "your own project')"
        ) from e
    return MPI, mpi4jax


def _check_dtype(x) -> None:
    if x.dtype not in _MPI_DTYPES and x.dtype not in _HALF:
        raise TypeError(f"MPICollective cannot carry dtype {x.dtype}")


class MPICollective:
    """Collectives across the processes of an MPI communicator, one worker per process.

    Built on mpi4jax, so the collectives run inside ``jax.jit``. Frozen and hashable
    (by communicator handle), not callable.

    Args:
      comm: an mpi4py communicator; None: a clone of ``MPI.COMM_WORLD``, so shoal's
        messages never mix with the user's.

    Example:
      Save as ``mean.py`` and run ``mpiexec -n 4 python mean.py``; every rank prints
      ``[1.5]``:

      >>> import jax.numpy as jnp
      >>> from shoal.comms import MPICollective
      >>> coll = MPICollective()  # doctest: +SKIP
      >>> print(coll.all_reduce(jnp.array([float(coll.rank())])))  # doctest: +SKIP
      [1.5]
    """

    __slots__ = ("comm", "size", "_rank")

    def __init__(self, comm: Any = None):
        MPI, _ = _import_mpi()
        if comm is None:
            comm = MPI.COMM_WORLD.Clone()
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
        object.__setattr__(self, "comm", comm)
        object.__setattr__(self, "size", check_size(comm.Get_size()))
        object.__setattr__(self, "_rank", comm.Get_rank())

    def __setattr__(self, name, value):
        raise AttributeError("MPICollective is frozen")

    def __eq__(self, other):
        return isinstance(other, MPICollective) and self.comm.py2f() == other.comm.py2f()

    def __hash__(self):
        return hash(("MPICollective", self.comm.py2f()))

    def __repr__(self):
        return f"MPICollective(size={self.size}, rank={self._rank})"

    @property
    def process_rank(self) -> int:
        """This process's rank in ``comm``, a plain Python ``int`` (read-only).

        Use it in host code, outside any traced function: to pick this worker's shard of
        the data (``x[coll.process_rank]``), to print from one rank only, or to name a
        per-rank file. The method ``rank()`` gives the same number as a JAX ``int32``
        array; it is the `Collective` interface's rank, meant for code that also runs
        under `AxisCollective` (inside ``vmap``/``shard_map``, where the rank is traced
        and differs per simulated worker). `AxisCollective` has no ``process_rank``:
        its workers share one process.
        """
        return self._rank

    def rank(self) -> jax.Array:
        return jnp.int32(self._rank)

    def uniform(self, x: Any) -> Any:
        """``x`` as it is: one worker per process has nothing to unbatch."""
        return x

    def all_reduce(self, tree: Any, op: str = "mean") -> Any:
        check_op(op)
        MPI, mpi4jax = _import_mpi()
        mpi_op = {"mean": MPI.SUM, "sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]

        def one(x):
            x = jnp.asarray(x)
            _check_dtype(x)
            if op == "mean" and not jnp.issubdtype(x.dtype, jnp.inexact):
                raise TypeError(f"all_reduce(op='mean') needs a floating leaf, got dtype {x.dtype}")
            wire = x.astype(jnp.float32) if x.dtype in _HALF else x
            y = mpi4jax.allreduce(wire, op=mpi_op, comm=self.comm)
            if op == "mean":
                y = y / self.size
            return y.astype(x.dtype)

        return jax.tree.map(one, tree)

    def all_gather(self, x: jax.Array) -> jax.Array:
        _, mpi4jax = _import_mpi()
        return _bit_move(lambda v: mpi4jax.allgather(v, comm=self.comm), x)

    def all_to_all(self, x: jax.Array) -> jax.Array:
        check_all_to_all(x, self.size)
        _, mpi4jax = _import_mpi()
        return _bit_move(lambda v: mpi4jax.alltoall(v, comm=self.comm), x)

    def broadcast(self, tree: Any, root: int = 0) -> Any:
        root = check_root(root, self.size)
        _, mpi4jax = _import_mpi()
        return jax.tree.map(
            lambda x: _bit_move(lambda v: mpi4jax.bcast(v, root, comm=self.comm), x), tree
        )

    def ppermute(self, x: jax.Array, perm: Sequence[tuple[int, int]]) -> jax.Array:
        pairs = check_perm(perm, self.size)
        _, mpi4jax = _import_mpi()
        # The rank is static here, so each process traces only its own send/receive.
        dest = next((d for s, d in pairs if s == self._rank), None)
        source = next((s for s, d in pairs if d == self._rank), None)
        comm = self.comm

        def move(v):
            if dest is not None and source is not None:
                return mpi4jax.sendrecv(v, v, source, dest, comm=comm)
            if dest is not None:
                mpi4jax.send(v, dest, comm=comm)
            if source is not None:
                return mpi4jax.recv(v, source, comm=comm)
            return jnp.zeros_like(v)

        return _bit_move(move, x)

    def host_allgather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (pickled), by rank: ``comm.allgather``."""
        # mpi4jax may still be running an earlier computation on this communicator: MPI
        # forbids two collectives on one communicator at once.
        jax.effects_barrier()
        return self.comm.allgather(obj)

    def host_broadcast(self, obj: Any, root: int = 0) -> Any:
        """Rank ``root``'s ``obj`` (pickled) on every rank: ``comm.bcast``."""
        root = check_root(root, self.size)
        jax.effects_barrier()
        return self.comm.bcast(obj, root=root)

    def split(self, group_size: int) -> tuple[MPICollective, MPICollective]:
        """Two-tier collectives: ``intra`` over groups of ``group_size`` consecutive ranks,
        ``inter`` over the ranks with the same position in every group (``comm.Split``)."""
        from shoal.comms.groups import check_group_size

        check_group_size(self.size, group_size)
        r = self._rank
        intra = self.comm.Split(color=r // group_size, key=r)
        inter = self.comm.Split(color=r % group_size, key=r)
        return MPICollective(intra), MPICollective(inter)


def _bit_move(fn, x):
    """Run a data-movement op, bitcasting 16-bit floats to uint16 so they survive MPI."""
    x = jnp.asarray(x)
    _check_dtype(x)
    if x.dtype in _HALF:
        return lax.bitcast_convert_type(fn(lax.bitcast_convert_type(x, jnp.uint16)), x.dtype)
    return fn(x)
