"""KungFu with closed-loop adaptation: S-SGD with the gradient noise scale monitor
(``ssgd_noise``: `shoal.optim.gradient_noise_scale`) while ``sync`` is "full", then
partial exchange (``partial_exchange``: `shoal.optim.partial_exchange`) of ``fraction`` of
the gradient bytes once its policy, `noise_scale_switch`, sets ``sync`` to "partial".

Reference: Brabete, "KungFu: a novel distributed training system for TensorFlow using
flexible synchronisation", MEng thesis, Imperial College London, 2019, section 4.4 (a
manual schedule from fraction 1 to 0.1, and the noise scale proposed as its trigger).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import optax

from shoal.experiments.algorithms import partial_exchange, ssgd_noise
from shoal.experiments.algorithms._registry import Context, Hyper, register
from shoal.experiments.algorithms.parts import LocalSGD
from shoal.experiments.fields import check_field
from shoal.experiments.runner.policies import Decision, Policy


@dataclasses.dataclass(frozen=True)
class Adaptive(Hyper):
    """The noise monitor's ``ema``; the partial exchange's ``fraction``; the stage
    ``sync``; the policy's period ``every`` (steps), first step ``after`` (early noise
    estimates swing) and ``threshold`` on the median noise scale; the local optimizer."""

    ema: float = 0.9
    fraction: float = 0.1
    sync: Literal["full", "partial"] = "full"
    every: int = 10
    after: int = 0
    threshold: float = 1000.0
    local: LocalSGD = LocalSGD()

    def check(self) -> None:
        check_field(self.every >= 1, "every", "an int >= 1")
        check_field(self.after >= 0, "after", "an int >= 0")
        check_field(0 < self.fraction <= 1, "fraction", "a float in (0, 1]")


def noise_scale_switch(records: Sequence[dict[str, Any]], p: Adaptive) -> Decision:
    """Exchange every gradient while the gradient noise scale is below ``p.threshold``,
    then only ``p.fraction`` of them (partial exchange).

    The thesis's reasoning: the gradients shrink as training converges, so the noise scale
    grows, training is stable, and partial exchange costs little accuracy from then on. The
    median of the last ``p.every`` steps' estimates decides, so one noisy estimate does
    not; the switch happens once.
    """
    if p.sync != "full":
        return None
    recent = [r["noise_scale"] for r in records[-p.every :] if "noise_scale" in r]
    if recent and np.median(recent) > p.threshold:
        return {"sync": "partial"}
    return None


def _due(step: int, p: Adaptive) -> bool:
    return step % p.every == 0 and step >= p.after


@register(
    "adaptive",
    Adaptive,
    skip_in_place=None,
    family="dense",
    policy=Policy(_due, noise_scale_switch),
)
def build(p: Adaptive, ctx: Context) -> optax.GradientTransformation:
    if p.sync == "full":
        return ssgd_noise.build(ssgd_noise.SSGDNoise(ema=p.ema, local=p.local), ctx)
    return partial_exchange.build(
        partial_exchange.PartialExchange(fraction=p.fraction, local=p.local), ctx
    )
