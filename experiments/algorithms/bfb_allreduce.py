"""Herring's balanced fusion buffers (`shoal.optim.bfb_allreduce`), then the local
optimizer: the mean gradient, reduced buffer by buffer in the order the backward pass
produces the gradients, by the workers themselves (colocated) or, in an MPI run started
with ``--servers S``, by S dedicated server ranks."""

from __future__ import annotations

import dataclasses

import jax
import optax

from shoal import optim
from shoal.comms import gradient_order
from shoal.experiments.algorithms._registry import Context, Hyper, register
from shoal.experiments.algorithms.parts import LocalSGD


@dataclasses.dataclass(frozen=True)
class BFBAllReduce(Hyper):
    """``buffer_bytes``: bytes per fusion buffer (0: automatic)."""

    buffer_bytes: int = 0
    local: LocalSGD = LocalSGD()


@register("bfb_allreduce", BFBAllReduce, skip_in_place=None, family="dense")
def build(p: BFBAllReduce, ctx: Context) -> optax.GradientTransformation:
    order = None
    if ctx.task is not None:
        params = ctx.task.init_params()
        x, y = ctx.task.batch(0, 1)
        spec = lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype)  # one worker's batch
        order = gradient_order(ctx.task.loss, params, spec(x), spec(y))
    reduce = optim.bfb_allreduce(
        collective=ctx.comms,
        buffer_bytes=p.buffer_bytes or None,
        servers=ctx.servers,
        order=order,
    )
    return optax.chain(reduce, p.local.make(ctx.run.steps))
