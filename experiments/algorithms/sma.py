"""Synchronous model averaging (`shoal.optim.sma`) around the local optimizer: every step
``v <- (1 - alpha) v + alpha mean(v)``, then the local update."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, Hyper, register
from shoal.experiments.algorithms.parts import LocalSGD


@dataclasses.dataclass(frozen=True)
class SMA(Hyper):
    """``alpha``: how far every model moves to the mean per step; the local optimizer."""

    alpha: float = 0.1
    local: LocalSGD = LocalSGD()


@register("sma", SMA, skip_in_place="apply", family="local")
def build(p: SMA, ctx: Context) -> optax.GradientTransformation:
    return optim.sma(p.local.make(ctx.run.steps), collective=ctx.comms, alpha=p.alpha)
