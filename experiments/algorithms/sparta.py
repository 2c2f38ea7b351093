"""SPARTA (`shoal.optim.sparta`; Exo Labs 2025): the inner optimizer on every worker and,
after every step, a random ``fraction`` of each leaf averaged over the workers (indices
from a seed they share); with ``sync_every > 0`` also DiLoCo's outer step every
``sync_every`` steps (SPARTA around `shoal.optim.diloco`).

Example (config entries): ``sparta[fraction=0.001]``, ``sparta[sync_every=50]``.
"""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, Hyper, register
from shoal.experiments.algorithms.parts import InnerOptimizer, OuterSGD
from shoal.experiments.fields import ConfigError, check_field


@dataclasses.dataclass(frozen=True)
class Sparta(Hyper):
    """The share of each leaf averaged per step, the index seed, the inner optimizer,
    and DiLoCo's period (0: no outer step) and outer optimizer."""

    fraction: float = 0.005
    seed: int = 0
    inner: InnerOptimizer = InnerOptimizer()
    sync_every: int = 0
    outer: OuterSGD = OuterSGD()

    def check(self) -> None:
        check_field(0 < self.fraction <= 1, "fraction", "a float in (0, 1]")
        check_field(self.sync_every >= 0, "sync_every", "an int >= 0 (0: no DiLoCo)")

    def check_run(self, run) -> None:
        if self.sync_every and run.steps % self.sync_every:
            raise ConfigError(
                f"steps = {run.steps} must be a multiple of sync_every = {self.sync_every}, "
                "so that the last step is an outer step"
            )


@register("sparta", Sparta, skip_in_place=None, family="local", churn=True)
def build(p: Sparta, ctx: Context) -> optax.GradientTransformation:
    inner = p.inner.make(ctx.run.steps)
    if p.sync_every:
        rounds = -(-ctx.run.steps // p.sync_every)
        inner = optim.diloco(
            inner, collective=ctx.comms, sync_every=p.sync_every, outer=p.outer.make(rounds)
        )
    return optim.sparta(inner, collective=ctx.comms, fraction=p.fraction, seed=p.seed)
