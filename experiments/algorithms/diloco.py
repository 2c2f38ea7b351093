"""DiLoCo (`shoal.optim.diloco`; Douillard et al. 2023): the inner optimizer on every
worker, and every ``sync_every`` steps the outer Nesterov SGD step on the average of the
workers' progress, exchanged as ``exchange`` says. The inner state is never reset."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, register
from shoal.experiments.algorithms.parts import Exchange, InnerOptimizer, OuterSGD, RoundFields


@dataclasses.dataclass(frozen=True)
class DiLoCo(RoundFields):
    """Inner steps per round H (`RoundFields`), the inner and outer optimizers, and the
    exchange of the outer gradient."""

    inner: InnerOptimizer = InnerOptimizer()
    outer: OuterSGD = OuterSGD()
    exchange: Exchange = Exchange()

    def check_run(self, run) -> None:
        self.check_last_step(run)


@register("diloco", DiLoCo, skip_in_place="apply", family="local", churn=True, turns=True)
def build(p: DiLoCo, ctx: Context) -> optax.GradientTransformation:
    return optim.diloco(
        p.inner.make(ctx.run.steps),
        collective=ctx.comms,
        sync_every=p.sync_every,
        outer=p.outer.make(p.rounds(ctx.run)),
        exchange=p.exchange.make(),
    )
