"""Registry of the algorithms a config can name.

A builder maps ``(cfg, collective)`` to the optax transformation that every worker
runs on its own gradients; the runner applies the updates. To add an algorithm::

    @register("gtc")
    def gtc(cfg, collective):
        return optax.chain(
            shoal.optim.gtc(cfg.gtc_threshold, collective=collective), local_sgd(cfg)
        )

and give `Config` (or the config file's subclass of it) typed fields for its
hyper-parameters, so that ``--set gtc_threshold=0.01`` works.

An entry of ``Config.algorithms`` may carry its own overrides in brackets, separated
by ``;``: ``"gtc[gtc_threshold=0.01;gtc_capacity=0.05]"`` trains ``gtc`` with those
fields changed (sweeps list several such entries; the label is the whole entry).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from shoal.comms import Collective
from shoal.experiments.config import Config, ConfigError
from shoal.optim import allreduce_gradients, gtc

Builder = Callable[[Config, Collective], optax.GradientTransformation]

ALGORITHMS: dict[str, Builder] = {}


def register(name: str) -> Callable[[Builder], Builder]:
    """Decorator: make ``builder`` available to configs as ``name``."""

    def add(builder: Builder) -> Builder:
        if name in ALGORITHMS:
            raise ValueError(f"algorithm {name!r} is already registered")
        ALGORITHMS[name] = builder
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


def check_known(entries: tuple[str, ...], cfg: Config | None = None) -> None:
    """Every entry names a registered algorithm (and, given ``cfg``, its overrides apply)."""
    names = [parse_entry(e)[0] for e in entries]
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown:
        raise ConfigError(
            f"unknown algorithm(s) {', '.join(map(repr, unknown))}; "
            f"registered: {', '.join(sorted(ALGORITHMS))}"
        )
    if cfg is not None:
        for e in entries:
            entry_config(e, cfg)


def entry_config(entry: str, cfg: Config) -> Config:
    """The config ``entry`` trains with: ``cfg`` plus the entry's bracketed overrides."""
    from shoal.experiments.config import apply_overrides

    return apply_overrides(cfg, parse_entry(entry)[1])


def build(entry: str, cfg: Config, collective: Any) -> optax.GradientTransformation:
    check_known((entry,))
    return ALGORITHMS[parse_entry(entry)[0]](entry_config(entry, cfg), collective)


def local_sgd(cfg: Config) -> optax.GradientTransformation:
    """The local optimizer every algorithm ends with: SGD with heavy-ball momentum."""
    return optax.sgd(cfg.learning_rate, momentum=cfg.momentum or None)


@register("ssgd")
def ssgd(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """Synchronous SGD: all-reduce (mean) the gradients every step, then `local_sgd`."""
    return optax.chain(allreduce_gradients(collective=collective), local_sgd(cfg))


@register("gtc")
def gtc_sgd(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """Strom's threshold compression of the gradients (`shoal.optim.gtc`), then `local_sgd`."""
    return optax.chain(
        gtc(cfg.gtc_threshold, collective=collective, capacity=cfg.gtc_capacity), local_sgd(cfg)
    )
