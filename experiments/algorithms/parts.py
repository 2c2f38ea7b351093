"""The parts algorithms' hyper-parameters are made of: the local optimizer, DiLoCo's inner
and outer optimizers, their learning-rate `Schedule`, the exchange codec, and the groups of
fields several algorithms share (BMUF's block step, GTC's threshold, the LAMB family's rule
and schedule).

Each is a small `Hyper` dataclass: an algorithm holds an optimizer part as a field
(``local: LocalSGD``, spelt ``--set ssgd.local.learning_rate=0.1``) and inherits a group
of shared fields (``bmuf.block_size``, ``bmuf_gtc.block_size``). An optimizer part's
``make(steps)`` takes the number of steps that optimizer takes in the run, the horizon of
its schedule: the run's steps for a local or inner optimizer, the outer steps
(`RoundFields.rounds`) for an outer one.

Example:
  >>> LocalSGD(learning_rate=0.1).make()  # doctest: +ELLIPSIS
  GradientTransformationExtraArgs(...)
  >>> sgd = LocalSGD(schedule=Schedule(kind="cosine"), clip=1.0).make(steps=100)
  >>> Exchange(codec="int8").make().fmt
  'int8'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import jax.numpy as jnp
import optax

from shoal.comms import Compressor, Quantized, TopK
from shoal.dtypes import standard_promotion
from shoal.experiments.algorithms._registry import Context, Hyper
from shoal.experiments.fields import ConfigError, check_field

if TYPE_CHECKING:
    from shoal.experiments.config import Config


@dataclasses.dataclass(frozen=True)
class Schedule(Hyper):
    """An optimizer's learning rate at its step t = 0, 1, ... (its own count: a local or
    inner optimizer's steps, an outer optimizer's outer steps), for a peak rate ``lr``: a
    linear warm-up over ``warmup_steps`` W from ``init * lr``, then ``kind`` up to the
    horizon T, and ``end = end_fraction * lr`` after it::

        t < W:            lr (init + (1 - init) t / W)
        W <= t, constant: lr
        W <= t, linear:   end + (lr - end) (1 - (t - W) / (T - W))              (t <= T)
        W <= t, cosine:   end + (lr - end) (1 + cos(pi (t - W) / (T - W))) / 2  (t <= T)

    T is ``horizon``, or None: the optimizer's own steps in the run (`make`'s ``steps``).
    A warm-up from ``init = 0`` moves nothing on step 0 (as optax's schedules). The
    defaults are a constant rate: the optimizer gets the float itself, as without one.

    Example:
      >>> f = Schedule(kind="cosine", warmup_steps=2).make(1.0, steps=6)
      >>> [round(float(f(t)), 3) for t in range(7)]
      [0.0, 0.5, 1.0, 0.854, 0.5, 0.146, 0.0]
    """

    kind: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    init: float = 0.0
    horizon: int | None = None
    end_fraction: float = 0.0

    def check(self) -> None:
        check_field(self.warmup_steps >= 0, "warmup_steps", "an int >= 0")
        check_field(0 <= self.init <= 1, "init", "a float in [0, 1]")
        check_field(
            self.horizon is None or self.horizon >= 1,
            "horizon",
            "None (the optimizer's steps in the run) or an int >= 1",
        )
        check_field(0 <= self.end_fraction <= 1, "end_fraction", "a float in [0, 1]")
        check_field(
            self.kind != "constant" or self.end_fraction == 0,
            "end_fraction",
            "0 with kind 'constant' (it is where a linear or cosine decay ends)",
        )
        if self.horizon is not None:
            self.check_horizon(self.horizon)

    @property
    def varies(self) -> bool:
        """Whether the rate changes over the run (a warm-up or a decay)."""
        return self.kind != "constant" or self.warmup_steps > 0

    def check_horizon(self, horizon: int) -> None:
        """`ConfigError` unless the warm-up ends within ``horizon`` steps (before it, for
        a decay: a decay needs at least one step)."""
        w = self.warmup_steps
        if w > horizon or (self.kind != "constant" and w == horizon):
            most = "at most" if self.kind == "constant" else "less than"
            raise ConfigError(
                f"config field 'schedule.warmup_steps' must be {most} the schedule's horizon "
                f"T = {horizon} (schedule.horizon, or the steps its optimizer takes in the "
                f"run), got {w}"
            )

    def make(self, lr: float, steps: int | None = None) -> optax.ScalarOrSchedule:
        """The rate for ``optax``: ``lr`` itself when it does not vary, else the schedule
        of peak ``lr`` over ``steps`` (the optimizer's own steps in the run; needed for a
        decay without a ``horizon``)."""
        if not self.varies:
            return lr
        horizon = self.horizon if self.horizon is not None else steps
        if horizon is None and self.kind != "constant":
            raise ValueError(
                f"a {self.kind} schedule needs its horizon: give make() the optimizer's steps "
                "in the run, or set schedule.horizon"
            )
        if horizon is not None:
            self.check_horizon(horizon)
        w, start, end = self.warmup_steps, self.init * lr, self.end_fraction * lr
        if self.kind == "constant":
            rate = optax.linear_schedule(start, lr, w)
        elif self.kind == "cosine" and w:
            rate = optax.warmup_cosine_decay_schedule(start, lr, w, horizon, end_value=end)
        elif self.kind == "cosine":
            rate = optax.cosine_decay_schedule(lr, horizon, alpha=self.end_fraction)
        else:
            decay = optax.linear_schedule(lr, end, horizon - w)
            warm = optax.linear_schedule(start, lr, w)
            rate = optax.join_schedules([warm, decay], [w]) if w else decay
        # optax's count is an int32, which strict promotion will not mix with the floats.
        return lambda count: rate(jnp.asarray(count, jnp.float32))


def check_clip(clip: float | None) -> None:
    """`ConfigError` unless ``clip`` is None or > 0."""
    check_field(clip is None or clip > 0, "clip", "None (no clipping) or a float > 0")


def clipped(clip: float | None, tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` on its input clipped to global norm ``clip``: ``g * min(1, clip / ||g||)``
    over all leaves together (`optax.clip_by_global_norm`); ``tx`` itself for None."""
    return tx if clip is None else optax.chain(optax.clip_by_global_norm(clip), tx)


@dataclasses.dataclass(frozen=True)
class LocalSGD(Hyper):
    """SGD with heavy-ball momentum (0: none), the local optimizer of most algorithms, its
    learning rate's `Schedule` over the run's steps, and ``clip``, the global norm its
    input is clipped to first (None: none).

    Its input is what the algorithm hands it: the mean gradient after an exchange
    (ssgd, ssgd_noise, adaptive, bfb_allreduce; the decompressed one of gtc, topk,
    powersgd, partial_exchange), so the clip follows the averaging, as DDP then
    ``clip_grad_norm_``; each worker's own gradient where models are averaged instead
    (bmuf and bmuf_gtc between block steps, sma, peer_averaging, DiLoCo's inner "sgd").
    """

    learning_rate: float = 0.05
    momentum: float = 0.9
    schedule: Schedule = Schedule()
    clip: float | None = None

    def check(self) -> None:
        check_field(self.learning_rate > 0, "learning_rate", "a float > 0")
        check_field(0 <= self.momentum < 1, "momentum", "a float in [0, 1)")
        check_clip(self.clip)

    def make(self, steps: int | None = None) -> optax.GradientTransformation:
        """The optimizer over a run of ``steps`` steps (`Schedule.make`)."""
        rate = self.schedule.make(self.learning_rate, steps)
        return clipped(self.clip, optax.sgd(rate, momentum=self.momentum or None))


@dataclasses.dataclass(frozen=True)
class AdamW(Hyper):
    """AdamW (optax's b1, b2 and eps) with decoupled weight decay, its learning rate's
    `Schedule` and ``clip``, the global norm its input is clipped to first (None: none):
    the all-reduced gradient in ``ssgd_adamw`` (clipped after averaging), each worker's
    own gradient as DiLoCo's inner optimizer (the DiLoCo paper's recipe)."""

    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    schedule: Schedule = Schedule()
    clip: float | None = None

    def check(self) -> None:
        check_field(self.learning_rate > 0, "learning_rate", "a float > 0")
        # optax does not check it.
        check_field(self.weight_decay >= 0, "weight_decay", "a float >= 0")
        check_clip(self.clip)

    def make(self, steps: int | None = None) -> optax.GradientTransformation:
        """The optimizer over a run of ``steps`` steps (`Schedule.make`)."""
        rate = self.schedule.make(self.learning_rate, steps)
        # optax's bias correction mixes a float with an int32 count: standard promotion
        # for it alone, so that the run is also right under strict promotion.
        adamw = standard_promotion(optax.adamw(rate, weight_decay=self.weight_decay))
        return clipped(self.clip, adamw)


@dataclasses.dataclass(frozen=True)
class OuterSGD(Hyper):
    """DiLoCo's outer step: Nesterov SGD on the averaged outer gradient (the paper's
    learning rate 0.7 and momentum 0.9), its rate's `Schedule` counted in outer steps.
    No clip: its input is already the workers' average."""

    learning_rate: float = 0.7
    momentum: float = 0.9
    schedule: Schedule = Schedule()

    def check(self) -> None:
        check_field(self.learning_rate > 0, "learning_rate", "a float > 0")
        check_field(0 <= self.momentum < 1, "momentum", "a float in [0, 1)")

    def make(self, steps: int | None = None) -> optax.GradientTransformation:
        """The optimizer over ``steps`` outer steps (`RoundFields.rounds`)."""
        rate = self.schedule.make(self.learning_rate, steps)
        return optax.sgd(rate, momentum=self.momentum, nesterov=True)


@dataclasses.dataclass(frozen=True)
class TopKCodec(Hyper):
    """Top-k of each chunk: the share of each chunk of ``chunk_size`` values sent, and
    the bits of each value sent (0: float32)."""

    fraction: float = 0.01
    chunk_size: int = 64
    value_bits: Literal[0, 2, 4, 8] = 0

    def check(self) -> None:
        check_field(0 < self.fraction <= 1, "fraction", "a float in (0, 1]")
        check_field(self.chunk_size >= 1, "chunk_size", "an int >= 1")

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
    """DiLoCo's inner optimizer: ``use`` "adamw" (the paper's) or "sgd", each with its own
    `Schedule` over the inner steps (the run's steps) and ``clip``, applied to each
    worker's own gradient (``diloco.inner.adamw.clip=1.0``: the paper's recipe)."""

    use: Literal["adamw", "sgd"] = "adamw"
    adamw: AdamW = AdamW()
    sgd: LocalSGD = LocalSGD()

    def make(self, steps: int | None = None) -> optax.GradientTransformation:
        """The optimizer over a run of ``steps`` inner steps."""
        return self.adamw.make(steps) if self.use == "adamw" else self.sgd.make(steps)


@dataclasses.dataclass(frozen=True)
class RoundFields(Hyper):
    """The inner steps per round H of the DiLoCo family (`shoal.optim.diloco`): every
    ``sync_every`` steps the outer step averages the workers' progress."""

    sync_every: int = 10

    def check(self) -> None:
        check_field(self.sync_every >= 1, "sync_every", "an int >= 1")

    def rounds(self, run: Config) -> int:
        """The outer steps of a run, an outer optimizer's horizon: ``ceil(steps /
        sync_every)`` (Streaming DiLoCo's later fragments may sync once more than fragment
        0 when ``sync_every`` does not divide the steps)."""
        return -(-run.steps // self.sync_every)

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

    def check_local(self, local: LocalSGD) -> None:
        """`ConfigError` for a varying ``local.schedule`` under ``reset_inner_state``: its
        step count lives in the local optimizer's state, which every block step re-inits,
        so the schedule would restart each block."""
        check_field(
            not (self.reset_inner_state and local.schedule.varies),
            "local.schedule",
            "constant without warm-up while reset_inner_state is True (every block step "
            "re-inits the local optimizer's state, its step count included): set "
            "reset_inner_state=False to schedule the local rate over the run",
        )

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
    a linear warm-up over ``lr_warmup * steps`` steps, then constant or decaying (cosine or
    linear) to 0 after the last step, and ``clip``, the global norm each worker's own
    gradient is clipped to before the rule (None: none; the exchange is inside the rule,
    so the clip comes before the averaging, as DeepSpeed's engine clips before its 1-bit
    optimizers' step).

    The schedule is not a `Schedule`: its warm-up is ``lr (t + 1) / W`` for ``t < W``
    (step 0 is a real step) and holds ``lr`` at steps ``W - 1`` and ``W``, which no
    `Schedule` gives; the configs that set ``lr_warmup`` would train differently."""

    learning_rate: float = 0.02
    b1: float = 0.9
    b2: float = 0.999
    weight_decay: float = 0.0
    lr_warmup: float = 0.0
    lr_decay: Literal["constant", "cosine", "linear"] = "constant"
    clip: float | None = None

    def check(self) -> None:
        check_field(self.learning_rate > 0, "learning_rate", "a float > 0")
        check_field(self.weight_decay >= 0, "weight_decay", "a float >= 0")
        check_field(0 <= self.lr_warmup < 1, "lr_warmup", "a float in [0, 1)")
        check_clip(self.clip)

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
        rule = factory(
            self.schedule(ctx.run.steps),
            collective=ctx.comms,
            freeze_step=freeze_step,
            b1=self.b1,
            b2=self.b2,
            weight_decay=self.weight_decay,
        )
        return clipped(self.clip, rule)


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
