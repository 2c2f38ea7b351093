"""1-bit Adam (`shoal.optim.onebit_adam`; Tang et al. 2021): Adam on the all-reduced
gradients for the warm-up stage, then the momentum through the 1-bit error-compensated
compressed all-reduce with the frozen variance."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, register
from shoal.experiments.algorithms.parts import OneBitFields


@dataclasses.dataclass(frozen=True)
class OneBitAdam(OneBitFields):
    """`OneBitFields`: the rate schedule, b1, b2, weight decay, and the warm-up stage."""


# "apply": the update is the same on every worker (as 1-bit LAMB's).
@register("onebit_adam", OneBitAdam, skip_in_place="apply", family="compressed")
def build(p: OneBitAdam, ctx: Context) -> optax.GradientTransformation:
    return p.rule(optim.onebit_adam, ctx, freeze_step=p.frozen_at(ctx.run.steps))
