"""1-bit LAMB (`shoal.optim.onebit_lamb`; Li et al. 2021): LAMB on the all-reduced
gradients for the warm-up stage, then the momentum through the 1-bit error-compensated
compressed all-reduce with the frozen variance. Reports set it beside ``lamb``."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, register
from shoal.experiments.algorithms.parts import OneBitFields, onebit_warmup


@dataclasses.dataclass(frozen=True)
class OneBitLAMB(OneBitFields):
    """`OneBitFields`: LAMB's rule and schedule, and the warm-up stage's length."""


# "apply": as lamb's (its module says why).
@register(
    "onebit_lamb",
    OneBitLAMB,
    skip_in_place="apply",
    family="compressed",
    compares_to="lamb",
    warmup=onebit_warmup,
)
def build(p: OneBitLAMB, ctx: Context) -> optax.GradientTransformation:
    return p.rule(optim.onebit_lamb, ctx, freeze_step=p.frozen_at(ctx.run.steps))
