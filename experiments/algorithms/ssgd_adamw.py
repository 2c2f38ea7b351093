"""S-SGD with AdamW: the gradients all-reduced every step
(`shoal.optim.allreduce_gradients`), then AdamW, DiLoCo's inner optimizer, so that this
baseline and DiLoCo differ only in how often they synchronise."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, Hyper, register
from shoal.experiments.algorithms.parts import AdamW


@dataclasses.dataclass(frozen=True)
class SSGDAdamW(Hyper):
    """``adamw``: the optimizer after the all-reduce."""

    adamw: AdamW = AdamW()


@register("ssgd_adamw", SSGDAdamW, skip_in_place=None, family="dense", churn=True)
def build(p: SSGDAdamW, ctx: Context) -> optax.GradientTransformation:
    return optax.chain(optim.allreduce_gradients(collective=ctx.comms), p.adamw.make(ctx.run.steps))
