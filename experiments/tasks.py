"""The benchmark tasks: `make_task` picks one by ``Config.task``; the default is an MLP
classifier on a synthetic Gaussian mixture.

A task holds its data, model and loss, with this interface (used by the runner)::

    init_params()             one worker's initial parameters (seeded by cfg.seed)
    loss(params, x, y)        the training loss of one worker's batch (jit-able)
    batch(step, workers)      (x, y) of a 0-based step, leading axis over the workers
    evaluate(params)          (test loss, test accuracy) of one set of parameters

The data is generated from the config's seed with NumPy, so every worker, rank and
backend sees the same points and the same batch order; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from shoal.experiments.acoustic import HMMFrameTask
from shoal.experiments.batches import EpochBatches
from shoal.experiments.config import Config
from shoal.experiments.lm import ByteLMTask


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


class GaussianMixtureTask:
    """Data, model, loss and batch schedule of one experiment (``task="mixture"``).

    ``batch(step, workers)`` is the global batch of a step split into one block of
    ``batch_size`` rows per worker: worker ``r`` trains on block ``r`` (`EpochBatches`).
    """

    error_name = "test error"

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.data = gaussian_mixture(
            num_classes=cfg.num_classes,
            num_features=cfg.num_features,
            components=cfg.components,
            train_size=cfg.train_size,
            test_size=cfg.test_size,
            class_sep=cfg.class_sep,
            seed=cfg.seed,
        )
        self.model = MLP(hidden=cfg.hidden, num_classes=cfg.num_classes)
        self._batches = EpochBatches(cfg.train_size, cfg.batch_size, cfg.seed)
        self._eval = jax.jit(self._metrics)

    @functools.cached_property
    def _init(self):
        x = jnp.zeros((1, self.cfg.num_features), jnp.float32)
        # Jitted: flax's eager init dispatches op by op and takes seconds on CPU.
        return jax.jit(self.model.init)(jax.random.key(self.cfg.seed), x)["params"]

    def init_params(self):
        """The initial parameters of one worker (seeded by ``cfg.seed``)."""
        return self._init

    def loss(self, params, x, y) -> jax.Array:
        """Mean softmax cross-entropy of the batch."""
        logits = self.model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def _metrics(self, params, x, y):
        logits = self.model.apply({"params": params}, x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, jnp.mean(jnp.argmax(logits, -1) == y)

    def evaluate(self, params) -> tuple[float, float]:
        """``(test loss, test accuracy)`` of one set of parameters."""
        loss, acc = self._eval(params, self.data.x_test, self.data.y_test)
        return float(loss), float(acc)

    def batch(self, step: int, workers: int) -> tuple[np.ndarray, np.ndarray]:
        """``(x [workers, batch_size, features], y [workers, batch_size])`` of 0-based ``step``."""
        idx = self._batches.indices(step, workers)
        return self.data.x_train[idx], self.data.y_train[idx]


TASKS = {"mixture": GaussianMixtureTask, "hmm": HMMFrameTask, "lm": ByteLMTask}


def make_task(cfg: Config):
    """The task ``cfg.task`` names, built from ``cfg``."""
    return TASKS[cfg.task](cfg)
