"""BMUF (`shoal.optim.bmuf`) around the local optimizer: ``block_size`` local steps per
worker, then the block step over all workers."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, register
from shoal.experiments.algorithms.parts import BlockFields, LocalSGD
from shoal.experiments.fields import check_field


@dataclasses.dataclass(frozen=True)
class BMUF(BlockFields):
    """`BlockFields`, S-SGD warm-up steps before the first block, and the local
    optimizer."""

    warmup_steps: int = 0
    local: LocalSGD = LocalSGD()

    def check(self) -> None:
        super().check()
        self.check_local(self.local)
        check_field(self.warmup_steps >= 0, "warmup_steps", "an int >= 0")

    def check_run(self, run) -> None:
        self.check_blocks(run, self.warmup_steps)


@register("bmuf", BMUF, skip_in_place="apply", family="local")
def build(p: BMUF, ctx: Context) -> optax.GradientTransformation:
    return optim.bmuf(
        p.local.make(ctx.run.steps),
        collective=ctx.comms,
        block_size=p.block_size,
        block_lr=p.block_lr,
        block_momentum=p.block_momentum,
        nesterov=p.nesterov,
        nbm=p.nbm,
        warmup_steps=p.warmup_steps,
        reset_inner_state=p.reset_inner_state,
    )
