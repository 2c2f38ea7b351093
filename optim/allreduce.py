"""Synchronous data parallelism (S-SGD): every worker's gradient becomes the mean."""

from __future__ import annotations

from typing import Any, NamedTuple

import optax

from shoal.comms.agreement import check_same_structure
from shoal.comms.collective import Collective
from shoal.comms.wire import WireCount, all_reduce_bytes, tree_nbytes
from shoal.optim.validation import check_collective


class AllReduceState(NamedTuple):
    wire: WireCount


def allreduce_gradients(*, collective: Collective) -> optax.GradientTransformationExtraArgs:
    """Replace each worker's gradient by the mean over workers,
    ``g <- (1/N) sum_i g_i``, with one ring all-reduce of the whole pytree.

    Chain it before any optax optimizer, e.g.
    ``optax.chain(allreduce_gradients(collective=c), optax.sgd(0.1))``.

    Args:
      collective: the workers to average over (`shoal.comms.Collective`).
    """
    check_collective(collective)

    def init_fn(params: Any) -> AllReduceState:
        check_same_structure(params, collective)
        del params
        return AllReduceState(wire=WireCount.zero())

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        updates = collective.all_reduce(updates, op="mean")
        wire = WireCount.of(*all_reduce_bytes(tree_nbytes(updates), collective.size))
        return updates, AllReduceState(wire=wire)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
