"""The benchmark tasks: `make_task` picks one by ``Config.task``; the default is an MLP
classifier on a synthetic Gaussian mixture.

A task holds its data, model and loss, with the interface of
`shoal.experiments.tasks.classifier.ClassifierTask`.

The data is generated from the config's seed with NumPy, so every worker, rank and
backend sees the same points and the same batch order; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from shoal.experiments.config import Config
from shoal.experiments.tasks.acoustic import HMMFrameTask
from shoal.experiments.tasks.classifier import ClassifierTask
from shoal.experiments.tasks.images import ImageTask
from shoal.experiments.tasks.lm import ByteLMTask


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
            seed=cfg.seed,
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


TASKS = {
    "mixture": GaussianMixtureTask,
    "hmm": HMMFrameTask,
    "lm": ByteLMTask,
    "images": ImageTask,
}


def make_task(cfg: Config):
    """The task ``cfg.task`` names, built from ``cfg``."""
    return TASKS[cfg.task](cfg)
