"""Synchronous data parallelism (S-SGD): every worker's gradient becomes the mean."""

from __future__ import annotations

from typing import Any, NamedTuple

import optax

from shoal.comms.agreement import check_same_structure
from shoal.comms.collective import Collective
from shoal.comms.wire import WireCount, WireMeter, all_reduce_bytes, tree_nbytes
from shoal.optim._validation import check_collective, checked


class AllReduceState(NamedTuple):
    wire: WireMeter  # bytes of the most recent update and since init


def allreduce_gradients(*, collective: Collective) -> optax.GradientTransformationExtraArgs:
    """Synchronous data parallelism: replace each worker's gradient by the workers' mean.

    One ring all-reduce of the whole pytree::

        g <- (1/N) sum_i g_i

    Chain it before any optax optimizer, e.g.
    ``optax.chain(allreduce_gradients(collective=c), optax.sgd(0.1))``, and wrap the
    chain in `shoal.optim.skip_nonfinite` to skip a step with a NaN/Inf gradient (a
    NaN in one worker's gradient makes the mean NaN on every worker).

    Args:
      collective: the workers to average over (`shoal.comms.Collective`).

    Returns:
      an ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` returns
      a `AllReduceState` and whose ``update(updates, state, params=None)`` returns
      ``(updates, new_state)``; the updates are the mean gradient, identical on
      every worker.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from shoal.comms import AxisCollective
      >>> coll = AxisCollective("workers", 2)
      >>> from shoal.optim import allreduce_gradients
      >>> tx = allreduce_gradients(collective=coll)
      >>> def mean_grad(g):
      ...     updates, _ = tx.update(g, tx.init(g))
      ...     return updates
      >>> grads = jnp.array([[1.0, 2.0], [3.0, 6.0]])  # one row per worker
      >>> print(jax.vmap(mean_grad, axis_name="workers")(grads))
      [[2. 4.]
       [2. 4.]]

    References:
      Sergeev & Del Balso, "Horovod: fast and easy distributed deep learning in
      TensorFlow", 2018 (ring all-reduce).
    """
    check_collective(collective)

    def init_fn(params: Any) -> AllReduceState:
        check_same_structure(params, collective)
        del params
        return AllReduceState(wire=WireMeter.zero())

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        updates = collective.all_reduce(updates, op="mean")
        wire = WireCount.of(*all_reduce_bytes(tree_nbytes(updates), collective.size))
        return updates, state._replace(wire=state.wire.record(wire))

    return optax.GradientTransformationExtraArgs(
        init_fn, checked("allreduce_gradients", AllReduceState, update_fn)
    )
