"""The parts algorithms' hyper-parameters are made of: the local optimizer, DiLoCo's inner
and outer optimizers, the exchange codec, and the groups of fields several algorithms
share (BMUF's block step, GTC's threshold, the LAMB family's rule and schedule).

Each is a small `Hyper` dataclass: an algorithm holds an optimizer part as a field
(``local: LocalSGD``, spelt ``--set ssgd.local.learning_rate=0.1``) and inherits a group
of shared fields (``bmuf.block_size``, ``bmuf_gtc.block_size``).

Example:
  >>> LocalSGD(learning_rate=0.1).make()  # doctest: +ELLIPSIS
  GradientTransformationExtraArgs(...)
  >>> Exchange(codec="int8").make().fmt
  'int8'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import optax

from shoal.comms import Compressor, Quantized, TopK
from shoal.dtypes import standard_promotion
from shoal.experiments.algorithms._registry import Context, Hyper
from shoal.experiments.fields import ConfigError, check_field

if TYPE_CHECKING:
    from shoal.experiments.config import Config


@dataclasses.dataclass(frozen=True)
class LocalSGD(Hyper):
    """SGD with heavy-ball momentum (0: none), the local optimizer of most algorithms."""

    learning_rate: float = 0.05
    momentum: float = 0.9

    def check(self) -> None:
        check_field(self.learning_rate > 0, "learning_rate", "a float > 0")
        check_field(0 <= self.momentum < 1, "momentum", "a float in [0, 1)")

    def make(self) -> optax.GradientTransformation:
        return optax.sgd(self.learning_rate, momentum=self.momentum or None)


@dataclasses.dataclass(frozen=True)
class AdamW(Hyper):
    """AdamW (optax's b1, b2 and eps) with decoupled weight decay."""

    learning_rate: float = 1e-3
    weight_decay: float = 0.0

    def check(self) -> None:
        check_field(self.learning_rate > 0, "learning_rate", "a float > 0")
        # optax does not check it.
        check_field(self.weight_decay >= 0, "weight_decay", "a float >= 0")

    def make(self) -> optax.GradientTransformation:
        # optax's bias correction mixes a float with an int32 count: standard promotion
        # for it alone, so that the run is also right under strict promotion.
        return standard_promotion(optax.adamw(self.learning_rate, weight_decay=self.weight_decay))


@dataclasses.dataclass(frozen=True)
class OuterSGD(Hyper):
    """DiLoCo's outer step: Nesterov SGD on the averaged outer gradient (the paper's
    learning rate 0.7 and momentum 0.9)."""

    learning_rate: float = 0.7
    momentum: float = 0.9

    def check(self) -> None:
        check_field(self.learning_rate > 0, "learning_rate", "a float > 0")
        check_field(0 <= self.momentum < 1, "momentum", "a float in [0, 1)")

    def make(self) -> optax.GradientTransformation:
        return optax.sgd(self.learning_rate, momentum=self.momentum, nesterov=True)


@dataclasses.dataclass(frozen=True)
class TopKCodec(Hyper):
    """Top-k of each chunk: the share of each chunk of ``chunk_size`` values sent, and
    the bits of each value sent (0: float32)."""

    fraction: float = 0.01
    chunk_size: int = 64
    value_bits: Literal[0, 2, 4, 8] = 0

    def codec(self) -> TopK:
        return TopK(
            fraction=self.fraction, chunk_size=self.chunk_size, value_bits=self.value_bits or None
        )


@dataclasses.dataclass(frozen=True)
class Exchange(Hyper):
    """How an outer gradient crosses the network: "float32" (an all-reduce), "int8" /
    "fp8" / "fp4" (`shoal.comms.Quantized`, blocks of 128, error feedback) or "topk"
    (`shoal.comms.TopK` as ``topk`` says: SparseLoCo's exchange)."""

    codec: Literal["float32", "int8", "fp8", "fp4", "topk"] = "float32"
    topk: TopKCodec = TopKCodec()

    def make(self) -> Compressor | None:
        """The `shoal.comms.Compressor` (None: a float32 all-reduce)."""
        if self.codec == "float32":
            return None
        if self.codec == "topk":
            return self.topk.codec()
        return Quantized(self.codec)


@dataclasses.dataclass(frozen=True)
class InnerOptimizer(Hyper):
    """DiLoCo's inner optimizer: ``use`` "adamw" (the paper's) or "sgd"."""

    use: Literal["adamw", "sgd"] = "adamw"
    adamw: AdamW = AdamW()
    sgd: LocalSGD = LocalSGD()

    def make(self) -> optax.GradientTransformation:
        return self.adamw.make() if self.use == "adamw" else self.sgd.make()


@dataclasses.dataclass(frozen=True)
class RoundFields(Hyper):
    """The inner steps per round H of the DiLoCo family (`shoal.optim.diloco`): every
    ``sync_every`` steps the outer step averages the workers' progress."""

    sync_every: int = 10

    def check(self) -> None:
        check_field(self.sync_every >= 1, "sync_every", "an int >= 1")

    def check_last_step(self, run: Config) -> None:
        """The runner evaluates the workers' models: make the last step an outer step,
        after which every worker holds the global model."""
        if run.steps % self.sync_every:
            raise ConfigError(
                f"steps = {run.steps} must be a multiple of sync_every = {self.sync_every}, "
                "so that the last step is an outer step"
            )


@dataclasses.dataclass(frozen=True)
class GTCFields(Hyper):
    """GTC's threshold tau and its buffer: words per worker per step as a fraction of the
    parameters (`shoal.optim.gtc`)."""

    threshold: float = 0.1
    capacity: float = 0.08


@dataclasses.dataclass(frozen=True)
class BlockFields(Hyper):
    """BMUF's block step (`shoal.optim.bmuf`): local steps per block, block learning rate
    zeta, block momentum eta (None: eq. 5 with C = 1, eta = 1 - zeta / M for the M models
    averaged), Nesterov block momentum and its variant, and whether the local optimizer's
    state restarts after every block step."""

    block_size: int = 10
    block_lr: float = 1.0
    block_momentum: float | None = None
    nesterov: bool = True
    nbm: Literal["seed", "chen_huo"] = "seed"
    reset_inner_state: bool = True

    def check(self) -> None:
        check_field(self.block_size >= 1, "block_size", "an int >= 1")
        check_field(self.block_lr > 0, "block_lr", "a float > 0")

    def check_blocks(self, run: Config, warmup_steps: int = 0) -> None:
        """The evaluated model is the global model of the last block step: make that the
        last step."""
        rest = run.steps - warmup_steps
        if rest <= 0 or rest % self.block_size:
            raise ConfigError(
                f"steps - warmup_steps = {rest} must be a positive multiple of block_size = "
                f"{self.block_size}, so that the last step is a BMUF step"
            )


@dataclasses.dataclass(frozen=True)
class LambFields(Hyper):
    """The LAMB family's rule and schedule (`shoal.optim.onebit_lamb`,
    `shoal.optim.onebit_adam`): peak learning rate, moment decays, decoupled weight decay,
    and a linear warm-up over ``lr_warmup * steps`` steps, then constant or decaying
    (cosine or linear) to 0 after the last step."""

    learning_rate: float = 0.02
    b1: float = 0.9
    b2: float = 0.999
    weight_decay: float = 0.0
    lr_warmup: float = 0.0
    lr_decay: Literal["constant", "cosine", "linear"] = "constant"

    def check(self) -> None:
        check_field(self.learning_rate > 0, "learning_rate", "a float > 0")
        check_field(self.weight_decay >= 0, "weight_decay", "a float >= 0")
        check_field(0 <= self.lr_warmup < 1, "lr_warmup", "a float in [0, 1)")

    def schedule(self, steps: int) -> optax.ScalarOrSchedule:
        """The learning rate over a run of ``steps`` steps."""
        peak, warm = self.learning_rate, round(self.lr_warmup * steps)
        if warm == 0 and self.lr_decay == "constant":
            return peak
        rest = max(steps - warm, 1)
        after = {
            "constant": optax.constant_schedule(peak),
            "cosine": optax.cosine_decay_schedule(peak, rest),
            "linear": optax.linear_schedule(peak, 0.0, rest),
        }[self.lr_decay]
        if warm == 0:
            return after
        # Starts at peak / warm, not 0: step 0 is a real step.
        ramp = optax.linear_schedule(peak / warm, peak, warm - 1)
        return optax.join_schedules([ramp, after], [warm])

    def rule(
        self, factory: Callable[..., optax.GradientTransformation], ctx: Context, freeze_step: int
    ) -> optax.GradientTransformation:
        """``factory`` (`shoal.optim.onebit_lamb` or `shoal.optim.onebit_adam`) with these
        fields over the run, dense for its first ``freeze_step`` steps."""
        return factory(
            self.schedule(ctx.run.steps),
            collective=ctx.comms,
            freeze_step=freeze_step,
            b1=self.b1,
            b2=self.b2,
            weight_decay=self.weight_decay,
        )


@dataclasses.dataclass(frozen=True)
class OneBitFields(LambFields):
    """`LambFields` and the 1-bit family's warm-up stage (a dense all-reduce): it lasts
    ``freeze_step`` steps, or ``round(freeze_fraction * steps)`` when that is None."""

    freeze_fraction: float = 0.15
    freeze_step: int | None = None

    def check(self) -> None:
        super().check()
        check_field(0 < self.freeze_fraction < 1, "freeze_fraction", "a float in (0, 1)")
        check_field(
            self.freeze_step is None or self.freeze_step >= 1,
            "freeze_step",
            "None (from freeze_fraction) or an int >= 1",
        )

    def frozen_at(self, steps: int) -> int:
        """The last warm-up step of a run of ``steps`` steps (at least 1)."""
        if self.freeze_step is not None:
            return self.freeze_step
        return max(1, round(self.freeze_fraction * steps))

    def check_run(self, run: Config) -> None:
        if self.frozen_at(run.steps) >= run.steps:
            raise ConfigError(
                f"the freeze step {self.frozen_at(run.steps)} must be less than steps = "
                f"{run.steps}, or nothing is compressed (that is 'lamb')"
            )


def onebit_warmup(params: OneBitFields, run: Config) -> int:
    """A 1-bit algorithm's uncompressed steps (`register`'s ``warmup``)."""
    return params.frozen_at(run.steps)
