"""Streaming DiLoCo (`shoal.optim.streaming_diloco`; Douillard et al. 2025): DiLoCo with
the parameters in ``fragments`` fragments that sync in turn, each outer update merged
``overlap`` steps later with weight ``mix`` on the local model."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, register
from shoal.experiments.algorithms.parts import Exchange, InnerOptimizer, OuterSGD, RoundFields
from shoal.experiments.fields import check_field


@dataclasses.dataclass(frozen=True)
class StreamingDiLoCo(RoundFields):
    """DiLoCo's fields, the fragments, the overlap tau (in [0, sync_every)) and the
    merge's weight on the local model."""

    fragments: int = 4
    overlap: int = 0
    mix: float = 0.5
    inner: InnerOptimizer = InnerOptimizer()
    outer: OuterSGD = OuterSGD()
    exchange: Exchange = Exchange()

    def check(self) -> None:
        super().check()
        check_field(
            0 <= self.overlap < self.sync_every,
            "overlap",
            f"an int in [0, sync_every = {self.sync_every})",
        )


@register("streaming_diloco", StreamingDiLoCo, skip_in_place=None, family="local", churn=True)
def build(p: StreamingDiLoCo, ctx: Context) -> optax.GradientTransformation:
    return optim.streaming_diloco(
        p.inner.make(ctx.run.steps),
        collective=ctx.comms,
        sync_every=p.sync_every,
        outer=p.outer.make(p.rounds(ctx.run)),
        num_fragments=p.fragments,
        overlap=p.overlap,
        mix=p.mix,
        exchange=p.exchange.make(),
    )
