"""Where the workers live: simulated in this process (``vmap``), one per MPI rank, or one
per device of a ``jax.distributed`` job (``shard_map`` over a mesh of all processes' devices).

All backends expose the same small interface to the training loop:

* ``collective``: what the algorithms communicate through;
* ``two_tier(group_size)``: the ``(intra, inter)`` collectives of two-tier algorithms;
* ``spmd(fn, group_size=None)``: compile a per-worker function for all of this
  process's workers; with a ``group_size``, ``fn`` may use ``two_tier(group_size)``;
* ``replicate`` / ``local``: per-worker layout of parameters and of global batches;
* ``gather`` / ``mean_params``: host-side metrics for the root process (rank 0);
* ``share``: a host value of the root on every process (e.g. a policy's decision).

Per-worker values always have the same host layout, a leading axis over this process's
workers in rank order, whatever the tiers: only ``spmd`` knows how they are grouped.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shoal.comms import AxisCollective, MPICollective, ParameterServers

AXIS = "workers"


class SimBackend:
    """``size`` workers in one process: per-worker values are stacked on a leading axis
    and per-worker functions run under ``jax.vmap(..., axis_name="workers")``.

    Two tiers are two nested vmap axes, ``"group"`` (outer, ``M = size / group_size``)
    and ``"member"`` (inner, ``group_size``): worker ``w`` is member ``w % group_size``
    of group ``w // group_size``, so ``spmd`` reshapes every argument from ``[size,
    ...]`` to ``[M, group_size, ...]`` and its results back.
    """

    name = "sim"
    is_root = True

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

    def local(self, per_worker: np.ndarray) -> np.ndarray:
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

    def mean_params(self, params: Any) -> Any:
        # Sum then divide, in float32, as the MPI backend does.
        return jax.tree.map(lambda a: np.asarray(a).sum(0) / np.float32(self.size), params)


class _HostComm:
    """Host-side traffic of the multi-process backends, on ``self.comm`` (an mpi4py
    communicator of their own, so it never interleaves with the algorithms' traffic)."""

    def share(self, obj: Any) -> Any:
        """The root's host value ``obj`` on every process (a pickled broadcast)."""
        return self.comm.bcast(obj, root=0)

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
        self._MPI.COMM_WORLD.Abort(code)


class MPIBackend(_HostComm):
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

    def local(self, per_worker: np.ndarray) -> np.ndarray:
        return per_worker[self.rank]

    def stacked(self, tree: Any) -> Any:
        return jax.tree.map(lambda a: np.asarray(a)[None], tree)

    def gather(self, tree: Any) -> Any:
        parts = self.comm.gather(jax.device_get(tree), root=0)
        if not self.is_root:
            return None
        return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)

    def mean_params(self, params: Any) -> Any:
        return self._mean_at_root(params)


class JaxBackend(_HostComm):
    """One worker per device of a ``jax.distributed`` job, launched by ``mpiexec`` (its
    cluster detection through mpi4py): gloo collectives on CPU (one device per process),
    NCCL on GPU nodes (every local GPU a worker). The workers are the devices of a mesh
    over all processes, in process order; per-worker functions run under ``shard_map``
    and communicate through `AxisCollective` over the mesh axes.

    Two tiers are a two-axis mesh ``("group", "member")`` of shape ``[size / group_size,
    group_size]`` over the same devices: worker ``w`` is member ``w % group_size`` of group
    ``w // group_size``, as in `SimBackend`, so consecutive devices (one node's GPUs) share
    a group. Host values go between processes with mpi4py on a communicator of their own.
    """

    name = "jax"
    servers = None
    is_server = False

    def __init__(self):
        from mpi4py import MPI

        self._MPI = MPI
        if not jax.distributed.is_initialized():
            # Must precede initialize; only the CPU client reads it, so harmless on GPUs.
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(cluster_detection_method="mpi4py")
        # ``rank`` is this process's index (the root is 0); the host communicator ranks
        # processes in the same order, whoever initialised jax.distributed.
        self.rank = jax.process_index()
        self.comm = MPI.COMM_WORLD.Split(0, self.rank)
        self.is_root = self.rank == 0
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        self.devices = np.array(devices)
        self.size = len(devices)
        self.local_ranks = tuple(w for w, d in enumerate(devices) if d.process_index == self.rank)
        self.collective = AxisCollective(AXIS, self.size)
        self._mesh = Mesh(self.devices, (AXIS,))

    def two_tier(self, group_size: int) -> tuple[AxisCollective, AxisCollective]:
        return self.collective.split(group_size)

    def _layout(self, group_size: int | None) -> tuple[Mesh, P]:
        if group_size is None:
            return self._mesh, P(AXIS)
        intra, inter = self.two_tier(group_size)
        mesh = Mesh(
            self.devices.reshape(inter.size, intra.size), (inter.axis_name, intra.axis_name)
        )
        return mesh, P((inter.axis_name, intra.axis_name))

    def spmd(self, fn, group_size: int | None = None):
        mesh, spec = self._layout(group_size)
        sharding = NamedSharding(mesh, spec)

        def per_worker(*args):
            # Each shard is one worker's row: a leading block of size 1.
            out = fn(*jax.tree.map(lambda a: a[0], args))
            return jax.tree.map(lambda a: jnp.asarray(a)[None], out)

        # JAX's default checks: shoal's branches agree on what varies over the mesh axes.
        mapped = jax.jit(jax.shard_map(per_worker, mesh=mesh, in_specs=spec, out_specs=spec))

        def run(*args):
            return mapped(*jax.tree.map(lambda a: self._global(a, sharding), args))

        return run

    def _global(self, a: Any, sharding: NamedSharding) -> jax.Array:
        """A per-worker value as a global array: host rows of this process's workers, or an
        earlier result (moved onto ``sharding``'s mesh without leaving the devices)."""
        if isinstance(a, jax.Array) and a.sharding == sharding:
            return a
        if isinstance(a, jax.Array) and isinstance(a.sharding, NamedSharding):
            if not a.sharding.is_equivalent_to(sharding, a.ndim):
                raise ValueError(f"per-worker array with an unexpected sharding {a.sharding}")
            by_device = {s.device: s.data for s in a.addressable_shards}
            shards = [by_device[d] for d in sharding.addressable_devices_indices_map(a.shape)]
            return jax.make_array_from_single_device_arrays(a.shape, sharding, shards)
        return jax.make_array_from_process_local_data(sharding, np.asarray(a))

    def replicate(self, tree: Any) -> Any:
        n = len(self.local_ranks)
        return jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (n, *np.shape(a))), tree)

    def local(self, per_worker: np.ndarray) -> np.ndarray:
        """This process's rows of an array with a leading worker axis."""
        return per_worker[list(self.local_ranks)]

    def stacked(self, tree: Any) -> Any:
        """This process's per-worker values, as NumPy, with a leading axis over
        ``local_ranks``."""

        def rows(a):
            if not isinstance(a, jax.Array):
                return np.asarray(a)
            shards = sorted(a.addressable_shards, key=lambda s: s.index[0].start or 0)
            return np.concatenate([np.asarray(s.data) for s in shards])

        return jax.tree.map(rows, tree)

    def gather(self, tree: Any) -> Any:
        """``stacked`` values of all workers, leading axis ``size``, on the root (else None)."""
        parts = self.comm.gather((self.local_ranks, jax.device_get(tree)), root=0)
        if not self.is_root:
            return None
        order = np.argsort([w for ranks, _ in parts for w in ranks])
        rows = jax.tree.map(lambda *xs: np.concatenate(xs), *[t for _, t in parts])
        return jax.tree.map(lambda a: a[order], rows)

    def mean_params(self, params: Any) -> Any:
        # Sum then divide, in float32, as the other backends do: this process's rows, then
        # across processes to the root (evaluation is rare; the model comes to the host).
        return self._mean_at_root(jax.tree.map(lambda a: a.sum(0), self.stacked(params)))


def make_backend(name: str, workers: int | None = None, servers: int = 0):
    """``"sim"`` with ``workers`` workers, ``"mpi"`` (one worker per rank, the last
    ``servers`` ranks dedicated parameter servers), or ``"jax"`` (one worker per device of
    a ``jax.distributed`` job)."""
    if name == "sim":
        return SimBackend(workers)
    if name == "mpi":
        return MPIBackend(servers)
    if name == "jax":
        return JaxBackend()
    raise ValueError(f"backend must be 'sim', 'mpi' or 'jax', got {name!r}")
