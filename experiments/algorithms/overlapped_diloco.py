"""Overlapped DiLoCo (`shoal.optim.overlapped_diloco`; Kale et al. 2025): DiLoCo whose
outer all-reduce would run during the next round's inner steps, so each outer step uses
the last round's average: as it is (``variant="delayed"``) or with this worker's fresh
outer gradient in place of its stale share (``"eager"``, the paper's proposal).

Example (a config entry): ``overlapped_diloco[variant=delayed;sync_every=20]``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, register
from shoal.experiments.algorithms.parts import InnerOptimizer, OuterSGD, RoundFields


@dataclasses.dataclass(frozen=True)
class OverlappedDiLoCo(RoundFields):
    """Inner steps per round H (`RoundFields`), the inner and outer optimizers (each
    worker's own outer state), and the variant: "eager" or "delayed"."""

    inner: InnerOptimizer = InnerOptimizer()
    outer: OuterSGD = OuterSGD()
    variant: Literal["eager", "delayed"] = "eager"

    def check_run(self, run) -> None:
        self.check_last_step(run)


@register("overlapped_diloco", OverlappedDiLoCo, skip_in_place=None, family="local")
def build(p: OverlappedDiLoCo, ctx: Context) -> optax.GradientTransformation:
    return optim.overlapped_diloco(
        p.inner.make(ctx.run.steps),
        collective=ctx.comms,
        sync_every=p.sync_every,
        outer=p.outer.make(p.rounds(ctx.run)),
        variant=p.variant,
    )
