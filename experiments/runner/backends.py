"""Where the workers live: simulated in this process (``vmap``), one per MPI rank, or one
per device (or per group of K devices) of a ``jax.distributed`` job (``shard_map`` over a
mesh of all processes' devices).

All backends expose the same small interface to the training loop:

* ``collective``: what the algorithms communicate through;
* ``two_tier(group_size)``: the ``(intra, inter)`` collectives of two-tier algorithms;
* ``spmd(fn, group_size=None)``: compile a per-worker function for all of this
  process's workers; with a ``group_size``, ``fn`` may use ``two_tier(group_size)``;
* ``replicate`` / ``local``: per-worker layout of parameters and of global batches;
* ``steps_of``: several steps' ``local`` batches as one argument of a program that scans
  them (``scan_steps``), the steps' axis after this process's rows;
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
  parameters as whole leaves;
* ``init_state`` / ``held`` / ``spread``: the workers' initial optimizer state, the
  state leaves held once for all of this process's workers (rank-uniform state of
  simulated workers, `shoal.optim.helpers.uniform_axes`), and a state with those as host
  rows for every worker (evaluation).

Per-worker values always have the same host layout, a leading axis over this process's
workers in rank order, whatever the tiers: only ``spmd`` knows how they are grouped. With
K > 1 the rows are devices, K per worker (row ``w * K + k`` is device ``k`` of worker
``w``), each holding piece ``k`` of every leaf of its worker. The one exception is state
that is the same on every worker by construction (DiLoCo's global model and outer state):
`SimBackend` holds it once, without the worker axis, in memory and in checkpoints; under
MPI and ``jax`` every worker holds its own copy, as its own process or device must.

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
from shoal.optim.helpers import uniform_axes

AXIS = "workers"


def _unmapped(axis: Any) -> bool:
    return axis is None


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
    def steps_of(self, arrays: Any) -> np.ndarray: ...
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
    def init_state(self, init, params: Any, group_size: int | None = None) -> Any: ...
    def held(self, tree: Any) -> list[int]: ...
    def spread(self, tree: Any) -> Any: ...


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


class CopyPerWorker:
    """The state hooks of backends whose workers each hold all of their state (one per
    process or device): nothing is held once."""

    def init_state(self, init, params: Any, group_size: int | None = None) -> Any:
        """``init(params)`` of every worker (``spmd``)."""
        return self.spmd(init, group_size=group_size)(params)

    def held(self, tree: Any) -> list[int]:
        """The leaf indices of ``tree`` held once for several workers: none."""
        return []

    def spread(self, tree: Any) -> Any:
        """``tree`` with its leaves held once spread over the workers: already so."""
        return tree


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

    Rank-uniform state (the fields a state class lists in ``RANK_UNIFORM``: DiLoCo's
    global model and outer optimizer state, BMUF's global model and block momentum) is
    held once, passed to vmap unbatched: with AdamW inside DiLoCo each worker holds 3
    model-sized arrays (params, m, v) and all of them share 2 more, where a stacked
    state would hold 5 per worker.

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
        """``fn`` for all workers, vmapped over the workers (two nested axes with a
        ``group_size``), each argument's and result's rank-uniform state held once
        (`shoal.optim.helpers.uniform_axes`: unbatched, no worker axis)."""
        return self._mapped(fn, group_size, same=False)

    def init_state(self, init, params: Any, group_size: int | None = None) -> Any:
        """``init(params)`` of every worker, from ``params`` that are the same on every
        worker (the run's start): computed once, from worker 0's row, so rank-uniform state
        (a global model equal to ``params``) comes out held once, as ``spmd`` holds it;
        what may differ per worker (through its rank) still does."""
        return self._mapped(init, group_size, same=True)(params)

    def _mapped(self, fn, group_size: int | None, same: bool):
        if group_size is None:
            names, sizes = (AXIS,), (self.size,)
        else:
            intra, inter = self.two_tier(group_size)
            names, sizes = (inter.axis_name, intra.axis_name), (inter.size, intra.size)

        def mapped(in_axes, out_axes):
            f = fn
            for name, size in reversed(tuple(zip(names, sizes))):  # the innermost axis first
                f = jax.vmap(f, in_axes, out_axes, axis_name=name, axis_size=size)
            return f

        def leaves(function, axes, tree):
            return jax.tree.map(
                lambda a, x: x if a is None else function(x), axes, tree, is_leaf=_unmapped
            )

        def run(*args):
            if same:  # worker 0's row, unbatched
                args = jax.tree.map(lambda a: a[0], args)
                in_axes = jax.tree.map(lambda _: None, args)
            else:
                in_axes = uniform_axes(args)
                args = leaves(lambda a: a.reshape(*sizes, *a.shape[1:]), in_axes, args)
            # Which results are rank-uniform state is known from their structure only: one
            # abstract trace finds it. A result declared uniform that comes out different
            # per worker then makes vmap refuse its None out-axis, never keep one worker's.
            out_axes = uniform_axes(jax.eval_shape(mapped(in_axes, 0), *args))
            out = mapped(in_axes, out_axes)(*args)
            return leaves(lambda a: a.reshape(self.size, *a.shape[len(sizes) :]), out_axes, out)

        return jax.jit(run)

    def held(self, tree: Any) -> list[int]:
        """The indices, in ``jax.tree.leaves`` order, of ``tree``'s leaves held once (a
        state as ``spmd`` returns it)."""
        # None for an empty subtree (a fragment's outer state elsewhere): no leaf there.
        flags = jax.tree.map(
            lambda a, x: None if x is None else a is None, uniform_axes(tree), tree,
            is_leaf=_unmapped,
        )  # fmt: skip
        return [i for i, held in enumerate(jax.tree.leaves(flags)) if held]

    def spread(self, tree: Any) -> Any:
        """``tree`` with every leaf held once as host rows for all workers (a read-only
        NumPy broadcast view: no copies), the layout of the other leaves."""
        return jax.tree.map(
            lambda a, x: (
                x
                if a is not None or x is None
                else np.broadcast_to(np.asarray(x), (self.size, *np.shape(x)))
            ),
            uniform_axes(tree),
            tree,
            is_leaf=_unmapped,
        )

    def replicate(self, tree: Any) -> Any:
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (self.size, *a.shape)), tree)

    def local(self, per_worker: np.ndarray, batch: bool = True) -> np.ndarray:
        """This process's rows of an array with a leading worker axis: all of them."""
        return per_worker

    def steps_of(self, arrays: Any) -> np.ndarray:
        """Several steps' `local` arrays stacked on axis 1, after the workers'."""
        return np.stack(arrays, axis=1)

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


class MPIBackend(HostComm, CopyPerWorker, _WholeWorkers):
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

    def steps_of(self, arrays: Any) -> np.ndarray:
        """Several steps' `local` arrays stacked on axis 0 (one worker: no workers' axis)."""
        return np.stack(arrays)

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
