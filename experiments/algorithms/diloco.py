"""DiLoCo (`shoal.optim.diloco`; Douillard et al. 2023): the inner optimizer on every
worker, and every ``sync_every`` steps the outer Nesterov SGD step on the average of the
workers' progress, exchanged as ``exchange`` says. The inner state is never reset."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, Hyper, register
from shoal.experiments.algorithms.parts import Exchange, InnerOptimizer, OuterSGD
from shoal.experiments.fields import ConfigError, check_field


@dataclasses.dataclass(frozen=True)
class DiLoCo(Hyper):
    """Inner steps per round H, the inner and outer optimizers, and the exchange of the
    outer gradient."""

    sync_every: int = 10
    inner: InnerOptimizer = InnerOptimizer()
    outer: OuterSGD = OuterSGD()
    exchange: Exchange = Exchange()

    def check(self) -> None:
        check_field(self.sync_every >= 1, "sync_every", "an int >= 1")

    def check_run(self, run) -> None:
        # The runner evaluates the workers' models: make the last step an outer step,
        # after which every worker holds the global model.
        if run.steps % self.sync_every:
            raise ConfigError(
                f"steps = {run.steps} must be a multiple of sync_every = {self.sync_every}, "
                "so that the last step is an outer step"
            )


@register("diloco", DiLoCo, skip_in_place="apply")
def build(p: DiLoCo, ctx: Context) -> optax.GradientTransformation:
    return optim.diloco(
        p.inner.make(),
        collective=ctx.comms,
        sync_every=p.sync_every,
        outer=p.outer.make(),
        exchange=p.exchange.make(),
    )
