"""Where the workers live: simulated in this process (``vmap``), one per MPI rank, or one
per device (or per group of K devices) of a ``jax.distributed`` job (``shard_map`` over a
mesh of all processes' devices).

All backends expose the same small interface to the training loop:

* ``collective``: what the algorithms communicate through;
* ``two_tier(group_size)``: the ``(intra, inter)`` collectives of two-tier algorithms;
* ``spmd(fn, group_size=None)``: compile a per-worker function for all of this
  process's workers; with a ``group_size``, ``fn`` may use ``two_tier(group_size)``;
* ``replicate`` / ``local``: per-worker layout of parameters and of global batches;
* ``stacked`` / ``unstacked``: per-worker values to host arrays with a leading axis over
  this process's workers, and back (checkpoints);
* ``servers``: the dedicated `shoal.comms.ParameterServers` of an MPI run, else None;
* ``gather`` / ``mean_params``: host-side metrics for the root process (rank 0);
* ``share``: a host value of the root on every process (e.g. a policy's decision);
* ``agree``: one decision for every process from each one's own problem (None: none),
  the rule for every check that can refuse a run (`decide`);
* ``device_loss`` / ``by_worker`` / ``whole_params``: what changes when a worker spans
  several devices (``devices_per_worker`` K > 1, `JaxBackend` only; the identity
  otherwise): the loss one device computes, its metrics combined per worker, and its
  parameters as whole leaves.

Per-worker values always have the same host layout, a leading axis over this process's
workers in rank order, whatever the tiers: only ``spmd`` knows how they are grouped. With
K > 1 the rows are devices, K per worker (row ``w * K + k`` is device ``k`` of worker
``w``), each holding piece ``k`` of every leaf of its worker.

This module holds that interface (`Backend`), the simulated and MPI backends and
`make_backend`; the ``jax.distributed`` backend is `shoal.experiments.runner.jax_backend`.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from shoal.comms import AxisCollective, MPICollective, ParameterServers

AXIS = "workers"


class Backend(Protocol):
    """The interface the training loop uses (see the module docstring); `SimBackend`,
    `MPIBackend` and `JaxBackend` implement it."""

    name: str
    size: int
    rank: int  # this process's index (0 for simulated workers: one process)
    is_root: bool
    collective: Any
    servers: ParameterServers | None
    devices_per_worker: int

    def two_tier(self, group_size: int) -> tuple[Any, Any]: ...
    def spmd(self, fn, group_size: int | None = None): ...
    def replicate(self, tree: Any) -> Any: ...
    def local(self, per_worker: np.ndarray, batch: bool = True) -> np.ndarray: ...
    def stacked(self, tree: Any) -> Any: ...
    def unstacked(self, tree: Any) -> Any: ...
    def gather(self, tree: Any) -> Any: ...
    def share(self, obj: Any) -> Any: ...
    def gather_all(self, obj: Any) -> list[Any]: ...
    def agree(self, problem: str | None) -> str | None: ...
    def mean_params(self, params: Any) -> Any: ...
    def device_loss(self, loss_fn): ...
    def by_worker(self, rows: tuple, ops: tuple[str, ...]) -> tuple: ...
    def whole_params(self, params: Any) -> Any: ...


def decide(problems: list[str | None]) -> str | None:
    """The one decision of every process from each process's problem (None: none), in
    process order: the first problem, naming its process when it is not the root's."""
    for rank, problem in enumerate(problems):
        if problem is not None:
            return problem if rank == 0 else f"process {rank}: {problem}"
    return None


def world_rank() -> int:
    """This process's rank in ``MPI.COMM_WORLD`` (0 without MPI)."""
    if "mpi4py.MPI" not in sys.modules:
        return 0
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def world_agree(problem: str | None) -> str | None:
    """`decide` over every process of ``MPI.COMM_WORLD`` (parameter servers included),
    before any backend exists: the checks of the command line."""
    from mpi4py import MPI

    return decide(MPI.COMM_WORLD.allgather(problem))


class _WholeWorkers:
    """The hooks for workers that span devices, for backends whose workers never do: a
    worker's loss, metrics and parameters are its own, unchanged."""

    devices_per_worker = 1

    def unstacked(self, tree: Any) -> Any:
        """`stacked` host values back in the layout ``spmd`` functions take: the same."""
        return tree

    def device_loss(self, loss_fn):
        """The loss one device of a worker differentiates: here the worker's own."""
        return loss_fn

    def by_worker(self, rows: tuple, ops: tuple[str, ...]) -> tuple:
        """Gathered metrics, one row per worker: already so here."""
        return rows

    def whole_params(self, params: Any) -> Any:
        """This process's workers' parameters, whole leaves stacked on a leading axis."""
        return self.stacked(params)


class SimBackend(_WholeWorkers):
    """``size`` workers in one process: per-worker values are stacked on a leading axis
    and per-worker functions run under ``jax.vmap(..., axis_name="workers")``.

    Two tiers are two nested vmap axes, ``"group"`` (outer, ``M = size / group_size``)
    and ``"member"`` (inner, ``group_size``): worker ``w`` is member ``w % group_size``
    of group ``w // group_size``, so ``spmd`` reshapes every argument from ``[size,
    ...]`` to ``[M, group_size, ...]`` and its results back.
    """

    name = "sim"
    rank = 0
    is_root = True
    servers = None

    def __init__(self, size: int):
        self.size = size
        self.collective = AxisCollective(AXIS, size)
        self.local_ranks = tuple(range(size))

    def two_tier(self, group_size: int) -> tuple[AxisCollective, AxisCollective]:
        return self.collective.split(group_size)

    def spmd(self, fn, group_size: int | None = None):
        if group_size is None:
            return jax.jit(jax.vmap(fn, axis_name=AXIS))
        intra, inter = self.two_tier(group_size)
        nested = jax.vmap(jax.vmap(fn, axis_name=intra.axis_name), axis_name=inter.axis_name)

        def grouped(*args):
            split = lambda a: a.reshape(inter.size, intra.size, *a.shape[1:])
            out = nested(*jax.tree.map(split, args))
            return jax.tree.map(lambda a: a.reshape(self.size, *a.shape[2:]), out)

        return jax.jit(grouped)

    def replicate(self, tree: Any) -> Any:
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (self.size, *a.shape)), tree)

    def local(self, per_worker: np.ndarray, batch: bool = True) -> np.ndarray:
        """This process's rows of an array with a leading worker axis: all of them."""
        return per_worker

    def stacked(self, tree: Any) -> Any:
        """This process's per-worker values with a leading axis over ``local_ranks``."""
        return tree

    def gather(self, tree: Any) -> Any:
        """``stacked`` values of all workers, leading axis ``size``, on the root (else None)."""
        return jax.tree.map(np.asarray, jax.device_get(tree))

    def share(self, obj: Any) -> Any:
        """The root's host value ``obj`` on every process (one process here)."""
        return obj

    def gather_all(self, obj: Any) -> list[Any]:
        """Every process's host value ``obj``, in process order (one process here)."""
        return [obj]

    def agree(self, problem: str | None) -> str | None:
        """`decide` over every process's ``problem``: this one's here."""
        return problem

    def mean_params(self, params: Any) -> Any:
        # Sum then divide, in float32, as the MPI backend does.
        return jax.tree.map(lambda a: np.asarray(a).sum(0) / np.float32(self.size), params)


class HostComm:
    """Host-side traffic of the multi-process backends, on ``self.comm`` (an mpi4py
    communicator of their own, so it never interleaves with the algorithms' traffic)."""

    def share(self, obj: Any) -> Any:
        """The root's host value ``obj`` on every process (a pickled broadcast)."""
        return self.comm.bcast(obj, root=0)

    def gather_all(self, obj: Any) -> list[Any]:
        """Every process's host value ``obj``, in process order (a pickled all-gather)."""
        return self.comm.allgather(obj)

    def agree(self, problem: str | None) -> str | None:
        """`decide` over every process's ``problem``: every process returns the same, so
        a check that fails on one process only stops them all, and none waits for the
        others in a collective they never reach."""
        return decide(self.gather_all(problem))

    def _mean_at_root(self, local_sum: Any) -> Any:
        """The mean over all workers at the root (None elsewhere): this process's sum of
        its workers' values, summed across processes in float32 with one ``Reduce``, then
        divided."""
        flat, unravel = ravel_pytree(local_sum)
        flat = np.ascontiguousarray(np.asarray(flat))
        total = np.empty_like(flat) if self.is_root else None
        self.comm.Reduce(flat, total, op=self._MPI.SUM, root=0)
        if not self.is_root:
            return None
        return unravel(jnp.asarray(total / np.float32(self.size)))

    def abort(self, code: int = 1) -> None:
        """Stop every process: one process's exception must not leave the others in a
        collective."""
        sys.stdout.flush()
        sys.stderr.flush()
        # Hydra tears the job down at once and may drop what it has not forwarded yet:
        # give this process's last lines (the error that ends the job) time to get out.
        time.sleep(1.0)
        self._MPI.COMM_WORLD.Abort(code)
        os._exit(code)  # MPICH's Abort may return once the launcher has the request


class MPIBackend(HostComm, _WholeWorkers):
    """One worker per MPI rank (launch with ``mpiexec -n N``); the world size is the
    number of workers. Metrics reach rank 0 through host-side mpi4py calls on a
    communicator of their own, so they never interleave with the algorithms' traffic.

    With ``servers = S > 0`` the last S ranks are Herring's dedicated parameter servers
    (`shoal.comms.ParameterServers`, in `servers`): ``is_server`` is True there, and
    those ranks run ``servers.serve()`` instead of training; the workers are the others.
    """

    name = "mpi"

    def __init__(self, servers: int = 0):
        from mpi4py import MPI

        self._MPI = MPI
        self.servers = None
        self.is_server = False
        if servers:
            self.servers = ParameterServers(servers)
            self.is_server = self.servers.is_server
            if self.is_server:
                self.is_root = False
                return
            self.collective = self.servers.workers
        else:
            self.collective = MPICollective()
        self.comm = self.collective.comm.Clone()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.is_root = self.rank == 0
        self.local_ranks = (self.rank,)
        self._tiers = {}

    def two_tier(self, group_size: int) -> tuple[MPICollective, MPICollective]:
        """Sub-communicators from ``comm.Split``, made once per group size: splitting is
        collective, and every rank asks for the same sizes in the same order."""
        if group_size not in self._tiers:
            self._tiers[group_size] = self.collective.split(group_size)
        return self._tiers[group_size]

    def spmd(self, fn, group_size: int | None = None):
        # One worker per process: the tiers live in the communicators, not in the layout.
        return jax.jit(fn)

    def replicate(self, tree: Any) -> Any:
        return tree

    def local(self, per_worker: np.ndarray, batch: bool = True) -> np.ndarray:
        return per_worker[self.rank]

    def stacked(self, tree: Any) -> Any:
        return jax.tree.map(lambda a: np.asarray(a)[None], tree)

    def unstacked(self, tree: Any) -> Any:
        # One worker per process: its values have no worker axis.
        return jax.tree.map(lambda a: a[0], tree)

    def gather(self, tree: Any) -> Any:
        parts = self.comm.gather(jax.device_get(tree), root=0)
        if not self.is_root:
            return None
        return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)

    def mean_params(self, params: Any) -> Any:
        return self._mean_at_root(params)


def make_backend(
    name: str,
    workers: int | None = None,
    servers: int = 0,
    devices_per_worker: int = 1,
    bind_address: str | None = None,
):
    """``"sim"`` with ``workers`` workers, ``"mpi"`` (one worker per rank, the last
    ``servers`` ranks dedicated parameter servers), or ``"jax"`` (one worker per
    ``devices_per_worker`` devices of a ``jax.distributed`` job whose coordinator listens
    on ``bind_address``, see `shoal.experiments.runner.jax_backend.coordinator`)."""
    if devices_per_worker != 1 and name != "jax":
        raise ValueError(f"--devices-per-worker needs --backend jax, not {name!r}")
    if name == "sim":
        return SimBackend(workers)
    if name == "mpi":
        return MPIBackend(servers)
    if name == "jax":
        # Imported here: that module builds on this one (`AXIS`, `HostComm`).
        from shoal.experiments.runner.jax_backend import JaxBackend

        return JaxBackend(devices_per_worker, bind_address=bind_address)
    raise ValueError(f"backend must be 'sim', 'mpi' or 'jax', got {name!r}")
