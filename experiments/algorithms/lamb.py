"""LAMB on the all-reduced gradients, the uncompressed baseline of ``onebit_lamb``:
`shoal.optim.onebit_lamb` whose warm-up stage (a dense all-reduce, then LAMB without bias
correction) never ends, so it runs the same rule as 1-bit LAMB's warm-up."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, register
from shoal.experiments.algorithms.parts import LambFields


@dataclasses.dataclass(frozen=True)
class LAMB(LambFields):
    """`LambFields`: the rule and its schedule."""


# The skip around the update and its application: the update, the same on every worker, is
# added to the parameters in the pass that computes it instead of being written out per
# worker first (1-bit LAMB's compression stage at 1.05M params x 16 simulated workers:
# 1.94x -> 1.84x local SGD's step, side by side in one process).
@register("lamb", LAMB, skip_in_place="apply", family="dense")
def build(p: LAMB, ctx: Context) -> optax.GradientTransformation:
    return p.rule(optim.onebit_lamb, ctx, freeze_step=ctx.run.steps + 1)
