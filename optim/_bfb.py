"""Herring's gradient averaging through balanced fusion buffers (BFB).

Thangakrishnan et al., "Herring: Rethinking the Parameter Server at Scale for the Cloud"
(SC 2020), section III. The gradients are laid out in buffers of equal size
(`shoal.comms.plan_fusion`), each cut into one equal shard per server, so every server
carries the same load for every buffer; the result is the mean gradient
``g <- (1/W) sum_w g_w`` on every worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shoal.checks import check_int
from shoal.comms.agreement import check_same_structure
from shoal.comms.collective import Collective, is_simulated, reduce_scatter
from shoal.comms.fusion import FusionPlan, plan_fusion
from shoal.comms.order import broadcast_order
from shoal.comms.servers import Layout, ParameterServers
from shoal.comms.shards import check_sharded_alike
from shoal.comms.wire import WireCount, WireMeter, all_gather_bytes, all_to_all_bytes
from shoal.dtypes import promote_types
from shoal.optim._validation import check_collective, checked


class BFBState(NamedTuple):
    wire: WireMeter  # bytes of the most recent update and since init


def bfb_allreduce(
    *,
    collective: Collective,
    buffer_bytes: int | None = None,
    servers: ParameterServers | None = None,
    intra: Collective | None = None,
    order: Sequence[int] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Herring's gradient mean over all workers through balanced fusion buffers.

    ``g <- (1/W) sum_w g_w``, reduced buffer by buffer. The mode follows the arguments:

    1. colocated (``servers=None, intra=None``): the ``P`` workers of ``collective`` also
       serve shard ``p`` of every buffer: reduce-scatter (all-to-all, then a local sum),
       then all-gather. ``2 (P-1)/P`` of each buffer each way, like a ring all-reduce.
    2. dedicated servers (``servers``, MPI): worker ``w`` sends shard ``s`` of each buffer
       to server rank ``s`` of `ParameterServers`, which sums the ``W`` copies and sends the
       sum back: each worker sends and receives every buffer once (two hops). Pass
       ``collective=servers.workers``.
    3. hierarchical (``intra``, the within-node tier of `shoal.comms.two_tier`; then
       ``collective`` is the across-node tier): reduce-scatter each buffer inside the
       node, reduce each worker's slice across nodes (mode 1 over ``collective``, or mode 2
       with ``servers``), all-gather inside the node (Herring's steps 1-6).

    Buffers are reduced one after another in layout order, each from only its own
    leaves, so a buffer's communication can start as soon as its gradients exist.
    Simulated workers (an `AxisCollective` under ``vmap``, modes 1 and 3) sum the same
    values leaf by leaf instead: a buffer's layout decides what its exchange costs, not
    an element's sum over the workers, and under vmap the buffers would only copy the
    model into them and back. The wire count is the fused exchange's either way.

    To skip steps with a NaN/Inf gradient, wrap the chain in `shoal.optim.skip_nonfinite`
    with the workers' collectives (``(intra, collective)`` in mode 3): the flag never goes
    to the servers.

    Args:
      collective: all workers (modes 1, 2), or the across-node tier (mode 3).
      buffer_bytes: bytes per buffer (None: `shoal.comms.fusion.auto_buffer_bytes`).
      servers: dedicated parameter-server ranks (MPI only).
      intra: the within-node tier for hierarchical reduction.
      order: production order of the gradient leaves (`shoal.comms.gradient_order`);
        worker 0's order is broadcast to all at construction, so construct this on every
        worker at the same point. None: leaf order.

    Returns:
      an ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` returns
      a `BFBState` and whose ``update(updates, state, params=None)`` returns
      ``(updates, new_state)``; the updates are the mean gradient, identical on
      every worker.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from shoal.comms import AxisCollective
      >>> coll = AxisCollective("workers", 2)
      >>> from shoal.optim import bfb_allreduce
      >>> tx = bfb_allreduce(collective=coll, buffer_bytes=8)
      >>> def mean_grad(g):
      ...     updates, _ = tx.update(g, tx.init(g))
      ...     return updates
      >>> grads = {"a": jnp.array([[1.0, 2.0], [3.0, 6.0]]), "b": jnp.array([[0.0], [4.0]])}
      >>> print(jax.vmap(mean_grad, axis_name="workers")(grads))
      {'a': Array([[2., 4.],
             [2., 4.]], dtype=float32), 'b': Array([[2.],
             [2.]], dtype=float32)}

    References:
      Thangakrishnan et al., "Herring: Rethinking the Parameter Server at Scale
      for the Cloud", SC 2020, section III.
    """
    check_collective(collective)
    if buffer_bytes is not None:
        buffer_bytes = check_int(
            "buffer_bytes",
            buffer_bytes,
            1,
            why=" or None (static: the layout is fixed at trace time)",
        )
    if intra is not None:
        check_collective(intra)
    local = intra.size if intra is not None else 1
    workers = local * collective.size
    if servers is not None:
        _check_servers(servers, collective, intra, workers)
        shards = servers.num_servers
    else:
        shards = collective.size
    if order is not None:
        # Worker 0's order reaches every worker: node 0 first, then every node.
        for tier in (intra, collective):
            if tier is not None:
                order = broadcast_order(order, tier)

    def init_fn(params: Any) -> BFBState:
        for tier in (intra, collective):
            if tier is not None:
                check_same_structure(params, tier)
        del params
        return BFBState(wire=WireMeter.zero())

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        check_sharded_alike("bfb_allreduce", jax.tree.leaves(updates), tiers)
        plan = plan_fusion(
            updates, buffer_bytes=buffer_bytes, num_shards=local * shards, order=order
        )
        tag = None
        if servers is not None:
            tag = servers.register(Layout(plan.dtype.name, plan.shard_sizes, local))
        item = plan.dtype.itemsize
        sent = sum(
            _sent_bytes(plan.num_shards * k * item, collective, intra, servers)
            for k in plan.shard_sizes
        )
        wire = state.wire.record(WireCount.of(sent, sent))
        if servers is None and all(is_simulated(t) for t in tiers):
            # Simulated workers: where an element sits in the buffers changes what the
            # exchange costs (counted above from the plan), not its sum over the workers,
            # which is the same dot over their rows either way. Reduced leaf by leaf, the
            # step does not copy the model into fusion buffers and back.
            return _mean_by_leaf(updates, plan.dtype, tiers, workers), state._replace(wire=wire)
        reduced = []
        for b, buf in enumerate(plan.fuse(updates)):
            total = _reduce(buf, plan, b, collective, intra, servers, tag)
            reduced.append((total / workers).astype(plan.dtype))
        return plan.unfuse(reduced), state._replace(wire=wire)

    tiers = tuple(t for t in (intra, collective) if t is not None)
    return optax.GradientTransformationExtraArgs(
        init_fn, checked("bfb_allreduce", BFBState, update_fn)
    )


def _reduce(buf, plan: FusionPlan, b: int, collective, intra, servers, tag):
    """The sum over all workers of buffer ``buf`` (``[L * S, k]``), in a float type wide
    enough for the sum."""
    local = intra.size if intra is not None else 1
    k = plan.shard_sizes[b]
    acc = promote_types(plan.dtype, jnp.float32)
    part = buf
    if intra is not None:
        # Step 1: reduce-scatter inside the node; local rank l keeps slice l, summed.
        got = reduce_scatter(intra, buf.reshape(local, -1))
        part = got.astype(plan.dtype).reshape(-1, k)
    if servers is not None:
        total = servers.exchange(part, tag).astype(acc)
    else:
        mine = reduce_scatter(collective, part)
        total = collective.all_gather(mine.astype(plan.dtype)).astype(acc)
    if intra is not None:
        total = intra.all_gather(total.astype(plan.dtype)).astype(acc)
    return total.reshape(buf.shape)


def _sent_bytes(n: int, collective, intra, servers) -> int:
    """Bytes a worker sends (= receives) to reduce one buffer of ``n`` bytes (`_reduce`)."""
    local = intra.size if intra is not None else 1
    sent = all_to_all_bytes(n, local)[0] if intra is not None else 0
    m = n // local  # this worker's slice
    if servers is not None:
        sent += m
    else:
        sent += all_to_all_bytes(m, collective.size)[0]
        sent += all_gather_bytes(m // collective.size, collective.size)[0]
    if intra is not None:
        sent += all_gather_bytes(m, local)[0]
    return sent


def _mean_by_leaf(updates, dtype, tiers, workers):
    """`_reduce`'s arithmetic leaf by leaf: each leaf as sent (``dtype``), summed over the
    workers of every tier in a float type wide enough, sent back as ``dtype``, then
    divided by the number of workers."""
    acc = promote_types(dtype, jnp.float32)

    def one(x):
        total = x.astype(dtype).astype(acc)
        for tier in tiers:  # within the node, then across nodes, as `_reduce` sums
            total = tier.all_reduce(total, "sum").astype(dtype).astype(acc)
        return (total / workers).astype(dtype).astype(x.dtype)

    return jax.tree.map(one, updates)


def _check_servers(servers, collective, intra, workers: int) -> None:
    if not isinstance(servers, ParameterServers):
        raise TypeError(f"servers must be a ParameterServers, got {type(servers).__name__}")
    if servers.is_server:
        raise ValueError("bfb_allreduce runs on worker ranks; server ranks call servers.serve()")
    servers.check_workers(collective=collective, intra=intra)
    if workers != servers.num_workers:
        tiers = f"{intra.size} x {collective.size}" if intra is not None else collective.size
        raise ValueError(
            f"the collectives hold {tiers} = {workers} workers but the communicator has "
            f"{servers.num_workers} worker ranks (+ {servers.num_servers} servers)"
        )


def server_bytes_per_step(plan: FusionPlan, num_workers: int) -> int:
    """Bytes one dedicated server receives (and sends) per step: one shard of every
    buffer from (to) every worker."""
    return int(num_workers * np.sum(plan.shard_bytes))
