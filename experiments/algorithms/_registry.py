"""The registry of runnable algorithms: `register`, `Hyper`, `Context`, `Entry`, `resolve`.

An algorithm is one module of this package that holds everything about it: a frozen
dataclass of its hyper-parameters (a `Hyper`: typed, with defaults, checked from its
annotations), its checks, its builder and how `shoal.optim.skip_nonfinite` should skip
its steps::

    @dataclasses.dataclass(frozen=True)
    class GTC(Hyper):
        threshold: float = 0.1
        local: LocalSGD = LocalSGD()

    @register("gtc", GTC, skip_in_place=False, family="compressed")
    def build(p: GTC, ctx: Context) -> optax.GradientTransformation:
        gtc = shoal.optim.gtc(p.threshold, collective=ctx.comms)
        return optax.chain(gtc, p.local.make(ctx.run.steps))

Importing `shoal.experiments.algorithms` imports every such module, so a new algorithm is
one new file. Its hyper-parameters are set for the whole run with ``--set
gtc.threshold=0.05`` (``Config.params``), or for one entry of ``Config.algorithms`` in
brackets: ``"gtc[threshold=0.05;local.learning_rate=0.1]"`` (the label is the whole
entry). Brackets take only the algorithm's own fields: the run's steps, seed, workers,
data and model are the same for every entry.

Each entry is resolved once (`resolve`, `resolve_all`: the CLI and studies do it before
any training) into an `Entry`, which builds the transformation (`Entry.build`, wrapped in
`shoal.optim.skip_nonfinite` as ``cfg.nonfinite`` says: one non-finite check for the
whole chain).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import optax

from shoal.comms import Collective, RecordingCollective
from shoal.experiments.fields import ConfigError, check_types, from_mapping, rebuilt
from shoal.optim import skip_nonfinite

if TYPE_CHECKING:
    from shoal.experiments.config import Config
    from shoal.experiments.runner.policies import Policy

Comms = Collective | tuple[Collective, Collective]

# What an algorithm sends, each family's meaning: reports plot each family in its own
# panels, beside the reference (docs/architecture.md, "Registry of runnable algorithms").
FAMILIES = {
    "dense": "the whole gradient all-reduced every step",
    "compressed": "a compressed gradient or momentum exchanged every step",
    "local": "local steps or partial exchanges, models averaged",
}


@dataclasses.dataclass(frozen=True)
class Hyper:
    """Base of an algorithm's hyper-parameters and of the parts they compose
    (`shoal.experiments.algorithms.parts`): a frozen dataclass whose fields are checked
    against their annotations when it is made (`shoal.experiments.fields.check_types`),
    then by `check`.

    Example:
      >>> import dataclasses
      >>> @dataclasses.dataclass(frozen=True)
      ... class Mine(Hyper):
      ...     rate: float = 0.5
      >>> Mine(rate=1).rate
      1.0
      >>> Mine(rate="x")
      Traceback (most recent call last):
      ...
      shoal.experiments.fields.ConfigError: config field 'rate' must be a finite float, got str 'x'
    """

    def __post_init__(self):
        check_types(self)
        self.check()

    def check(self) -> None:
        """`ConfigError` for a value that the transformation does not check itself (an
        optax learning rate); the transformation checks the rest when it is made."""

    def check_run(self, run: Config) -> None:
        """`ConfigError` for a run this algorithm cannot train as configured (BMUF: the
        last step must end a block)."""


@dataclasses.dataclass(frozen=True)
class Context:
    """What a builder gets besides its hyper-parameters.

    Attributes:
      comms: the world `shoal.comms.Collective`, or for an algorithm registered with
        ``two_tier=True`` the pair ``(intra, inter)`` of groups of ``params.group_size``
        consecutive workers (`shoal.comms.two_tier`; the backend lays its workers out to
        match).
      run: the run's `Config` (steps, workers, batch size, seed).
      task: the task (its loss, e.g. for the gradients' production order), or None.
      servers: the dedicated `shoal.comms.ParameterServers` of an MPI run, or None.
    """

    comms: Any
    run: Config
    task: Any = None
    servers: Any = None


Builder = Callable[[Any, Context], optax.GradientTransformation]


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A registered algorithm (`register` says what each field means)."""

    name: str
    params: type[Hyper]
    build: Builder
    skip_in_place: bool | str | None
    two_tier: bool = False
    policy: Policy | None = None
    reference: bool = False
    compares_to: str | None = None
    warmup: Callable[[Any, Config], int] | None = None
    family: str | None = None  # None: one made by hand, outside `register` (tests)
    # Asynchronous outer steps (`shoal.experiments.asynchronous`): the plan of the server
    # from the hyper-parameters and the run; ``build`` then gives each worker's inner
    # optimizer, and the runner plays the rounds on the simulated clock.
    asynchronous: Callable[[Any, Config], Any] | None = None
    # Runs under churn (`shoal.experiments.churn`): its exchanges are all-reduces whose
    # mean over the present workers is its rule, and nothing else counts the workers.
    churn: bool = False
    # Its simulated workers may take their local steps in turn (config ``in_turn``): every
    # ``sync_every``-th step of its own count exchanges, the others only through
    # `shoal.comms.turns.leave_out`.
    turns: bool = False


ALGORITHMS: dict[str, Algorithm] = {}

_SKIP_MODES = (None, True, False, "apply")


def register(
    name: str,
    params: type[Hyper],
    *,
    skip_in_place: bool | str | None,
    family: str,
    two_tier: bool = False,
    policy: Policy | None = None,
    reference: bool = False,
    compares_to: str | None = None,
    warmup: Callable[[Any, Config], int] | None = None,
    asynchronous: Callable[[Any, Config], Any] | None = None,
    churn: bool = False,
    turns: bool = False,
) -> Callable[[Builder], Builder]:
    """Decorator: make the builder ``build(params, ctx)`` runnable as ``name``.

    Args:
      name: the name configs use (``algorithms=("gtc",)``, ``--set gtc.threshold=...``).
      params: its hyper-parameters, a frozen `Hyper` dataclass whose fields all have
        defaults.
      skip_in_place: how `shoal.optim.skip_nonfinite` skips a step around it, a choice of
        speed only (the same results): None (its own choice by the bytes involved), True,
        False or "apply" (the update is applied in the pass that computes it: right for
        updates that are the same on every worker, or that mix other workers' models).
        Required: the algorithm's module states it.
      family: what it sends, one of `FAMILIES`: ``"dense"`` (the whole gradient every
        step), ``"compressed"`` (less than that, every step, the models kept equal) or
        ``"local"`` (the models differ between exchanges). Reports plot each family in
        its own panels beside the reference. Required, so that no algorithm lands in a
        family it does not belong to by default.
      two_tier: the builder takes ``(intra, inter)``; ``params`` has a ``group_size``.
      policy: the `shoal.experiments.runner.policies.Policy` that may change its
        hyper-parameters during a run.
      reference: the uncompressed baseline every other entry is compared with.
      compares_to: the algorithm whose rule this one runs uncompressed for its first
        ``warmup(params, run)`` steps (1-bit LAMB and LAMB), put side by side in reports.
      asynchronous: ``plan(params, run)``, an `shoal.experiments.asynchronous.Plan`: the
        algorithm's outer steps are asynchronous, simulated on the clock (simulated
        workers only); the builder gives each worker's inner optimizer.
      churn: it may run with config ``churn`` (workers leaving and joining): every
        exchange is an all-reduce whose token-weighted mean over the present workers is
        the algorithm's rule, and no formula of it counts the workers (BMUF's block
        momentum ``1 - 1/N`` does; the noise scale's batch sizes do).
      turns: with config ``in_turn`` its simulated workers take their local steps one
        after another (`shoal.optim.helpers.take_turns`): its params have a
        ``sync_every``, only every ``sync_every``-th step of its own count (steps skipped
        for a non-finite gradient not counted) exchanges, and the other steps' exchanges
        are left out in a turn (`shoal.comms.turns.leave_out`).
    """
    if not (isinstance(params, type) and issubclass(params, Hyper)):
        raise TypeError(f"register({name!r}): params must be a Hyper dataclass, got {params!r}")
    if skip_in_place not in _SKIP_MODES:
        raise ValueError(f"register({name!r}): skip_in_place must be one of {_SKIP_MODES}")
    if family not in FAMILIES:
        raise ValueError(f"register({name!r}): family must be one of {list(FAMILIES)}")
    if two_tier and "group_size" not in {f.name for f in dataclasses.fields(params)}:
        raise TypeError(f"register({name!r}): a two-tier algorithm's params need a group_size")
    params()  # every field has a default, and the defaults pass the checks

    def add(build: Builder) -> Builder:
        if name in ALGORITHMS:
            raise ValueError(f"algorithm {name!r} is already registered")
        ALGORITHMS[name] = Algorithm(
            name, params, build, skip_in_place, two_tier, policy, reference, compares_to,
            warmup, family, asynchronous, churn, turns,
        )  # fmt: skip
        return build

    return add


def algorithm(name: str) -> Algorithm:
    """The registered algorithm ``name``; `ConfigError` listing them all if there is none."""
    algo = ALGORITHMS.get(name)
    if algo is None:
        raise ConfigError(_unknown([name]))
    return algo


def _unknown(names: Sequence[str]) -> str:
    """The error for unregistered algorithm ``names``: an old name's new one
    (`shoal.experiments.algorithms.renamed`), else every registered name."""
    from shoal.experiments.algorithms.renamed import new_entry

    moved = [m for m in map(new_entry, names) if m]
    if moved:
        return "; ".join(moved)
    which = "algorithm" if len(names) == 1 else "algorithms"
    return (
        f"unknown {which} {', '.join(map(repr, names))}; "
        f"registered: {', '.join(sorted(ALGORITHMS))}"
    )


def params_of(name: str, value: Any, where: str = "params") -> Hyper:
    """``value`` as the hyper-parameters of algorithm ``name``: its `Hyper` dataclass as
    it is, or a mapping of its fields (nested parts may be mappings too)."""
    cls = algorithm(name).params
    if isinstance(value, Mapping):
        return from_mapping(cls, value, f"{where}.{name}")
    if type(value) is not cls:
        raise ConfigError(
            f"config field '{where}.{name}' must be a {cls.__module__}.{cls.__qualname__} "
            f"or a dict of its fields, got {type(value).__name__}"
        )
    return value


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
      label: the entry as written (``"gtc[threshold=0.01]"``): its name in records,
        reports and checkpoints.
      name: the registered algorithm's name (``"gtc"``).
      algorithm: its registration.
      cfg: the run's config.
      params: the hyper-parameters it trains with: ``cfg.params[name]`` (or the
        defaults) with the entry's bracketed overrides, checked.
    """

    label: str
    name: str
    algorithm: Algorithm
    cfg: Config
    params: Hyper

    @property
    def group_size(self) -> int | None:
        """Workers per group of a two-tier algorithm, else None."""
        return self.params.group_size if self.algorithm.two_tier else None

    @property
    def policy(self) -> Policy | None:
        """The policy that may change its hyper-parameters during the run, or None."""
        return self.algorithm.policy

    def warmup(self) -> int | None:
        """The steps it runs ``compares_to``'s rule uncompressed, or None."""
        warmup = self.algorithm.warmup
        return None if warmup is None else warmup(self.params, self.cfg)

    def changed(self, changes: Mapping[str, Any] | None = None) -> tuple[Config, Hyper]:
        """``(cfg, params)`` with ``changes`` on top: a policy's decisions (its own
        fields) or a projection's run fields (``workers``)."""
        if not changes:
            return self.cfg, self.params
        own = {f.name for f in dataclasses.fields(self.params)}
        mine = {k: v for k, v in changes.items() if k in own}
        rest = {k: v for k, v in changes.items() if k not in own}
        cfg = dataclasses.replace(self.cfg, **rest) if rest else self.cfg
        return cfg, dataclasses.replace(self.params, **mine) if mine else self.params

    def build(
        self,
        comms: Comms,
        *,
        task: Any = None,
        servers: Any = None,
        changes: Mapping[str, Any] | None = None,
    ) -> optax.GradientTransformation:
        """The transformation every worker runs: ``comms`` is the world collective, or
        ``(intra, inter)`` when `group_size` is not None; wrapped in
        `shoal.optim.skip_nonfinite` as ``cfg.nonfinite`` says (one check for the whole
        chain, so a skipped step moves no momentum either)."""
        cfg, params = self.changed(changes)
        tx = self.algorithm.build(params, Context(comms, cfg, task, servers))
        if cfg.nonfinite == "off":
            return tx
        in_place = self.algorithm.skip_in_place
        return skip_nonfinite(tx, collective=comms, nonfinite=cfg.nonfinite, in_place=in_place)


def resolve(entry: str | Entry, cfg: Config) -> Entry:
    """``entry`` (a ``Config.algorithms`` string) as an `Entry` of ``cfg``; an `Entry`
    is returned as it is. Raises `ConfigError` for an unknown algorithm, a bad override
    or settings the algorithm cannot run, naming the entry."""
    if isinstance(entry, Entry):
        return entry
    from shoal.experiments.overrides import apply_overrides

    name, overrides = parse_entry(entry)
    algo = algorithm(name)
    _check_bracket_keys(entry, name, overrides, algo, cfg)
    try:
        params = cfg.params.get(name) or algo.params()
        params = apply_overrides(params, overrides)
        params.check_run(cfg)
        resolved = Entry(entry, name, algo, cfg, params)
        # The transformation checks its own hyper-parameters when it is made: make it
        # once, on stand-in workers, so that a bad value stops the run before training.
        world = RecordingCollective(cfg.workers)
        gs = resolved.group_size
        resolved.build(world if gs is None else world.split(gs))
    except (ConfigError, ValueError, TypeError) as err:
        raise ConfigError(f"algorithm {entry!r}: {err}") from None
    return resolved


def _check_bracket_keys(
    entry: str, name: str, overrides: list[str], algo: Algorithm, cfg: Config
) -> None:
    """`ConfigError` for a bracketed key that is not the algorithm's: a field of the whole
    run (``ssgd[seed=1]`` would train seed 0 under a label that says 1), or a key in the
    old flat spelling (`shoal.experiments.algorithms.renamed`)."""
    from shoal.experiments.algorithms.renamed import new_spelling
    from shoal.experiments.overrides import parse_assignment

    own = {f.name for f in dataclasses.fields(algo.params)}
    run = {f.name for f in dataclasses.fields(cfg)}
    for item in overrides:
        key = parse_assignment(item)[0].split(".")[0]
        if key in own:
            continue
        if key in run:
            raise ConfigError(
                f"algorithm entry {entry!r}: {key!r} is a field of the whole run (its "
                f"steps, seed, workers, data or model), the same for every entry: set it "
                f"with --set {key}=..., or run another config; brackets take "
                f"{name}'s own hyper-parameters: {', '.join(sorted(own))}"
            )
        hint = new_spelling(key, name)
        if hint:
            raise ConfigError(f"algorithm entry {entry!r}: {hint}")


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
        raise ConfigError(_unknown(unknown))
    return tuple(resolve(e, cfg) for e in cfg.algorithms)


def check_params(params: Mapping[str, Any]) -> dict[str, Hyper]:
    """``Config.params`` checked: every key a registered algorithm, every value its
    hyper-parameters (`params_of`), made again so that their checks see the final values."""
    if not isinstance(params, Mapping):
        raise ConfigError(
            "config field 'params' must be a dict of algorithm name -> hyper-parameters, "
            f"got {type(params).__name__}"
        )
    return {name: rebuilt(params_of(name, value)) for name, value in params.items()}
