"""DeMo (`shoal.optim.demo`; Peng et al. 2024): decoupled momentum, its DCT top
coefficients of each chunk exchanged, the sign of the mean stepped with plain SGD at the
rate its `Schedule` gives; ``clip`` clips each worker's own gradient before it enters the
momentum."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, Hyper, register
from shoal.experiments.algorithms.parts import Schedule, check_clip, clipped
from shoal.experiments.fields import check_field


@dataclasses.dataclass(frozen=True)
class DeMo(Hyper):
    """Momentum decay, DCT chunk size, coefficients sent per chunk, the sign of the update,
    the SGD step's learning rate (no momentum: DeMo's own is the momentum) and its
    `Schedule` over the run's steps, and the global norm each worker's gradient is clipped
    to (None: none)."""

    momentum: float = 0.999
    chunk_size: int = 64
    topk: int = 32
    sign: bool = True
    learning_rate: float = 1e-3
    schedule: Schedule = Schedule()
    clip: float | None = None

    def check(self) -> None:
        check_field(self.learning_rate > 0, "learning_rate", "a float > 0")
        check_clip(self.clip)


@register("demo", DeMo, skip_in_place=None, family="compressed")
def build(p: DeMo, ctx: Context) -> optax.GradientTransformation:
    tx = optim.demo(
        collective=ctx.comms,
        momentum=p.momentum,
        chunk_size=p.chunk_size,
        topk=p.topk,
        sign=p.sign,
    )
    # The clip goes before DeMo's momentum: the sign SGD steps on has no norm to clip.
    step = optax.sgd(p.schedule.make(p.learning_rate, ctx.run.steps))
    return clipped(p.clip, optax.chain(tx, step))
