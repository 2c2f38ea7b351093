"""Async DiLoCo (`shoal.experiments.asynchronous.simulate`; Liu et al. 2024): each worker
runs its inner optimizer for a round and pushes its pseudo-gradient, which the server
applies on arrival with Delayed Nesterov (`shoal.experiments.asynchronous.
delayed_nesterov`: the momentum updated every ``nesterov_period`` arrivals, plain steps
between); with ``dynamic_steps`` (DyLU) a slower worker runs proportionally fewer steps
per round. Simulated workers only, on the clock of ``speeds``.

Example (a config entry): ``async_diloco[sync_every=20;dynamic_steps=false]``.
"""

from __future__ import annotations

import dataclasses

import optax

from shoal.experiments.algorithms._registry import Context, register
from shoal.experiments.algorithms.parts import InnerOptimizer, OuterSGD, RoundFields
from shoal.experiments.asynchronous import Plan, delayed_nesterov
from shoal.experiments.fields import check_field


@dataclasses.dataclass(frozen=True)
class AsyncDiLoCo(RoundFields):
    """Inner steps per round H (`RoundFields`), the inner optimizer, the outer Nesterov
    step's rate and momentum (DiLoCo's 0.7 and 0.9), Delayed Nesterov's period (0: the
    number of workers, as the paper; 1: Nesterov at every arrival) and DyLU."""

    inner: InnerOptimizer = InnerOptimizer()
    outer: OuterSGD = OuterSGD()
    nesterov_period: int = 0
    dynamic_steps: bool = True

    def check(self) -> None:
        super().check()
        check_field(self.nesterov_period >= 0, "nesterov_period", "an int >= 0 (0: workers)")


def plan(p: AsyncDiLoCo, run) -> Plan:
    period = p.nesterov_period or run.workers
    # The rate's schedule counts arrivals: about rounds x workers of them.
    rate = p.outer.schedule.make(p.outer.learning_rate, p.rounds(run) * run.workers)
    outer = delayed_nesterov(rate, p.outer.momentum, period)
    return Plan(outer, p.sync_every, dynamic=p.dynamic_steps)


@register(
    "async_diloco", AsyncDiLoCo, skip_in_place=None, family="local", asynchronous=plan, churn=True
)
def build(p: AsyncDiLoCo, ctx: Context) -> optax.GradientTransformation:
    return p.inner.make(ctx.run.steps)  # each worker's: the server's step is `plan`'s
