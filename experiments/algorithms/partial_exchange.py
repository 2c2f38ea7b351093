"""KungFu's partial gradient exchange (`shoal.optim.partial_exchange`): one bin of
``fraction`` of the gradient bytes averaged per step, round robin, then the local
optimizer."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, Hyper, register
from shoal.experiments.algorithms.parts import LocalSGD


@dataclasses.dataclass(frozen=True)
class PartialExchange(Hyper):
    """``fraction``: the gradient bytes exchanged per step; the local optimizer."""

    fraction: float = 0.3
    local: LocalSGD = LocalSGD()


@register("partial_exchange", PartialExchange, skip_in_place=True, family="local")
def build(p: PartialExchange, ctx: Context) -> optax.GradientTransformation:
    return optax.chain(
        optim.partial_exchange(p.fraction, collective=ctx.comms), p.local.make(ctx.run.steps)
    )
