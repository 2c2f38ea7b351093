"""Two-tier BMUF_GTC (`shoal.optim.bmuf_gtc`) around the local optimizer: GTC every step
inside groups of ``group_size`` consecutive workers, the BMUF block step across the
groups every ``block_size`` steps (eta from eq. 5 over the workers / group_size groups)."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, register
from shoal.experiments.algorithms.parts import BlockFields, GTCFields, LocalSGD
from shoal.experiments.fields import ConfigError, check_field


@dataclasses.dataclass(frozen=True)
class BMUFGTC(BlockFields, GTCFields):
    """`BlockFields`, `GTCFields`, the workers per group P (must divide the workers) and
    the local optimizer."""

    group_size: int = 2
    local: LocalSGD = LocalSGD()

    def check(self) -> None:
        super().check()
        self.check_local(self.local)
        check_field(self.group_size >= 1, "group_size", "an int >= 1")

    def check_run(self, run) -> None:
        if run.workers % self.group_size:
            raise ConfigError(
                f"group_size = {self.group_size} must divide the number of workers {run.workers}"
            )
        self.check_blocks(run)


@register("bmuf_gtc", BMUFGTC, skip_in_place="apply", family="local", two_tier=True)
def build(p: BMUFGTC, ctx: Context) -> optax.GradientTransformation:
    intra, inter = ctx.comms
    return optim.bmuf_gtc(
        p.local.make(ctx.run.steps),
        intra=intra,
        inter=inter,
        block_size=p.block_size,
        threshold=p.threshold,
        capacity=p.capacity,
        block_lr=p.block_lr,
        block_momentum=p.block_momentum,
        nesterov=p.nesterov,
        nbm=p.nbm,
        reset_inner_state=p.reset_inner_state,
    )
