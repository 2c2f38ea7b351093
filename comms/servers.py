"""Dedicated parameter-server ranks (Herring, SC 2020): ``mpiexec -n W+S`` runs ``W``
workers and ``S`` servers on one communicator.

Worker ``w`` sends shard ``s`` of each balanced fusion buffer to server ``s``
(`ParameterServers.exchange`, inside ``jit`` through mpi4jax); server ``s`` sums the
``W`` copies and sends the sum back: two hops, each worker sends and receives every buffer
once. Servers run `ParameterServers.serve`, a host loop in NumPy/mpi4py, until worker 0
calls `ParameterServers.shutdown`; a server that hears nothing for ``timeout`` seconds
(a worker died, or forgot to shut it down) gives up with `TimeoutError`, so a job never
hangs forever on its servers.

Protocol (all on one clone of the communicator): worker 0 registers each buffer layout
with every server once, from the host, when the layout is traced (tag `TAG_PLAN`); the
shards of that layout travel with a tag derived from it, so several layouts can share
the servers; `TAG_STOP` ends the loop. MPI keeps the messages from one sender in order,
so a server sees a layout before its data and the stop after the last step.
"""

from __future__ import annotations

import time
import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from shoal.checks import check_int
from shoal.comms.mpi import MPICollective, _import_mpi

TAG_PLAN = 11
TAG_STOP = 12
_DATA_TAG0 = 1 << 20  # data tags: _DATA_TAG0 + a 20-bit layout id (MPI allows >= 2**29 - 1)

_HALF = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class ServerStats(NamedTuple):
    """What one server did, as returned by `ParameterServers.serve`.

    Args:
      steps: steps served.
      buffers: buffers reduced.
      received: bytes received from the workers.
      sent: bytes sent to the workers.

    Example:
      >>> from shoal.comms import ServerStats
      >>> stats = ServerStats(steps=10, buffers=20, received=8000, sent=2000)
      >>> stats.received // stats.buffers  # bytes received per buffer
      400
    """

    steps: int
    buffers: int
    received: int
    sent: int


class Layout(NamedTuple):
    """What a server needs to know about one buffer layout: the element dtype, the shard
    size of every buffer, and ``parts``: worker ``w`` contributes to part ``w % parts``
    (1, or the workers per node in hierarchical mode, where each local rank sends a
    different slice of the buffer)."""

    dtype: str
    shard_sizes: tuple[int, ...]
    parts: int

    @property
    def tag(self) -> int:
        return _DATA_TAG0 + zlib.crc32(repr(tuple(self)).encode()) % (1 << 20)


class ParameterServers:
    """Dedicated parameter-server ranks (MPI only): the last ``num_servers`` ranks serve.

    The other ranks are workers. Constructing it is collective over ``comm``. On worker
    ranks, `workers` is the `MPICollective` of the workers alone (world ranks
    ``0..W-1``, same order); on server ranks it is None and the rank calls `serve`.
    Frozen and hashable (by communicator), so transformations can close over it.

    Args:
      num_servers: int in ``[1, comm.size - 1]``, the number of server ranks.
      comm: an mpi4py communicator; None: a clone of ``MPI.COMM_WORLD``.

    Example:
      Four workers and two servers: ``mpiexec -n 6 python train.py`` with

      >>> import optax
      >>> from shoal.comms import ParameterServers
      >>> from shoal.optim import bfb_allreduce
      >>> ps = ParameterServers(num_servers=2)  # doctest: +SKIP
      >>> if ps.is_server:  # doctest: +SKIP
      ...     stats = ps.serve()  # until the workers shut the servers down
      ... else:
      ...     tx = optax.chain(bfb_allreduce(collective=ps.workers, servers=ps),
      ...                      optax.sgd(0.1))
      ...     ...  # train with tx, then:
      ...     ps.shutdown()

    References:
      A. Thangakrishnan et al., "Herring: Rethinking the Parameter Server at Scale for
      the Cloud", SC 2020.
    """

    __slots__ = ("comm", "num_servers", "num_workers", "workers", "_rank")

    def __init__(self, num_servers: int, comm: Any = None):
        MPI, _ = _import_mpi()
        if comm is None:
            comm = MPI.COMM_WORLD.Clone()
        size = comm.Get_size()
        num_servers = check_int(
            "num_servers",
            num_servers,
            1,
            size - 1,
            why=f" for a communicator of {size} ranks (at least one worker)",
        )
        rank = comm.Get_rank()
        is_server = rank >= size - num_servers
        sub = comm.Split(color=int(is_server), key=rank)
        set_ = lambda k, v: object.__setattr__(self, k, v)
        set_("comm", comm)
        set_("num_servers", num_servers)
        set_("num_workers", size - num_servers)
        set_("workers", None if is_server else MPICollective(sub))
        set_("_rank", rank)

    def __setattr__(self, name, value):
        raise AttributeError("ParameterServers is frozen")

    def __eq__(self, other):
        return isinstance(other, ParameterServers) and self.comm.py2f() == other.comm.py2f()

    def __hash__(self):
        return hash(("ParameterServers", self.comm.py2f()))

    def __repr__(self):
        return f"ParameterServers(workers={self.num_workers}, servers={self.num_servers})"

    @property
    def is_server(self) -> bool:
        return self._rank >= self.num_workers

    def server_rank(self, s: int) -> int:
        return self.num_workers + s

    # -- worker side ------------------------------------------------------------------

    def check_workers(self, **tiers: Any) -> None:
        """Refuse worker collectives these servers cannot serve, naming the keyword: the
        server ranks exchange with MPI worker ranks of the same world, so every tier
        given (None: absent) must be an `MPICollective`."""
        for name, tier in tiers.items():
            if tier is not None and not isinstance(tier, MPICollective):
                raise ValueError(
                    f"dedicated servers need MPI workers: {name} is a {type(tier).__name__}"
                )

    def register(self, layout: Layout) -> int:
        """Worker 0 tells every server about ``layout`` (host-side, once per process);
        returns the tag its shards travel with. Called at trace time by every worker."""
        if self.is_server:
            raise RuntimeError("register is called on worker ranks")
        known = _REGISTERED.setdefault(self.comm.py2f(), set())
        if self._rank == 0 and layout not in known:
            for s in range(self.num_servers):
                self.comm.send(tuple(layout), dest=self.server_rank(s), tag=TAG_PLAN)
        known.add(layout)
        return layout.tag

    def exchange(self, shards: jax.Array, tag: int) -> jax.Array:
        """Traced on a worker: send row ``s`` of ``shards`` (``[num_servers, k]``) to server
        ``s``, then receive the servers' sums, same shape."""
        if self.is_server:
            raise RuntimeError("exchange is called on worker ranks")
        if shards.ndim != 2 or shards.shape[0] != self.num_servers:
            raise ValueError(
                f"exchange needs shards of shape [{self.num_servers}, k], got {shards.shape}"
            )
        _, mpi4jax = _import_mpi()
        dtype = shards.dtype
        wire = _to_wire(shards)
        for s in range(self.num_servers):
            mpi4jax.send(wire[s], self.server_rank(s), tag=tag, comm=self.comm)
        got = [
            mpi4jax.recv(wire[s], self.server_rank(s), tag=tag, comm=self.comm)
            for s in range(self.num_servers)
        ]
        out = jnp.stack(got)
        return lax.bitcast_convert_type(out, dtype) if out.dtype != dtype else out

    def shutdown(self) -> None:
        """End the servers' loops: call on every worker after its last step (worker 0
        sends the stop, once every computation it dispatched has finished)."""
        if self.is_server:
            raise RuntimeError("shutdown is called on worker ranks")
        jax.effects_barrier()  # the last shards must leave before the stop
        if self._rank == 0:
            for s in range(self.num_servers):
                self.comm.send(None, dest=self.server_rank(s), tag=TAG_STOP)

    # -- server side ------------------------------------------------------------------

    def serve(self, *, timeout: float = 600.0) -> ServerStats:
        """Run this server until worker 0 says stop. Raises `TimeoutError` after ``timeout``
        seconds without progress."""
        if not self.is_server:
            raise RuntimeError("serve is called on server ranks")
        MPI, _ = _import_mpi()
        comm, workers = self.comm, self.num_workers
        layouts: dict[int, Layout] = {}
        steps = buffers = received = sent = 0
        status = MPI.Status()
        while True:
            _wait(lambda: comm.Iprobe(source=0, tag=MPI.ANY_TAG, status=status), timeout,
                  "a message from worker 0")  # fmt: skip
            tag = status.Get_tag()
            if tag == TAG_STOP:
                comm.recv(source=0, tag=TAG_STOP)
                return ServerStats(steps, buffers, received, sent)
            if tag == TAG_PLAN:
                layout = Layout(*comm.recv(source=0, tag=TAG_PLAN))
                old = layouts.setdefault(layout.tag, layout)
                if old != layout:
                    raise RuntimeError(f"layouts {old} and {layout} share tag {layout.tag}")
                continue
            layout = layouts.get(tag)
            if layout is None:
                raise RuntimeError(f"server got data with tag {tag} for an unknown layout")
            dtype = np.dtype(_HALF.get(layout.dtype, layout.dtype))
            wire = np.uint16 if layout.dtype in _HALF else dtype
            acc = np.float32 if layout.dtype in _HALF else dtype
            for k in layout.shard_sizes:
                inbox = np.empty((workers, k), wire)
                reqs = [comm.Irecv(inbox[w], source=w, tag=tag) for w in range(workers)]
                _wait(lambda reqs=reqs: MPI.Request.Testall(reqs), timeout, "the shards")
                vals = inbox.view(dtype).astype(acc)
                sums = np.stack(
                    [vals[p :: layout.parts].sum(0) for p in range(layout.parts)]
                ).astype(dtype)
                out = np.ascontiguousarray(sums.view(wire))
                reqs = [comm.Isend(out[w % layout.parts], dest=w, tag=tag) for w in range(workers)]
                _wait(lambda reqs=reqs: MPI.Request.Testall(reqs), timeout, "the workers")
                buffers += 1
                received += inbox.nbytes
                sent += workers * k * dtype.itemsize
            steps += 1


_REGISTERED: dict[int, set[Layout]] = {}


def _to_wire(x: jax.Array) -> jax.Array:
    # mpi4jax carries no 16-bit floats: move their bits.
    if x.dtype in (jnp.bfloat16, jnp.float16):
        return lax.bitcast_convert_type(x, jnp.uint16)
    return x


def _wait(done, timeout: float, what: str) -> None:
    """Poll ``done()`` with a growing sleep, capped at 0.5 ms: servers must not burn the
    workers' cores, but large transfers only progress while the server is inside MPI, and
    a 5 ms cap cost ~18 ms per buffer (benchmarks/bfb_allreduce.py)."""
    start = time.monotonic()
    pause = 1e-5
    while not done():
        if time.monotonic() - start > timeout:
            raise TimeoutError(
                f"parameter server waited {timeout:.0f} s for {what}: a worker died or did "
                "not call ParameterServers.shutdown()"
            )
        time.sleep(pause)
        pause = min(pause * 2, 5e-4)
