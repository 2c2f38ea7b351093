"""Registry of the algorithms a config can name.

A builder maps ``(cfg, comms)`` to the optax transformation that every worker runs on
its own gradients; the runner applies the updates, so ``optax.apply_updates(params,
updates)`` is the worker's next model. ``comms`` is the world `Collective`, or, for an
algorithm registered with ``two_tier=True``, the pair ``(intra, inter)`` of
`shoal.comms.two_tier` for groups of ``cfg.group_size`` consecutive workers (the
backend lays its workers out to match). A builder registered with ``context=True`` also
gets a `BuildContext` (the task, the dedicated parameter servers). To add an algorithm::

    @register("gtc")
    def gtc(cfg, collective):
        return optax.chain(
            shoal.optim.gtc(cfg.gtc_threshold, collective=collective),
            local_sgd(cfg),
        )

and give `Config` (or the config file's subclass of it) typed fields for its
hyper-parameters, so that ``--set gtc_threshold=0.01`` works. The transformation checks
their values itself (`resolve` makes it once on stand-in workers, so a bad value stops
the run before training, named). ``register(..., check=f)`` adds ``f(cfg)``, which raises
`ConfigError` for settings the algorithm cannot run as a whole (BMUF's last step must end
a block). ``register(..., fields=(...))`` declares the `Config` fields that are the
algorithm's own hyper-parameters (those it reads that no other part of a run does):
``--resume`` then ignores changes to other algorithms' fields, so a changed
``gtc_threshold`` still resumes ``ssgd`` (see `unused_fields`). Fields that no algorithm
declares (task, model, seed, workers, batch, learning rate, ...) concern every algorithm.
An algorithm registered without ``fields`` is taken to depend on every field.

An entry of ``Config.algorithms`` may carry its own overrides in brackets, separated
by ``;``: ``"gtc[gtc_threshold=0.01;gtc_capacity=0.05]"`` trains ``gtc`` with those
fields changed (sweeps list several such entries; the label is the whole entry).

Each entry is resolved once (`resolve`, `resolve_all`: the CLI and studies do it before
any training) into an `Entry`: its label, registration and config, which builds the
transformation (`Entry.build`, wrapped in `shoal.optim.skip_nonfinite` as
``cfg.nonfinite`` says: one non-finite check for the whole chain) and is what the
training loop, the projection and the reports receive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax

from shoal.comms import (
    Collective,
    Compressor,
    Quantized,
    RecordingCollective,
    TopK,
    gradient_order,
)
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
    skip_nonfinite,
    sma,
    streaming_diloco,
    topk,
)

Comms = Collective | tuple[Collective, Collective]
Builder = Callable[[Config, Comms], optax.GradientTransformation]


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """What a few builders need beyond the config: the ``task`` (its loss, e.g. for the
    gradients' production order) and the dedicated `shoal.comms.ParameterServers` of an
    MPI run (None when there are none)."""

    task: Any = None
    servers: Any = None


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A registered builder; ``two_tier``: it takes ``(intra, inter)``; ``context``: it
    takes a third argument, the `BuildContext`; ``check(cfg)`` raises `ConfigError` for a
    config it cannot run (None: any config); ``policy`` names the
    `shoal.experiments.runner.policies.Policy` that may change its config fields during a run;
    ``fields`` are its own hyper-parameters' `Config` fields (None: undeclared, it may
    depend on any field). For reports: ``reference`` marks the uncompressed baseline that
    every other entry is compared with (speed-ups, accuracy gaps); ``compares_to`` names
    the algorithm whose rule this one runs uncompressed for its first ``warmup(cfg)``
    steps (1-bit LAMB and LAMB), which the report then puts side by side."""

    build: Builder
    two_tier: bool = False
    check: Callable[[Config], None] | None = None
    context: bool = False
    policy: str | None = None
    fields: frozenset[str] | None = None
    reference: bool = False
    compares_to: str | None = None
    warmup: Callable[[Config], int] | None = None


ALGORITHMS: dict[str, Algorithm] = {}


def register(
    name: str,
    *,
    two_tier: bool = False,
    check: Callable[[Config], None] | None = None,
    context: bool = False,
    policy: str | None = None,
    fields: tuple[str, ...] | None = None,
    **report: Any,
) -> Callable[[Builder], Builder]:
    """Decorator: make ``builder`` available to configs as ``name``; ``fields``: the
    `Config` fields of its own hyper-parameters (see the module docstring); ``report``:
    `Algorithm`'s ``reference``, ``compares_to`` and ``warmup``."""
    own = None if fields is None else frozenset(fields)

    def add(builder: Builder) -> Builder:
        if name in ALGORITHMS:
            raise ValueError(f"algorithm {name!r} is already registered")
        ALGORITHMS[name] = Algorithm(builder, two_tier, check, context, policy, own, **report)
        return builder

    return add


def parse_entry(entry: str) -> tuple[str, list[str]]:
    """``"name[k1=v1;k2=v2]"`` -> ``("name", ["k1=v1", "k2=v2"])``."""
    name, bracket, rest = entry.partition("[")
    if not bracket:
        return entry.strip(), []
    if not rest.endswith("]"):
        raise ConfigError(f"algorithm entry {entry!r}: expected name[key=value;...]")
    return name.strip(), [a for a in rest[:-1].split(";") if a.strip()]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One entry of ``Config.algorithms``, resolved once (`resolve`) and passed down.

    Attributes:
      label: the entry as written (``"gtc[gtc_threshold=0.01]"``): its name in records,
        reports and checkpoints.
      name: the registered algorithm's name (``"gtc"``).
      algorithm: its registration (builder, two-tier shape, policy, own fields).
      cfg: the config it trains with: the run's config plus the entry's bracketed
        overrides, already checked by the algorithm's ``check``.
    """

    label: str
    name: str
    algorithm: Algorithm
    cfg: Config

    @property
    def group_size(self) -> int | None:
        """Workers per group of a two-tier algorithm (``cfg.group_size``), else None."""
        return self.cfg.group_size if self.algorithm.two_tier else None

    @property
    def policy(self) -> str | None:
        """The name of the `shoal.experiments.runner.policies` policy that may change its fields."""
        return self.algorithm.policy

    def config(self, changes: dict[str, Any] | None = None) -> Config:
        """``cfg`` with a policy's decisions so far (``changes``) on top."""
        return dataclasses.replace(self.cfg, **changes) if changes else self.cfg

    def build(
        self,
        comms: Comms,
        context: BuildContext | None = None,
        changes: dict[str, Any] | None = None,
    ) -> optax.GradientTransformation:
        """The transformation every worker runs: ``comms`` is the world collective, or
        ``(intra, inter)`` when `group_size` is not None; wrapped in
        `shoal.optim.skip_nonfinite` as ``cfg.nonfinite`` says (one check for the whole
        chain, so a skipped step moves no momentum either)."""
        sub = self.config(changes)
        algo = self.algorithm
        tx = (
            algo.build(sub, comms, context or BuildContext())
            if algo.context
            else algo.build(sub, comms)
        )
        if sub.nonfinite == "off":
            return tx
        return skip_nonfinite(tx, collective=comms, nonfinite=sub.nonfinite)


def resolve(entry: str | Entry, cfg: Config) -> Entry:
    """``entry`` (a ``Config.algorithms`` string) as an `Entry` of ``cfg``; an `Entry`
    is returned as it is. Raises `ConfigError` for an unknown algorithm, a bad override
    or settings the algorithm cannot run (its ``check``), naming the entry."""
    if isinstance(entry, Entry):
        return entry
    from shoal.experiments.config import apply_overrides

    name, overrides = parse_entry(entry)
    algo = ALGORITHMS.get(name)
    if algo is None:
        raise ConfigError(
            f"unknown algorithm {name!r}; registered: {', '.join(sorted(ALGORITHMS))}"
        )
    sub = apply_overrides(cfg, overrides)
    resolved = Entry(entry, name, algo, sub)
    try:
        if algo.check is not None:
            algo.check(sub)
        # The transformation checks its own hyper-parameters when it is made: make it
        # once, on stand-in workers, so that a bad value stops the run before training.
        world = RecordingCollective(sub.workers)
        gs = resolved.group_size
        resolved.build(world if gs is None else world.split(gs))
    except (ConfigError, ValueError, TypeError) as err:
        own = f" (config fields of {name}: {', '.join(sorted(algo.fields))})" if algo.fields else ""
        raise ConfigError(f"algorithm {entry!r}: {err}{own}") from None
    return resolved


def is_reference(label: str) -> bool:
    """Whether the entry ``label`` is the reference algorithm as registered (no
    overrides): the baseline reports compare every other entry with."""
    algo = ALGORITHMS.get(label)
    return algo is not None and algo.reference


def resolve_all(cfg: Config) -> tuple[Entry, ...]:
    """Every entry of ``cfg.algorithms`` resolved (`resolve`), before any training; the
    error for unknown names lists them all."""
    unknown = [n for n in (parse_entry(e)[0] for e in cfg.algorithms) if n not in ALGORITHMS]
    if unknown:
        raise ConfigError(
            f"unknown algorithm(s) {', '.join(map(repr, unknown))}; "
            f"registered: {', '.join(sorted(ALGORITHMS))}"
        )
    return tuple(resolve(e, cfg) for e in cfg.algorithms)


def unused_fields(entry: str) -> frozenset[str]:
    """`Config` fields that cannot change what ``entry`` trains: the fields other
    registered algorithms declare as their own and ``entry``'s algorithm does not. Empty
    for an algorithm that declares no ``fields`` (it may read any) or is not registered.
    The entry's bracketed overrides are part of its label, so they need no field here."""
    algo = ALGORITHMS.get(parse_entry(entry)[0])
    if algo is None or algo.fields is None:
        return frozenset()
    declared = frozenset().union(*(a.fields or () for a in ALGORITHMS.values()))
    return declared - algo.fields


# The hyper-parameters of several algorithms (`register`'s ``fields``).
_GTC = ("gtc_threshold", "gtc_capacity")
_BMUF = ("block_size", "block_lr", "block_momentum", "nesterov", "nbm", "warmup_steps",
         "reset_inner_state")  # fmt: skip
_LAMB = ("lamb_learning_rate", "lamb_b1", "lamb_b2", "weight_decay", "lamb_lr_warmup",
         "lamb_lr_decay")  # fmt: skip
# adaptive runs ssgd_noise, then pgx (at adaptive_fraction), as its policy decides.
_ADAPTIVE = ("noise_ema", "pgx_fraction", "adaptive_fraction", "adaptive_sync", "policy_every",
             "policy_after", "noise_threshold")  # fmt: skip


def local_sgd(cfg: Config) -> optax.GradientTransformation:
    """The local optimizer of every algorithm, SGD with heavy-ball momentum: chained after
    the gradient exchange of ``ssgd`` and ``gtc``, wrapped by ``bmuf`` and ``bmuf_gtc``."""
    return optax.sgd(cfg.learning_rate, momentum=cfg.momentum or None)


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


@register("gtc", fields=_GTC)
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


@register("bmuf", check=_check_bmuf, fields=_BMUF)
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


@register("bmuf_gtc", two_tier=True, check=_check_bmuf_gtc, fields=(*_BMUF, *_GTC, "group_size"))
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


@register("diloco", check=_check_diloco, fields=_DILOCO)
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


def freeze_step(cfg: Config) -> int:
    """1-bit LAMB's last warm-up step: ``onebit_freeze_step``, else
    ``round(onebit_freeze_fraction * steps)`` (at least 1)."""
    if cfg.onebit_freeze_step is not None:
        return cfg.onebit_freeze_step
    return max(1, round(cfg.onebit_freeze_fraction * cfg.steps))


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


@register("lamb", fields=_LAMB)
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
)
def onebit_lamb_(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """1-bit LAMB (`shoal.optim.onebit_lamb`): `lamb` for `freeze_step` steps, then the
    momentum through the 1-bit compressed all-reduce with the frozen variance."""
    return _lamb(cfg, collective, freeze_step(cfg))


@register(
    "onebit_adam",
    check=_check_onebit,
    fields=(*_LAMB, "onebit_freeze_fraction", "onebit_freeze_step"),
)
def onebit_adam_(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """1-bit Adam (`shoal.optim.onebit_adam`): Adam on the all-reduced gradients for
    `freeze_step` steps, then the momentum through the 1-bit compressed all-reduce with the
    frozen variance; the 1-bit family's rate schedule (`lamb_schedule`), b1, b2 and weight
    decay."""
    return onebit_adam(lamb_schedule(cfg), collective=collective, freeze_step=freeze_step(cfg),
                       b1=cfg.lamb_b1, b2=cfg.lamb_b2, weight_decay=cfg.weight_decay)  # fmt: skip


@register("pgx", fields=("pgx_fraction",))
def pgx(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """KungFu's partial gradient exchange (`shoal.optim.partial_exchange`): one bin of
    ``pgx_fraction`` of the gradient bytes averaged per step, round robin, then
    `local_sgd`."""
    return optax.chain(partial_exchange(cfg.pgx_fraction, collective=collective), local_sgd(cfg))


def _check_peers(cfg: Config) -> None:
    if cfg.workers < 2:
        raise ConfigError("peer averaging needs at least 2 workers")


@register("peer", check=_check_peers, fields=("peer_strategy", "peer_staleness"))
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


@register("sma", fields=("sma_alpha",))
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
