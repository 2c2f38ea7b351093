"""The ``jax`` backend (`JaxBackend`): one worker per device, or per group of K devices, of a
``jax.distributed`` job, per-worker functions running under ``shard_map`` over a mesh of all
processes' devices. The interface it implements, and the host layout of per-worker values,
are `shoal.experiments.runner.backends`'.
"""

from __future__ import annotations

import ipaddress
import math
import socket
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shoal.comms import AxisCollective
from shoal.experiments.runner.backends import AXIS, CopyPerWorker, HostComm

FSDP = "fsdp"  # the mesh axis over one worker's devices (devices_per_worker > 1)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _coordinator_on_root(hosts: list[str], bind: str | None) -> tuple[str, str]:
    """`coordinator`'s choice, made on process 0 (``hosts``: every process's host name)."""
    one_host = len(set(hosts)) == 1
    if bind is None:
        if one_host:
            bind = "127.0.0.1"
        else:
            try:
                bind = socket.getaddrinfo(hosts[0], None, type=socket.SOCK_STREAM)[0][4][0]
            except OSError as e:
                raise ValueError(
                    f"cannot resolve process 0's host name {hosts[0]} ({e}): pass "
                    "--coordinator-bind-address with its address"
                ) from None
            if ipaddress.ip_address(bind).is_loopback:
                raise ValueError(
                    f"process 0's host name {hosts[0]} resolves to the loopback address "
                    f"{bind}, which the processes on other hosts cannot reach: pass "
                    "--coordinator-bind-address with its address on their network"
                )
    wildcard = bind in ("0.0.0.0", "::", "[::]")
    bind = bind.strip("[]")
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:  # a free port there
            probe.bind((bind, 0))
            port = probe.getsockname()[1]
    except OSError as e:
        raise ValueError(f"--coordinator-bind-address {bind}: cannot listen there: {e}") from None
    # Processes connect to the bound address; to the host name when every interface listens.
    connect = ("127.0.0.1" if one_host else hosts[0]) if wildcard else bind
    return _host_port(connect, port), _host_port(bind, port)


def coordinator(comm: Any, bind: str | None = None) -> tuple[str, str]:
    """The ``jax.distributed`` coordinator's address and the address it listens on, both
    ``host:port``, chosen on process 0 of the mpi4py communicator ``comm`` and the same on
    every process.

    jax binds its coordinator to all interfaces (``[::]``) unless told otherwise; it
    accepts any connection without authentication for the whole run. Here it listens on
    ``bind`` when given (an address of process 0's host; ``0.0.0.0`` restores jax's
    default), else on the loopback address when every process runs on one host, else on
    the address process 0's host name resolves to. The port is one that is free there.

    Raises:
      ValueError: on every process, when no such address can be used (process 0's name
        resolves to a loopback address while other hosts take part; ``bind`` is not an
        address of process 0's host).
    """
    hosts = comm.allgather(socket.gethostname())
    choice: tuple[str, str] | str = ""
    if comm.Get_rank() == 0:
        try:
            choice = _coordinator_on_root(hosts, bind)
        except ValueError as e:
            choice = str(e)
    choice = comm.bcast(choice, root=0)
    if isinstance(choice, str):
        raise ValueError(choice)
    return choice


class JaxBackend(HostComm, CopyPerWorker):
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

    def __init__(self, devices_per_worker: int = 1, bind_address: str | None = None):
        from mpi4py import MPI

        self._MPI = MPI
        self.coordinator = None  # (address, bind address) when initialised here
        if not jax.distributed.is_initialized():
            # Must precede initialize; only the CPU client reads it, so harmless on GPUs.
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            self.coordinator = address, bind = coordinator(MPI.COMM_WORLD, bind_address)
            jax.distributed.initialize(
                coordinator_address=address,
                coordinator_bind_address=bind,
                cluster_detection_method="mpi4py",
            )
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

    def steps_of(self, arrays: Any) -> np.ndarray:
        """Several steps' `local` arrays stacked on axis 1, after the devices' rows."""
        return np.stack(arrays, axis=1)

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
