"""Synchronous SGD, the reference: the gradients all-reduced (mean) every step
(`shoal.optim.allreduce_gradients`), then the local optimizer."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, Hyper, register
from shoal.experiments.algorithms.parts import LocalSGD


@dataclasses.dataclass(frozen=True)
class SSGD(Hyper):
    """``local``: the optimizer after the all-reduce."""

    local: LocalSGD = LocalSGD()


@register("ssgd", SSGD, skip_in_place=None, family="dense", reference=True, churn=True)
def build(p: SSGD, ctx: Context) -> optax.GradientTransformation:
    return optax.chain(optim.allreduce_gradients(collective=ctx.comms), p.local.make(ctx.run.steps))
