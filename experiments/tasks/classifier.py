"""What every bundled task shares: a Flax model trained with softmax cross-entropy on
integer labels, seeded initialisation, and an epoch batch schedule split over workers."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax

from shoal.experiments.config import Config
from shoal.experiments.tasks.batches import EpochBatches


class ClassifierTask:
    """Base of the tasks: subclasses build ``self.x_train, self.y_train, self.x_test,
    self.y_test`` (or override `batch`/`test_data`) and call ``super().__init__``.

    Interface used by the runner::

        init_params()             one worker's initial parameters (seeded by cfg.seed)
        loss(params, x, y)        the training loss of one worker's batch (jit-able)
        batch(step, workers)      (x, y) of a 0-based step, leading axis over the workers
        evaluate(params)          (test loss, test accuracy) of one set of parameters
    """

    error_name = "test error"

    def __init__(self, cfg: Config, model: nn.Module, example_input: Any):
        self.cfg = cfg
        self.model = model
        self._example = example_input
        # cfg.validation_size rows of the training set held out (the last ones: the rows
        # are drawn at random, so any fixed block is a random sample), evaluated in place
        # of the test set.
        self.validation = self.hold_out(cfg.validation_size) if cfg.validation_size else None
        # Worker r trains on block r of each global batch of workers * batch_size rows.
        rows = cfg.train_size - cfg.validation_size
        self._batches = EpochBatches(rows, cfg.batch_size, cfg.seed)
        self._eval = jax.jit(self._metrics)

    @functools.cached_property
    def _init(self):
        # Jitted: flax's eager init dispatches op by op and takes seconds on CPU.
        return jax.jit(self.model.init)(jax.random.key(self.cfg.seed), self._example)["params"]

    def init_params(self):
        """The initial parameters of one worker (seeded by ``cfg.seed``)."""
        return self._init

    def _metrics(self, params, x, y):
        logits = self.model.apply({"params": params}, x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, (logits.argmax(-1) == y).mean()

    def loss(self, params, x, y) -> jax.Array:
        """Mean softmax cross-entropy over every label of the batch."""
        return self._metrics(params, x, y)[0]

    def hold_out(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Remove the last ``rows`` rows from the training set; returns them as ``(x, y)``."""
        x, y = self.x_train[-rows:], self.y_train[-rows:]
        self.x_train, self.y_train = self.x_train[:-rows], self.y_train[:-rows]
        return x, y

    def test_data(self) -> tuple[np.ndarray, np.ndarray]:
        return self.x_test, self.y_test

    def evaluate(self, params) -> tuple[float, float]:
        """``(test loss, test accuracy)`` of one set of parameters; with
        ``validation_size`` rows held out, those of the validation split instead."""
        data = self.validation if self.validation is not None else self.test_data()
        loss, acc = self._eval(params, *data)
        return float(loss), float(acc)

    def batch(self, step: int, workers: int) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)`` of 0-based ``step``, each with leading axes ``[workers, batch_size]``."""
        idx = self._batches.indices(step, workers)
        return self.x_train[idx], self.y_train[idx]
