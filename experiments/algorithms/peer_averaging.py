"""KungFu's peer model averaging (`shoal.optim.peer_averaging`) around the local
optimizer: every step each worker averages its model with one peer's, then applies its
local update."""

from __future__ import annotations

import dataclasses
from typing import Literal

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, Hyper, register
from shoal.experiments.algorithms.parts import LocalSGD
from shoal.experiments.fields import ConfigError


@dataclasses.dataclass(frozen=True)
class PeerAveraging(Hyper):
    """How each worker picks its peer, the peer model's staleness in steps, and the local
    optimizer (the run's seed draws the random peers)."""

    strategy: Literal["round_robin", "random"] = "round_robin"
    staleness: int = 0
    local: LocalSGD = LocalSGD()

    def check_run(self, run) -> None:
        if run.workers < 2:
            raise ConfigError("peer averaging needs at least 2 workers")


@register("peer_averaging", PeerAveraging, skip_in_place="apply", family="local")
def build(p: PeerAveraging, ctx: Context) -> optax.GradientTransformation:
    return optim.peer_averaging(
        p.local.make(ctx.run.steps),
        collective=ctx.comms,
        strategy=p.strategy,
        staleness=p.staleness,
        seed=ctx.run.seed,
    )
