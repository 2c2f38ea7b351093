"""PowerSGD (`shoal.optim.powersgd`; Vogels et al. 2019), then the local optimizer."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, Hyper, register
from shoal.experiments.algorithms.parts import LocalSGD


@dataclasses.dataclass(frozen=True)
class PowerSGD(Hyper):
    """The rank of the approximation, the plain all-reduce steps before it starts, and
    the local optimizer (the run's seed draws the first Q)."""

    rank: int = 4
    start_step: int = 0
    local: LocalSGD = LocalSGD()


@register("powersgd", PowerSGD, skip_in_place=None, family="compressed", churn=True)
def build(p: PowerSGD, ctx: Context) -> optax.GradientTransformation:
    tx = optim.powersgd(p.rank, collective=ctx.comms, start_step=p.start_step, seed=ctx.run.seed)
    return optax.chain(tx, p.local.make(ctx.run.steps))
