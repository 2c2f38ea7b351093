"""Strom's threshold compression of the gradients (`shoal.optim.gtc`), then the local
optimizer."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, register
from shoal.experiments.algorithms.parts import GTCFields, LocalSGD


@dataclasses.dataclass(frozen=True)
class GTC(GTCFields):
    """`GTCFields` (threshold, capacity) and the local optimizer."""

    local: LocalSGD = LocalSGD()


@register("gtc", GTC, skip_in_place=False, family="compressed")
def build(p: GTC, ctx: Context) -> optax.GradientTransformation:
    tx = optim.gtc(p.threshold, collective=ctx.comms, capacity=p.capacity)
    return optax.chain(tx, p.local.make(ctx.run.steps))
