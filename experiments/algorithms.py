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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from shoal.comms import Collective
from shoal.experiments.config import Config, ConfigError
from shoal.optim import allreduce_gradients

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


def check_known(names: tuple[str, ...]) -> None:
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown:
        raise ConfigError(
            f"unknown algorithm(s) {', '.join(map(repr, unknown))}; "
            f"registered: {', '.join(sorted(ALGORITHMS))}"
        )


def build(name: str, cfg: Config, collective: Any) -> optax.GradientTransformation:
    check_known((name,))
    return ALGORITHMS[name](cfg, collective)


def local_sgd(cfg: Config) -> optax.GradientTransformation:
    """The local optimizer every algorithm ends with: SGD with heavy-ball momentum."""
    return optax.sgd(cfg.learning_rate, momentum=cfg.momentum or None)


@register("ssgd")
def ssgd(cfg: Config, collective: Any) -> optax.GradientTransformation:
    """Synchronous SGD: all-reduce (mean) the gradients every step, then `local_sgd`."""
    return optax.chain(allreduce_gradients(collective=collective), local_sgd(cfg))
