"""S-SGD that also estimates the gradient noise scale (`shoal.optim.gradient_noise_scale`,
logged as ``noise_scale``), then the local optimizer."""

from __future__ import annotations

import dataclasses

import optax

from shoal import optim
from shoal.experiments.algorithms._registry import Context, Hyper, register
from shoal.experiments.algorithms.parts import LocalSGD


@dataclasses.dataclass(frozen=True)
class SSGDNoise(Hyper):
    """``ema``: the decay of the noise-scale monitor's moving averages."""

    ema: float = 0.9
    local: LocalSGD = LocalSGD()


@register("ssgd_noise", SSGDNoise, skip_in_place=None, family="dense")
def build(p: SSGDNoise, ctx: Context) -> optax.GradientTransformation:
    monitor = optim.gradient_noise_scale(
        collective=ctx.comms, local_batch_size=ctx.run.batch_size, ema=p.ema
    )
    return optax.chain(monitor, p.local.make(ctx.run.steps))
