"""Quorum DiLoCo (`shoal.experiments.asynchronous.simulate`; the mechanism of Decoupled
DiLoCo): the outer Nesterov step fires when ``quorum`` workers have pushed their
pseudo-gradients, or ``grace_ms`` after the first of them, on their mean weighted by the
tokens each processed; the workers that pushed pull the result and go on, the others keep
computing. ``quorum`` = the workers and no grace window is synchronous DiLoCo. Simulated
workers only, on the clock of ``speeds``.

Example (a config entry): ``quorum_diloco[quorum=6;grace_ms=500]``.
"""

from __future__ import annotations

import dataclasses
import math

import optax

from shoal.experiments.algorithms._registry import Context, register
from shoal.experiments.algorithms.parts import InnerOptimizer, OuterSGD, RoundFields
from shoal.experiments.asynchronous import Plan
from shoal.experiments.fields import ConfigError, check_field


@dataclasses.dataclass(frozen=True)
class QuorumDiLoCo(RoundFields):
    """Inner steps per round H (`RoundFields`), the inner optimizer, the outer Nesterov
    step (DiLoCo's), the quorum (0: half the workers, rounded up) and the grace window in
    simulated ms (0: none, wait for the quorum)."""

    inner: InnerOptimizer = InnerOptimizer()
    outer: OuterSGD = OuterSGD()
    quorum: int = 0
    grace_ms: float = 0.0

    def check(self) -> None:
        super().check()
        check_field(self.quorum >= 0, "quorum", "an int >= 0 (0: half the workers)")
        check_field(self.grace_ms >= 0, "grace_ms", "a number of ms >= 0 (0: none)")

    def check_run(self, run) -> None:
        if self.quorum > run.workers:
            raise ConfigError(
                f"config field 'quorum' must be at most workers = {run.workers}, got {self.quorum}"
            )


def plan(p: QuorumDiLoCo, run) -> Plan:
    q = p.quorum or -(-run.workers // 2)
    grace = p.grace_ms / 1e3 if p.grace_ms else math.inf
    return Plan(p.outer.make(p.rounds(run)), p.sync_every, quorum=q, grace=grace)


@register(
    "quorum_diloco", QuorumDiLoCo, skip_in_place=None, family="local", asynchronous=plan, churn=True
)
def build(p: QuorumDiLoCo, ctx: Context) -> optax.GradientTransformation:
    return p.inner.make(ctx.run.steps)  # each worker's: the server's step is `plan`'s
