"""NoLoCo (`shoal.optim.noloco`; Kolehmainen et al. 2025): DiLoCo's rounds without the
all-reduce: after ``sync_every`` inner steps each worker averages with one random peer,
through the modified Nesterov step ``delta <- alpha delta - beta Delta - gamma (phi -
mean phi)`` over the pair.

Example (a config entry): ``noloco[sync_every=20;gamma=0.2]``.
"""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, register
from shoal.experiments.algorithms.parts import InnerOptimizer, RoundFields
from shoal.experiments.fields import check_field


@dataclasses.dataclass(frozen=True)
class NoLoCo(RoundFields):
    """Inner steps per round H (`RoundFields`), the inner optimizer, the outer step's
    momentum ``alpha``, learning rate ``beta`` and pull ``gamma``, and the pairings'
    seed. The defaults are not tuned."""

    inner: InnerOptimizer = InnerOptimizer()
    alpha: float = 0.5
    beta: float = 0.7
    gamma: float = 0.5
    seed: int = 0

    def check(self) -> None:
        super().check()
        check_field(0 <= self.alpha < 1, "alpha", "a float in [0, 1)")
        check_field(self.beta > 0, "beta", "a float > 0")
        check_field(self.gamma >= 0, "gamma", "a float >= 0")
        check_field(self.seed >= 0, "seed", "an int >= 0")

    def check_run(self, run) -> None:
        self.check_last_step(run)


@register("noloco", NoLoCo, skip_in_place=None, family="local")
def build(p: NoLoCo, ctx: Context) -> optax.GradientTransformation:
    return optim.noloco(
        p.inner.make(ctx.run.steps),
        collective=ctx.comms,
        sync_every=p.sync_every,
        alpha=p.alpha,
        beta=p.beta,
        gamma=p.gamma,
        seed=p.seed,
    )
