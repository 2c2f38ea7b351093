"""The bundled algorithms: each a builder registered with
`shoal.experiments.algorithms.register` (name, own config fields, checks), mapping a
`Config` and the workers' collectives to the optax transformation every worker runs.
Importing `shoal.experiments.algorithms` registers them."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax

from shoal.comms import (
    Compressor,
    Quantized,
    TopK,
    gradient_order,
)
from shoal.experiments.algorithms import BuildContext, freeze_step, local_sgd, register
from shoal.experiments.config import Config, ConfigError
from shoal.optim import (
    allreduce_gradients,
    bfb_allreduce,
    bmuf,
    bmuf_gtc,
    demo,
    diloco,
    gradient_noise_scale,
    gtc,
    onebit_adam,
    onebit_lamb,
    partial_exchange,
    peer_averaging,
    powersgd,
    sma,
    streaming_diloco,
    topk,
)

# The hyper-parameters of several algorithms (`register`'s ``fields``).
_GTC = ("gtc_threshold", "gtc_capacity")
_BMUF = ("block_size", "block_lr", "block_momentum", "nesterov", "nbm", "warmup_steps",
         "reset_inner_state")  # fmt: skip
_LAMB = ("lamb_learning_rate", "lamb_b1", "lamb_b2", "weight_decay", "lamb_lr_warmup",
         "lamb_lr_decay")  # fmt: skip
# adaptive runs ssgd_noise, then pgx (at adaptive_fraction), as its policy decides.
_ADAPTIVE = ("noise_ema", "pgx_fraction", "adaptive_fraction", "adaptive_sync", "policy_every",
             "policy_after", "noise_threshold")  # fmt: skip


@register("ssgd", fields=(), reference=True)
def ssgd(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """Synchronous SGD: all-reduce (mean) the gradients every step, then `local_sgd`."""
    return optax.chain(allreduce_gradients(collective=collective), local_sgd(cfg))


@register("ssgd_adamw", fields=("diloco_inner_lr", "weight_decay"))
def ssgd_adamw(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """S-SGD with AdamW: all-reduce (mean) the gradients every step, then AdamW at
    ``diloco_inner_lr`` with ``weight_decay``: DiLoCo's inner optimizer, so that the
    baseline and DiLoCo differ only in how often they synchronise."""
    tx = allreduce_gradients(collective=collective)
    return optax.chain(tx, optax.adamw(cfg.diloco_inner_lr, weight_decay=cfg.weight_decay))


@register("gtc", fields=_GTC, skip_in_place=False)
def gtc_sgd(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """Strom's threshold compression of the gradients (`shoal.optim.gtc`), then `local_sgd`."""
    return optax.chain(
        gtc(cfg.gtc_threshold, collective=collective, capacity=cfg.gtc_capacity),
        local_sgd(cfg),
    )


@register("bfb", context=True, fields=("bfb_buffer_bytes",))
def bfb(cfg: Config, collective: Any, context: BuildContext) -> optax.GradientTransformation:
    """Herring's balanced fusion buffers (`shoal.optim.bfb_allreduce`), then `local_sgd`:
    the mean gradient, reduced buffer by buffer in the order the backward pass produces
    the gradients, by the workers themselves (colocated) or, in an MPI run started with
    ``--servers S``, by S dedicated server ranks."""
    order = None
    if context.task is not None:
        params = context.task.init_params()
        x, y = context.task.batch(0, 1)
        spec = lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype)  # one worker's batch
        order = gradient_order(context.task.loss, params, spec(x), spec(y))
    reduce = bfb_allreduce(
        collective=collective,
        buffer_bytes=cfg.bfb_buffer_bytes or None,
        servers=context.servers,
        order=order,
    )
    return optax.chain(reduce, local_sgd(cfg))


def _check_bmuf(cfg: Config) -> None:
    # The evaluated model is the global model of the last BMUF step: make that the last step.
    # (Block momentum and rate are bmuf's own to check.)
    if (cfg.steps - cfg.warmup_steps) % cfg.block_size or cfg.steps <= cfg.warmup_steps:
        raise ConfigError(
            f"steps - warmup_steps = {cfg.steps - cfg.warmup_steps} must be a positive multiple "
            f"of block_size = {cfg.block_size}, so that the last step is a BMUF step"
        )


def _check_bmuf_gtc(cfg: Config) -> None:
    if cfg.workers % cfg.group_size:
        raise ConfigError(
            f"group_size = {cfg.group_size} must divide the number of workers {cfg.workers}"
        )
    if cfg.warmup_steps:
        raise ConfigError("warmup_steps must be 0: shoal.optim.bmuf_gtc has no warm-up")
    _check_bmuf(cfg)


@register("bmuf", check=_check_bmuf, fields=_BMUF, skip_in_place="apply")
def bmuf_sgd(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """BMUF (`shoal.optim.bmuf`) around `local_sgd`: ``block_size`` local steps per worker,
    then the BMUF step over all workers."""
    return bmuf(
        local_sgd(cfg),
        collective=collective,
        block_size=cfg.block_size,
        block_lr=cfg.block_lr,
        block_momentum=cfg.block_momentum,
        nesterov=cfg.nesterov,
        nbm=cfg.nbm,
        warmup_steps=cfg.warmup_steps,
        reset_inner_state=cfg.reset_inner_state,
    )


@register(
    "bmuf_gtc",
    two_tier=True,
    check=_check_bmuf_gtc,
    fields=(*_BMUF, *_GTC, "group_size"),
    skip_in_place="apply",
)
def bmuf_gtc_sgd(cfg: Config, tiers: tuple[Any, Any]) -> optax.GradientTransformation:
    """Two-tier BMUF_GTC (`shoal.optim.bmuf_gtc`) around `local_sgd`: GTC
    (``gtc_threshold``, ``gtc_capacity``) every step inside groups of ``group_size``,
    the BMUF step across the groups every ``block_size`` steps."""
    intra, inter = tiers
    return bmuf_gtc(
        local_sgd(cfg),
        intra=intra,
        inter=inter,
        block_size=cfg.block_size,
        threshold=cfg.gtc_threshold,
        capacity=cfg.gtc_capacity,
        block_lr=cfg.block_lr,
        block_momentum=cfg.block_momentum,
        nesterov=cfg.nesterov,
        nbm=cfg.nbm,
        reset_inner_state=cfg.reset_inner_state,
    )


_TOPK = ("topk_fraction", "topk_chunk_size", "topk_value_bits")
_DILOCO = ("diloco_sync_every", "diloco_outer_lr", "diloco_outer_momentum", "diloco_inner",
           "diloco_inner_lr", "weight_decay", "diloco_exchange", *_TOPK)  # fmt: skip


def _check_diloco(cfg: Config) -> None:
    # The runner evaluates the workers' models: make the last step an outer step, after
    # which every worker holds the global model.
    if cfg.steps % cfg.diloco_sync_every:
        raise ConfigError(
            f"steps = {cfg.steps} must be a multiple of diloco_sync_every = "
            f"{cfg.diloco_sync_every}, so that the last step is an outer step"
        )


def _topk_codec(cfg: Config) -> TopK:
    bits = cfg.topk_value_bits or None
    return TopK(fraction=cfg.topk_fraction, chunk_size=cfg.topk_chunk_size, value_bits=bits)


def diloco_exchange(cfg: Config) -> Compressor | None:
    """``diloco_exchange`` as a `shoal.comms.Compressor` (None: a float32 all-reduce)."""
    if cfg.diloco_exchange == "float32":
        return None
    if cfg.diloco_exchange == "topk":
        return _topk_codec(cfg)
    return Quantized(cfg.diloco_exchange)


def _diloco_parts(cfg: Config) -> tuple[optax.GradientTransformation, ...]:
    if cfg.diloco_inner == "adamw":
        inner = optax.adamw(cfg.diloco_inner_lr, weight_decay=cfg.weight_decay)
    else:
        inner = local_sgd(cfg)
    outer = optax.sgd(cfg.diloco_outer_lr, momentum=cfg.diloco_outer_momentum, nesterov=True)
    return inner, outer


@register("diloco", check=_check_diloco, fields=_DILOCO, skip_in_place="apply")
def diloco_(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """DiLoCo (`shoal.optim.diloco`): the inner optimizer (``diloco_inner``: AdamW with
    ``diloco_inner_lr`` and ``weight_decay``, or `local_sgd`) on every worker, and every
    ``diloco_sync_every`` steps the outer Nesterov SGD step (``diloco_outer_lr``,
    ``diloco_outer_momentum``) on the average of the workers' progress, exchanged as
    ``diloco_exchange`` says."""
    inner, outer = _diloco_parts(cfg)
    return diloco(
        inner,
        collective=collective,
        sync_every=cfg.diloco_sync_every,
        outer=outer,
        exchange=diloco_exchange(cfg),
    )


@register(
    "streaming_diloco",
    fields=(*_DILOCO, "streaming_fragments", "streaming_overlap", "streaming_mix"),
)
def streaming_diloco_(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """Streaming DiLoCo (`shoal.optim.streaming_diloco`): `diloco_` with the parameters in
    ``streaming_fragments`` fragments that sync in turn, each outer update merged
    ``streaming_overlap`` steps later with weight ``streaming_mix`` on the local model."""
    inner, outer = _diloco_parts(cfg)
    return streaming_diloco(
        inner,
        collective=collective,
        sync_every=cfg.diloco_sync_every,
        outer=outer,
        num_fragments=cfg.streaming_fragments,
        overlap=cfg.streaming_overlap,
        mix=cfg.streaming_mix,
        exchange=diloco_exchange(cfg),
    )


@register("topk", fields=_TOPK)
def topk_sgd(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """Top-k with error feedback (`shoal.optim.topk`: ``topk_fraction`` of each chunk of
    ``topk_chunk_size``, values at ``topk_value_bits``), then `local_sgd`."""
    bits = cfg.topk_value_bits or None
    tx = topk(cfg.topk_fraction, collective=collective, chunk_size=cfg.topk_chunk_size,
              value_bits=bits)  # fmt: skip
    return optax.chain(tx, local_sgd(cfg))


@register("powersgd", fields=("powersgd_rank", "powersgd_start_step"))
def powersgd_sgd(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """PowerSGD (`shoal.optim.powersgd` at ``powersgd_rank``, plain all-reduce for the first
    ``powersgd_start_step`` steps), then `local_sgd`."""
    tx = powersgd(cfg.powersgd_rank, collective=collective, start_step=cfg.powersgd_start_step,
                  seed=cfg.seed)  # fmt: skip
    return optax.chain(tx, local_sgd(cfg))


@register("demo", fields=("demo_momentum", "demo_chunk_size", "demo_topk", "demo_sign", "demo_lr"))
def demo_sgd(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """DeMo (`shoal.optim.demo`): decoupled momentum ``demo_momentum``, its DCT top
    ``demo_topk`` of each ``demo_chunk_size`` chunk exchanged, the sign of the mean
    (``demo_sign``) stepped with SGD at ``demo_lr``."""
    tx = demo(collective=collective, momentum=cfg.demo_momentum, chunk_size=cfg.demo_chunk_size,
              topk=cfg.demo_topk, sign=cfg.demo_sign)  # fmt: skip
    return optax.chain(tx, optax.sgd(cfg.demo_lr))


def lamb_schedule(cfg: Config) -> optax.ScalarOrSchedule:
    """``lamb_learning_rate`` with a linear warm-up over ``lamb_lr_warmup * steps`` steps,
    then constant or decaying (``lamb_lr_decay``) to 0 after the last step."""
    peak, warm = cfg.lamb_learning_rate, round(cfg.lamb_lr_warmup * cfg.steps)
    if warm == 0 and cfg.lamb_lr_decay == "constant":
        return peak
    rest = max(cfg.steps - warm, 1)
    after = {
        "constant": optax.constant_schedule(peak),
        "cosine": optax.cosine_decay_schedule(peak, rest),
        "linear": optax.linear_schedule(peak, 0.0, rest),
    }[cfg.lamb_lr_decay]
    if warm == 0:
        return after
    # Starts at peak / warm, not 0: step 0 is a real step.
    ramp = optax.linear_schedule(peak / warm, peak, warm - 1)
    return optax.join_schedules([ramp, after], [warm])


def _lamb(cfg: Config, collective: Any, freeze: int) -> optax.GradientTransformation:
    return onebit_lamb(
        lamb_schedule(cfg),
        collective=collective,
        freeze_step=freeze,
        b1=cfg.lamb_b1,
        b2=cfg.lamb_b2,
        weight_decay=cfg.weight_decay,
    )


# The skip around the update and its application (`skip_nonfinite`'s "apply"): the update,
# the same on every worker, is added to the parameters in the pass that computes it instead
# of being written out per worker first (1-bit LAMB's compression stage at 1.05M params x 16
# simulated workers: 1.94x -> 1.84x local SGD's step, side by side in one process).
_ONEBIT_SKIP = "apply"


@register("lamb", fields=_LAMB, skip_in_place=_ONEBIT_SKIP)
def lamb(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """LAMB on the all-reduced gradients, the uncompressed baseline of ``onebit_lamb``:
    `shoal.optim.onebit_lamb` whose warm-up stage (a dense all-reduce, then LAMB without
    bias correction) never ends, so it runs the same rule as 1-bit LAMB's warm-up."""
    return _lamb(cfg, collective, cfg.steps + 1)


def _check_onebit(cfg: Config) -> None:
    if freeze_step(cfg) >= cfg.steps:
        raise ConfigError(
            f"the freeze step {freeze_step(cfg)} must be less than steps = {cfg.steps}, "
            "or nothing is compressed (that is 'lamb')"
        )


@register(
    "onebit_lamb",
    check=_check_onebit,
    fields=(*_LAMB, "onebit_freeze_fraction", "onebit_freeze_step"),
    compares_to="lamb",
    warmup=freeze_step,
    skip_in_place=_ONEBIT_SKIP,
)
def onebit_lamb_(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """1-bit LAMB (`shoal.optim.onebit_lamb`): `lamb` for `freeze_step` steps, then the
    momentum through the 1-bit compressed all-reduce with the frozen variance."""
    return _lamb(cfg, collective, freeze_step(cfg))


@register(
    "onebit_adam",
    check=_check_onebit,
    fields=(*_LAMB, "onebit_freeze_fraction", "onebit_freeze_step"),
    skip_in_place=_ONEBIT_SKIP,
)
def onebit_adam_(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """1-bit Adam (`shoal.optim.onebit_adam`): Adam on the all-reduced gradients for
    `freeze_step` steps, then the momentum through the 1-bit compressed all-reduce with the
    frozen variance; the 1-bit family's rate schedule (`lamb_schedule`), b1, b2 and weight
    decay."""
    return onebit_adam(lamb_schedule(cfg), collective=collective, freeze_step=freeze_step(cfg),
                       b1=cfg.lamb_b1, b2=cfg.lamb_b2, weight_decay=cfg.weight_decay)  # fmt: skip


@register("pgx", fields=("pgx_fraction",), skip_in_place=True)
def pgx(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """KungFu's partial gradient exchange (`shoal.optim.partial_exchange`): one bin of
    ``pgx_fraction`` of the gradient bytes averaged per step, round robin, then
    `local_sgd`."""
    return optax.chain(partial_exchange(cfg.pgx_fraction, collective=collective), local_sgd(cfg))


def _check_peers(cfg: Config) -> None:
    if cfg.workers < 2:
        raise ConfigError("peer averaging needs at least 2 workers")


@register(
    "peer", check=_check_peers, fields=("peer_strategy", "peer_staleness"), skip_in_place="apply"
)
def peer(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """KungFu's peer model averaging (`shoal.optim.peer_averaging`) around `local_sgd`:
    every step each worker averages its model with one peer's (``peer_strategy``,
    ``peer_staleness``), then applies its local update."""
    return peer_averaging(
        local_sgd(cfg),
        collective=collective,
        strategy=cfg.peer_strategy,
        staleness=cfg.peer_staleness,
        seed=cfg.seed,
    )


@register("sma", fields=("sma_alpha",), skip_in_place="apply")
def sma_(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """Synchronous model averaging (`shoal.optim.sma`) around `local_sgd`: every step
    ``v <- (1 - sma_alpha) v + sma_alpha mean(v)``, then the local update."""
    return sma(local_sgd(cfg), collective=collective, alpha=cfg.sma_alpha)


@register("ssgd_noise", fields=("noise_ema",))
def ssgd_noise(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """S-SGD that also estimates the gradient noise scale
    (`shoal.optim.gradient_noise_scale`, logged as ``noise_scale``), then `local_sgd`."""
    return optax.chain(
        gradient_noise_scale(
            collective=collective,
            local_batch_size=cfg.batch_size,
            ema=cfg.noise_ema,
        ),
        local_sgd(cfg),
    )


@register("adaptive", policy="noise_scale", fields=_ADAPTIVE)
def adaptive(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """KungFu with closed-loop adaptation: ``ssgd_noise`` while ``adaptive_sync`` is
    "full", partial exchange of ``adaptive_fraction`` once the ``noise_scale`` policy
    (`shoal.experiments.runner.policies.noise_scale_switch`) sets it to "partial"."""
    if cfg.adaptive_sync == "full":
        return ssgd_noise(cfg, collective)
    return pgx(dataclasses.replace(cfg, pgx_fraction=cfg.adaptive_fraction), collective)
