"""Top-k with error feedback (`shoal.optim.topk`), then the local optimizer."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, register
from shoal.experiments.algorithms.parts import LocalSGD, TopKCodec


@dataclasses.dataclass(frozen=True)
class TopKSGD(TopKCodec):
    """`TopKCodec` (fraction, chunk_size, value_bits) and the local optimizer."""

    local: LocalSGD = LocalSGD()


@register("topk", TopKSGD, skip_in_place=None, family="compressed")
def build(p: TopKSGD, ctx: Context) -> optax.GradientTransformation:
    tx = optim.topk(
        p.fraction,
        collective=ctx.comms,
        chunk_size=p.chunk_size,
        value_bits=p.value_bits or None,
    )
    return optax.chain(tx, p.local.make(ctx.run.steps))
