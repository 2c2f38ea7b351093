"""SparseLoCo (`shoal.optim.sparseloco`; Sarfi et al. 2025): DiLoCo whose outer gradient
is sent as a 2-bit top-k of each chunk of an error-feedback accumulator that decays by
``beta``, and whose outer step is plain SGD at ``outer_learning_rate`` (the accumulator
stands in for outer momentum).

Example (a config entry): ``sparseloco[sync_every=30;topk.fraction=0.03]``, or for the
whole run ``--set sparseloco.beta=0.9``.
"""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, register
from shoal.experiments.algorithms.parts import InnerOptimizer, RoundFields, Schedule, TopKCodec
from shoal.experiments.fields import check_field


@dataclasses.dataclass(frozen=True)
class SparseLoCo(RoundFields):
    """Inner steps per round H (`RoundFields`), the inner optimizer, the outer SGD's rate
    and its `Schedule` (counted in outer steps), the accumulator's decay ``beta``, and
    the top-k: 64 of each chunk of 4096 values (1.6%), 2-bit values."""

    inner: InnerOptimizer = InnerOptimizer()
    outer_learning_rate: float = 1.0
    outer_schedule: Schedule = Schedule()
    beta: float = 0.95
    topk: TopKCodec = TopKCodec(fraction=64 / 4096, chunk_size=4096, value_bits=2)

    def check(self) -> None:
        super().check()
        check_field(self.outer_learning_rate > 0, "outer_learning_rate", "a float > 0")
        check_field(0 < self.beta <= 1, "beta", "a float in (0, 1]")

    def check_run(self, run) -> None:
        self.check_last_step(run)  # as DiLoCo's


@register("sparseloco", SparseLoCo, skip_in_place="apply", family="local", turns=True)
def build(p: SparseLoCo, ctx: Context) -> optax.GradientTransformation:
    return optim.sparseloco(
        p.inner.make(ctx.run.steps),
        collective=ctx.comms,
        sync_every=p.sync_every,
        outer_learning_rate=p.outer_schedule.make(p.outer_learning_rate, p.rounds(ctx.run)),
        beta=p.beta,
        density=p.topk.fraction,
        chunk_size=p.topk.chunk_size,
        value_bits=p.topk.value_bits or None,
    )
