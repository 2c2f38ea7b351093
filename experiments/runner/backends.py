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
* ``device_loss`` / ``by_worker`` / ``whole_params``: what changes when a worker spans
  several devices (``devices_per_worker`` K > 1, `JaxBackend` only; the identity
  otherwise): the loss one device computes, its metrics combined per worker, and its
  parameters as whole leaves.

Per-worker values always have the same host layout, a leading axis over this process's
workers in rank order, whatever the tiers: only ``spmd`` knows how they are grouped. With
K > 1 the rows are devices, K per worker (row ``w * K + k`` is device ``k`` of worker
``w``), each holding piece ``k`` of every leaf of its worker.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shoal.comms import AxisCollective, MPICollective, ParameterServers

AXIS = "workers"
FSDP = "fsdp"  # the mesh axis over one worker's devices (devices_per_worker > 1)


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
    def mean_params(self, params: Any) -> Any: ...
    def device_loss(self, loss_fn): ...
    def by_worker(self, rows: tuple, ops: tuple[str, ...]) -> tuple: ...
    def whole_params(self, params: Any) -> Any: ...


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

    def mean_params(self, params: Any) -> Any:
        # Sum then divide, in float32, as the MPI backend does.
        return jax.tree.map(lambda a: np.asarray(a).sum(0) / np.float32(self.size), params)


class _HostComm:
    """Host-side traffic of the multi-process backends, on ``self.comm`` (an mpi4py
    communicator of their own, so it never interleaves with the algorithms' traffic)."""

    def share(self, obj: Any) -> Any:
        """The root's host value ``obj`` on every process (a pickled broadcast)."""
        return self.comm.bcast(obj, root=0)

    def gather_all(self, obj: Any) -> list[Any]:
        """Every process's host value ``obj``, in process order (a pickled all-gather)."""
        return self.comm.allgather(obj)

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


class MPIBackend(_HostComm, _WholeWorkers):
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


class JaxBackend(_HostComm):
    """One worker per device, or per ``devices_per_worker`` devices, of a
    ``jax.distributed`` job launched by ``mpiexec`` (its cluster detection through mpi4py;
    a single process needs no launcher): gloo collectives on CPU, NCCL on GPU nodes. The
    workers are the devices of a mesh over all processes, in process order; per-worker
    functions run under ``shard_map`` and communicate through `AxisCollective` over the mesh
    axes.

    Two tiers are a two-axis mesh ``("group", "member")`` of shape ``[size / group_size,
    group_size]`` over the same devices: worker ``w`` is member ``w % group_size`` of group
    ``w // group_size``, as in `SimBackend`, so consecutive devices (one node's GPUs) share
    a group. Host values go between processes with mpi4py on a communicator of their own.

    A worker of K = ``devices_per_worker`` > 1 devices (FSDP): the mesh gains a last axis
    ``"fsdp"`` of size K over the worker's consecutive devices, and shoal's collectives
    still run over the worker axes only. Every leaf is stored flattened, zero-padded to a
    multiple of K and cut into K equal pieces, device ``k`` holding piece ``k``: every leaf
    is sharded alike (as the fused buffers of GTC, BFB and 1-bit LAMB require) and a
    device's optimizer state covers its pieces only. `device_loss` gathers the whole leaves
    for the forward pass, on the device's share of the worker's batch (`local`), and
    scales the loss so that each piece's gradient is the worker's. The padding never
    gets a gradient; it is sent, and counted, like the rest of a piece. Leaf shapes come
    from `replicate`, which must lay out a tree before `device_loss` or `whole_params`
    meet it.
    """

    name = "jax"
    servers = None
    is_server = False

    def __init__(self, devices_per_worker: int = 1):
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
        k = devices_per_worker
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or len(devices) % k:
            raise ValueError(
                f"--devices-per-worker {k} must be an int >= 1 that divides the "
                f"{len(devices)} devices of this job"
            )
        self.devices = np.array(devices)
        self.devices_per_worker = k
        self.size = len(devices) // k
        # Host rows are devices in mesh order (row w * k + k' is device k' of worker w);
        # with k = 1 they are the workers. A worker is at home on the process of its first
        # device: that process reports its parameters (`whole_params`, `mean_params`).
        self._rows = tuple(r for r, d in enumerate(devices) if d.process_index == self.rank)
        self.local_ranks = tuple(r // k for r in self._rows if r % k == 0)
        self.collective = AxisCollective(AXIS, self.size)
        self._meshes: dict[int | None, tuple[Mesh, P]] = {}
        self._shapes: dict[Any, tuple[tuple[int, ...], ...]] = {}  # leaf shapes, by treedef
        self._joins: dict[Any, Any] = {}  # compiled `whole_params`, by treedef

    def two_tier(self, group_size: int) -> tuple[AxisCollective, AxisCollective]:
        return self.collective.split(group_size)

    def _layout(self, group_size: int | None) -> tuple[Mesh, P]:
        if group_size not in self._meshes:
            if group_size is None:
                axes, shape = (AXIS,), (self.size,)
            else:
                intra, inter = self.two_tier(group_size)
                axes, shape = (inter.axis_name, intra.axis_name), (inter.size, intra.size)
            if self.devices_per_worker > 1:
                axes, shape = (*axes, FSDP), (*shape, self.devices_per_worker)
            mesh = Mesh(self.devices.reshape(shape), axes)
            self._meshes[group_size] = mesh, P(axes if len(axes) > 1 else axes[0])
        return self._meshes[group_size]

    def spmd(self, fn, group_size: int | None = None):
        mesh, spec = self._layout(group_size)
        sharding = NamedSharding(mesh, spec)

        def per_worker(*args):
            # Each shard is one worker's (or device's) row: a leading block of size 1.
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
        k = self.devices_per_worker
        if k == 1:
            n = len(self._rows)
            return jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (n, *np.shape(a))), tree)
        leaves, treedef = jax.tree.flatten(tree)
        self._shapes[treedef] = tuple(np.shape(a) for a in leaves)
        pick = [r % k for r in self._rows]

        def pieces(a):
            flat = np.asarray(a).ravel()
            padded = np.zeros(-(-flat.size // k) * k, flat.dtype)
            padded[: flat.size] = flat
            return padded.reshape(k, -1)[pick]

        return treedef.unflatten([pieces(a) for a in leaves])

    def local(self, per_worker: np.ndarray, batch: bool = True) -> np.ndarray:
        """This process's rows of an array with a leading worker axis. With K devices per
        worker, each device's row: its worker's, and with ``batch`` its ``k``-th share of
        the worker's batch (the second axis, split in K equal parts)."""
        k = self.devices_per_worker
        rows = np.asarray(per_worker)[[r // k for r in self._rows]]
        if k == 1 or not batch:
            return rows
        if rows.ndim < 2 or rows.shape[1] % k:
            raise ValueError(
                f"a worker's batch of {rows.shape[1:2]} rows cannot be split over "
                f"--devices-per-worker {k}"
            )
        share = rows.shape[1] // k
        return np.stack(
            [row[(r % k) * share : (r % k + 1) * share] for row, r in zip(rows, self._rows)]
        )

    def stacked(self, tree: Any) -> Any:
        """This process's per-worker (per-device) values, as NumPy, with a leading axis
        over its rows."""
        return jax.tree.map(self._host_rows, tree)

    def unstacked(self, tree: Any) -> Any:
        """`stacked` rows as ``spmd`` functions take them: the same host rows."""
        return tree

    def _host_rows(self, a: Any, home: bool = False) -> np.ndarray:
        if not isinstance(a, jax.Array):
            return np.asarray(a)
        shards = sorted(a.addressable_shards, key=lambda s: s.index[0].start or 0)
        if home:  # one row per worker: its first device's (maybe none on this process)
            shards = [s for s in shards if (s.index[0].start or 0) % self.devices_per_worker == 0]
        if not shards:
            return np.zeros((0, *a.shape[1:]), a.dtype)
        return np.concatenate([np.asarray(s.data) for s in shards])

    def gather(self, tree: Any) -> Any:
        """``stacked`` values of all workers (devices), leading axis ``size * K``, on the
        root (else None)."""
        parts = self.comm.gather((self._rows, jax.device_get(tree)), root=0)
        if not self.is_root:
            return None
        order = np.argsort([r for rows, _ in parts for r in rows])
        rows = jax.tree.map(lambda *xs: np.concatenate(xs), *[t for _, t in parts])
        return jax.tree.map(lambda a: a[order], rows)

    def by_worker(self, rows: tuple, ops: tuple[str, ...]) -> tuple:
        """Gathered device rows combined into one row per worker.

        Args:
          rows: host arrays with a leading axis ``size * K`` (`gather`'s).
          ops: one per array: ``"sum"`` (what the worker's devices each sent), ``"mean"``
            (in float64) or ``"first"`` (a value its devices share, e.g. its loss).

        Returns:
          The arrays with a leading axis ``size``.
        """
        k = self.devices_per_worker
        if k == 1:
            return rows
        combine = {
            "sum": lambda a: a.sum(1),
            "mean": lambda a: a.mean(1, dtype=np.float64),
            "first": lambda a: a[:, 0],
        }
        return tuple(
            combine[op](np.asarray(a).reshape(self.size, k, *np.shape(a)[1:]))
            for a, op in zip(rows, ops, strict=True)
        )

    def _joined(self, pieces: Any) -> Any:
        """Inside `spmd`: the worker's whole leaves from this device's pieces."""
        leaves, treedef = jax.tree.flatten(pieces)
        shapes = self._shapes.get(treedef)
        if shapes is None:
            raise ValueError(
                "with --devices-per-worker > 1 a tree must be laid out by replicate() before "
                f"its whole leaves can be gathered; got {treedef}"
            )
        return treedef.unflatten(
            [
                lax.all_gather(p, FSDP, tiled=True)[: math.prod(s)].reshape(s)
                for p, s in zip(leaves, shapes)
            ]
        )

    def device_loss(self, loss_fn):
        """``loss_fn(params, x, y)`` of a worker as one of its devices computes it: on the
        whole leaves gathered from the pieces (FSDP), for the device's share of the batch,
        the K shares' mean (psum over ``"fsdp"``): the worker's loss, on each of its
        devices. The mean of the shares' means is the worker's mean loss when ``loss_fn``
        averages equally weighted examples of the batch's leading axis (every bundled
        task). Its gradient is each piece's share of the worker's: the transpose of the
        all-gather sums the devices' cotangents, each ``1 / K`` of a share's."""
        k = self.devices_per_worker
        if k == 1:
            return loss_fn

        def loss(pieces, x, y):
            return lax.psum(loss_fn(self._joined(pieces), x, y), FSDP) / k

        return loss

    def whole_params(self, params: Any) -> Any:
        """This process's workers' parameters (``local_ranks``, the workers whose first
        device is here), whole leaves stacked on a leading axis: device values or
        ``stacked`` host rows."""
        if self.devices_per_worker == 1:
            return self.stacked(params)
        treedef = jax.tree.structure(params)
        if treedef not in self._joins:
            self._joins[treedef] = self.spmd(self._joined)
        return jax.tree.map(lambda a: self._host_rows(a, home=True), self._joins[treedef](params))

    def mean_params(self, params: Any) -> Any:
        # Sum then divide, in float32, as the other backends do: this process's rows, then
        # across processes to the root (evaluation is rare; the model comes to the host).
        return self._mean_at_root(jax.tree.map(lambda a: a.sum(0), self.whole_params(params)))


def make_backend(
    name: str, workers: int | None = None, servers: int = 0, devices_per_worker: int = 1
):
    """``"sim"`` with ``workers`` workers, ``"mpi"`` (one worker per rank, the last
    ``servers`` ranks dedicated parameter servers), or ``"jax"`` (one worker per
    ``devices_per_worker`` devices of a ``jax.distributed`` job)."""
    if devices_per_worker != 1 and name != "jax":
        raise ValueError(f"--devices-per-worker needs --backend jax, not {name!r}")
    if name == "sim":
        return SimBackend(workers)
    if name == "mpi":
        return MPIBackend(servers)
    if name == "jax":
        return JaxBackend(devices_per_worker)
    raise ValueError(f"backend must be 'sim', 'mpi' or 'jax', got {name!r}")
