"""Registry of the algorithms a config can name (the bundled ones are in
`shoal.experiments.builders`).

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

and give `shoal.experiments.fields.HyperParameters` (or the config file's subclass of
`Config`) typed fields for its hyper-parameters, so that ``--set gtc_threshold=0.01``
works. The transformation checks their values itself (`resolve` makes it once on
stand-in workers, so a bad value stops the run before training, named).
``register(..., check=f)`` adds ``f(cfg)``, which raises `ConfigError` for settings the
algorithm cannot run as a whole (BMUF's last step must end a block). ``register(..., fields=(...))``
declares the `Config` fields that are the algorithm's own hyper-parameters (those it
reads that no other part of a run does): ``--resume`` then ignores changes to other
algorithms' fields, so a changed ``gtc_threshold`` still resumes ``ssgd`` (see
`unused_fields`). Fields that no algorithm declares (task, model, seed, workers, batch,
learning rate, ...) concern every algorithm. An algorithm registered without ``fields``
is taken to depend on every field.

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

import optax

from shoal.comms import (
    Collective,
    RecordingCollective,
)
from shoal.experiments.config import Config, ConfigError
from shoal.optim import (
    skip_nonfinite,
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
    steps (1-bit LAMB and LAMB), which the report then puts side by side.
    ``skip_in_place``: the ``in_place`` of the `shoal.optim.skip_nonfinite` around it
    (None: that function's default)."""

    build: Builder
    two_tier: bool = False
    check: Callable[[Config], None] | None = None
    context: bool = False
    policy: str | None = None
    fields: frozenset[str] | None = None
    reference: bool = False
    compares_to: str | None = None
    warmup: Callable[[Config], int] | None = None
    skip_in_place: bool | str | None = None


ALGORITHMS: dict[str, Algorithm] = {}


def register(
    name: str,
    *,
    two_tier: bool = False,
    check: Callable[[Config], None] | None = None,
    context: bool = False,
    policy: str | None = None,
    fields: tuple[str, ...] | None = None,
    skip_in_place: bool | str | None = None,
    **report: Any,
) -> Callable[[Builder], Builder]:
    """Decorator: make ``builder`` available to configs as ``name``; ``fields``: the
    `Config` fields of its own hyper-parameters (see the module docstring);
    ``skip_in_place``: see `Algorithm`; ``report``: `Algorithm`'s ``reference``,
    ``compares_to`` and ``warmup``."""
    own = None if fields is None else frozenset(fields)

    def add(builder: Builder) -> Builder:
        if name in ALGORITHMS:
            raise ValueError(f"algorithm {name!r} is already registered")
        ALGORITHMS[name] = Algorithm(
            builder, two_tier, check, context, policy, own, skip_in_place=skip_in_place, **report
        )
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
        in_place = algo.skip_in_place
        return skip_nonfinite(tx, collective=comms, nonfinite=sub.nonfinite, in_place=in_place)


def resolve(entry: str | Entry, cfg: Config) -> Entry:
    """``entry`` (a ``Config.algorithms`` string) as an `Entry` of ``cfg``; an `Entry`
    is returned as it is. Raises `ConfigError` for an unknown algorithm, a bad override
    or settings the algorithm cannot run (its ``check``), naming the entry."""
    if isinstance(entry, Entry):
        return entry
    from shoal.experiments.overrides import apply_overrides

    name, overrides = parse_entry(entry)
    algo = ALGORITHMS.get(name)
    if algo is None:
        raise ConfigError(
            f"unknown algorithm {name!r}; registered: {', '.join(sorted(ALGORITHMS))}"
        )
    _check_bracket_keys(entry, overrides, algo, cfg)
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


def _check_bracket_keys(entry: str, overrides: list[str], algo: Algorithm, cfg: Config) -> None:
    """`ConfigError` for a bracketed override of a run or task field: the run trains every
    entry with the run's steps, seed, workers, batches and model, so ``ssgd[seed=1]``
    would train seed 0 under a label that says 1. An entry's brackets take the
    hyper-parameters (`shoal.experiments.fields.HyperParameters`) and the fields its
    algorithm declares; unknown keys are left to `apply_overrides`'s error."""
    from shoal.experiments.fields import HyperParameters
    from shoal.experiments.overrides import parse_assignment

    allowed = {f.name for f in dataclasses.fields(HyperParameters)} | set(algo.fields or ())
    known = {f.name for f in dataclasses.fields(cfg)}
    for item in overrides:
        key = parse_assignment(item)[0].split(".")[0]
        if key in known and key not in allowed:
            raise ConfigError(
                f"algorithm entry {entry!r}: {key!r} is a field of the whole run (its "
                f"steps, seed, workers, data or model), the same for every entry: set it "
                f"with --set {key}=..., or run another config; brackets take an entry's "
                "hyper-parameters"
            )


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


def local_sgd(cfg: Config) -> optax.GradientTransformation:
    """The local optimizer of every algorithm, SGD with heavy-ball momentum: chained after
    the gradient exchange of ``ssgd`` and ``gtc``, wrapped by ``bmuf`` and ``bmuf_gtc``."""
    return optax.sgd(cfg.learning_rate, momentum=cfg.momentum or None)


def freeze_step(cfg: Config) -> int:
    """1-bit LAMB's last warm-up step: ``onebit_freeze_step``, else
    ``round(onebit_freeze_fraction * steps)`` (at least 1)."""
    if cfg.onebit_freeze_step is not None:
        return cfg.onebit_freeze_step
    return max(1, round(cfg.onebit_freeze_fraction * cfg.steps))


# The bundled algorithms register themselves once the registry above exists.
from shoal.experiments import builders  # noqa: E402, F401
