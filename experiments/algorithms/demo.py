"""DeMo (`shoal.optim.demo`; Peng et al. 2024): decoupled momentum, its DCT top
coefficients of each chunk exchanged, the sign of the mean stepped with plain SGD."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, Hyper, register
from shoal.experiments.fields import check_field


@dataclasses.dataclass(frozen=True)
class DeMo(Hyper):
    """Momentum decay, DCT chunk size, coefficients sent per chunk, the sign of the update,
    and the SGD step's learning rate (no momentum: DeMo's own is the momentum)."""

    momentum: float = 0.999
    chunk_size: int = 64
    topk: int = 32
    sign: bool = True
    learning_rate: float = 1e-3

    def check(self) -> None:
        check_field(self.learning_rate > 0, "learning_rate", "a float > 0")


@register("demo", DeMo, skip_in_place=None, family="compressed")
def build(p: DeMo, ctx: Context) -> optax.GradientTransformation:
    tx = optim.demo(
        collective=ctx.comms,
        momentum=p.momentum,
        chunk_size=p.chunk_size,
        topk=p.topk,
        sign=p.sign,
    )
    return optax.chain(tx, optax.sgd(p.learning_rate))
