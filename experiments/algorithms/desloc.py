"""DES-LOC (`shoal.optim.desloc`; Iacob et al. 2025): local Adam whose params, first and
second moments are averaged over the workers on their own periods ``K_x <= K_u <= K_v``
(``sync_every``, ``moment_every``, ``second_moment_every``; the paper's defaults
``3 K_x`` and ``6 K_x`` for the moments).

Example (a config entry): ``desloc[sync_every=16;learning_rate=3e-3]``.
"""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, Hyper, register
from shoal.experiments.algorithms.parts import Schedule, check_clip, clipped
from shoal.experiments.fields import check_field


@dataclasses.dataclass(frozen=True)
class DESLOC(Hyper):
    """The three periods (None: the paper's ``3 K_x`` and ``6 K_x``), Adam's rate with
    its `Schedule`, b1, b2 and eps, and ``clip``, the global norm each worker's gradient
    is clipped to first (None: none)."""

    sync_every: int = 10
    moment_every: int | None = None
    second_moment_every: int | None = None
    learning_rate: float = 1e-3
    schedule: Schedule = Schedule()
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip: float | None = None

    def check(self) -> None:
        check_field(self.sync_every >= 1, "sync_every", "an int >= 1")
        k_u = 3 * self.sync_every if self.moment_every is None else self.moment_every
        check_field(k_u >= self.sync_every, "moment_every", "None or an int >= sync_every")
        check_field(
            self.second_moment_every is None or self.second_moment_every >= k_u,
            "second_moment_every",
            "None or an int >= moment_every",
        )
        check_field(self.learning_rate > 0, "learning_rate", "a float > 0")
        check_field(0 <= self.b1 < 1, "b1", "a float in [0, 1)")
        check_field(0 <= self.b2 < 1, "b2", "a float in [0, 1)")
        check_field(self.eps >= 0, "eps", "a float >= 0")
        check_clip(self.clip)


@register("desloc", DESLOC, skip_in_place=None, family="local")
def build(p: DESLOC, ctx: Context) -> optax.GradientTransformation:
    tx = optim.desloc(
        p.schedule.make(p.learning_rate, ctx.run.steps),
        collective=ctx.comms,
        sync_every=p.sync_every,
        moment_every=p.moment_every,
        second_moment_every=p.second_moment_every,
        b1=p.b1,
        b2=p.b2,
        eps=p.eps,
    )
    return clipped(p.clip, tx)
