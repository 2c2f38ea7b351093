"""The tasks: `make_task` builds the one ``Config.task`` names (`task_factory`): a
bundled one (`register_task`; the default is an MLP classifier on a synthetic Gaussian
mixture), or your own as ``module.path:factory`` or ``path/to/file.py:factory``.

A task holds its data, model and loss, with the interface of
`shoal.experiments.tasks.protocol.Task`.

The data is generated from the config's seed with NumPy, so every worker, rank and
backend sees the same points and the same batch order; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from shoal.experiments.config import Config, ConfigError
from shoal.experiments.overrides import load_module
from shoal.experiments.tasks.acoustic import HMMFrameTask
from shoal.experiments.tasks.classifier import ClassifierTask
from shoal.experiments.tasks.images import ImageTask
from shoal.experiments.tasks.lm import ByteLMTask
from shoal.experiments.tasks.protocol import Task, check_task
from shoal.experiments.tasks.text import TextTask

__all__ = ["Task", "check_task", "make_task", "register_task", "registered_tasks", "task_factory"]


@dataclasses.dataclass(frozen=True)
class Dataset:
    x_train: np.ndarray  # [train_size, num_features] float32
    y_train: np.ndarray  # [train_size] int32
    x_test: np.ndarray
    y_test: np.ndarray


def gaussian_mixture(
    *,
    num_classes: int,
    num_features: int,
    components: int,
    train_size: int,
    test_size: int,
    class_sep: float,
    seed: int,
) -> Dataset:
    """Each class is an equal mixture of ``components`` isotropic unit Gaussians whose means
    are drawn from ``N(0, class_sep^2 I)``; labels are uniform. With more than one
    component per class the Bayes decision boundary is not linear, so the hidden layers
    matter. Train and test come from the same distribution."""
    rng = np.random.default_rng([seed, 0])
    means = rng.normal(scale=class_sep, size=(num_classes, components, num_features))

    def draw(n):
        y = rng.integers(num_classes, size=n)
        k = rng.integers(components, size=n)
        x = means[y, k] + rng.normal(size=(n, num_features))
        return x.astype(np.float32), y.astype(np.int32)

    x_train, y_train = draw(train_size)
    x_test, y_test = draw(test_size)
    return Dataset(x_train, y_train, x_test, y_test)


class MLP(nn.Module):
    """ReLU hidden layers, then ``num_classes`` logits."""

    hidden: tuple[int, ...]
    num_classes: int

    @nn.compact
    def __call__(self, x):
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)


class GaussianMixtureTask(ClassifierTask):
    """An MLP on a Gaussian mixture (``task="mixture"``)."""

    def __init__(self, cfg: Config):
        data = gaussian_mixture(
            num_classes=cfg.num_classes,
            num_features=cfg.num_features,
            components=cfg.components,
            train_size=cfg.train_size,
            test_size=cfg.test_size,
            class_sep=cfg.class_sep,
            seed=cfg.seed_of_data,
        )
        self.data = data
        self.x_train, self.y_train, self.x_test, self.y_test = (
            data.x_train,
            data.y_train,
            data.x_test,
            data.y_test,
        )
        model = MLP(hidden=cfg.hidden, num_classes=cfg.num_classes)
        super().__init__(cfg, model, jnp.zeros((1, cfg.num_features), jnp.float32))


_REGISTRY: dict[str, Callable[[Config], Task]] = {}


def register_task(name: str, factory: Callable[[Config], Task]) -> None:
    """Make ``factory`` (the config -> a `Task`) the task ``--set task=name`` trains on.

    Example:
      >>> from shoal.experiments.tasks import register_task, registered_tasks
      >>> "mixture" in registered_tasks()
      True
    """
    if not name.isidentifier():
        raise ValueError(f"a task name must be an identifier, got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"task {name!r} is registered already")
    _REGISTRY[name] = factory


def registered_tasks() -> list[str]:
    """The names `register_task` knows, in registration order."""
    return list(_REGISTRY)


register_task("mixture", GaussianMixtureTask)
register_task("hmm", HMMFrameTask)
register_task("lm", ByteLMTask)
register_task("images", ImageTask)
register_task("text", TextTask)


def task_factory(spec: str) -> Callable[[Config], Task]:
    """The factory of the task ``spec``: a registered name, ``module.path:factory`` (an
    importable module) or ``path/to/file.py:factory``. `ConfigError` naming ``spec``
    when there is no such factory."""
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    where, colon, name = spec.rpartition(":")
    how = (
        f"task {spec!r}: give a bundled task ({', '.join(_REGISTRY)}), "
        "module.path:factory or path/to/file.py:factory"
    )
    if not (colon and where and name.isidentifier()):
        raise ConfigError(how)
    if where.endswith(".py"):
        if not Path(where).is_file():
            raise ConfigError(f"task {spec!r}: no file {where}")
        module = load_module(where)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name is None or not where.startswith(e.name):
                raise  # the module itself imports something missing: its own error
            raise ConfigError(f"task {spec!r}: no module {where} ({e})") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ConfigError(f"task {spec!r}: {where} defines no callable {name}")
    return factory


def make_task(cfg: Config) -> Task:
    """The task ``cfg.task`` names (`task_factory`), built from ``cfg``."""
    return task_factory(cfg.task)(cfg)
