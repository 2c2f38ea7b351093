"""MuLoCo (Thérien et al. 2025, "MuLoCo: Muon is a practical inner optimizer for DiLoCo"):
DiLoCo (`shoal.optim.diloco`) whose inner optimizer is Muon on the matrices and AdamW on
the other leaves (`optax.contrib.muon` makes that split), with the outer step Nesterov SGD
on the average of the workers' progress every ``sync_every`` steps.

Muon's update of a matrix leaf ``W`` with gradient ``G``:
``M <- beta M + G``, ``O = NewtonSchulz5(beta M + G)`` (Nesterov), ``W <- W - lr O``; a
leaf of any other rank takes AdamW at ``adam_learning_rate``. Both rates follow Muon's
``schedule`` over the inner steps, and ``clip`` clips each worker's own gradient first.

Example (a config entry): ``muloco[sync_every=30;inner.learning_rate=0.01]``, or for the
whole run ``--set muloco.outer.learning_rate=0.5``.
"""

from __future__ import annotations

import dataclasses

import optax
from optax import contrib

from shoal import optim
from shoal.dtypes import standard_promotion
from shoal.experiments.algorithms._registry import Context, Hyper, register
from shoal.experiments.algorithms.parts import (
    Exchange,
    OuterSGD,
    RoundFields,
    Schedule,
    check_clip,
    clipped,
)
from shoal.experiments.fields import check_field


@dataclasses.dataclass(frozen=True)
class Muon(Hyper):
    """`optax.contrib.muon`'s knobs: the matrices' learning rate, momentum ``beta``,
    Newton-Schulz iterations, decoupled weight decay (scaled by the learning rate, as
    optax does), AdamW's learning rate for the other leaves, the `Schedule` both rates
    follow (counted in inner steps), and ``clip``, the global norm each worker's own
    gradient is clipped to first (None: none)."""

    learning_rate: float = 0.02
    beta: float = 0.95
    ns_steps: int = 5
    weight_decay: float = 0.0
    adam_learning_rate: float = 1e-3
    schedule: Schedule = Schedule()
    clip: float | None = None

    def check(self) -> None:
        check_field(self.learning_rate > 0, "learning_rate", "a float > 0")
        check_field(0 <= self.beta < 1, "beta", "a float in [0, 1)")
        check_field(self.ns_steps >= 1, "ns_steps", "an int >= 1")
        check_field(self.weight_decay >= 0, "weight_decay", "a float >= 0")
        check_field(self.adam_learning_rate > 0, "adam_learning_rate", "a float > 0")
        check_clip(self.clip)

    def make(self, steps: int | None = None) -> optax.GradientTransformation:
        """Muon over a run of ``steps`` inner steps (`Schedule.make`)."""
        # Its AdamW part mixes a float with an int32 count (as `parts.AdamW` says).
        muon = standard_promotion(
            contrib.muon(
                self.schedule.make(self.learning_rate, steps),
                beta=self.beta,
                ns_steps=self.ns_steps,
                weight_decay=self.weight_decay,
                adam_learning_rate=self.schedule.make(self.adam_learning_rate, steps),
                adam_weight_decay=self.weight_decay,
            )
        )
        return clipped(self.clip, muon)


@dataclasses.dataclass(frozen=True)
class MuLoCo(RoundFields):
    """Inner steps per round H (`RoundFields`), Muon inside, the outer Nesterov SGD, and
    the exchange of the outer gradient."""

    inner: Muon = Muon()
    outer: OuterSGD = OuterSGD()
    exchange: Exchange = Exchange()

    def check_run(self, run) -> None:
        self.check_last_step(run)  # as DiLoCo's


@register("muloco", MuLoCo, skip_in_place="apply", family="local", churn=True, turns=True)
def build(p: MuLoCo, ctx: Context) -> optax.GradientTransformation:
    return optim.diloco(
        p.inner.make(ctx.run.steps),
        collective=ctx.comms,
        sync_every=p.sync_every,
        outer=p.outer.make(p.rounds(ctx.run)),
        exchange=p.exchange.make(),
    )
