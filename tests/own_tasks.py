"""Tasks of a user's own module, for ``--task own_tasks:FACTORY`` (tests/test_own_task.py):
a least-squares line that every runner feature must train, and tasks that break the
`shoal.experiments.tasks.Task` contract in one way each."""

import jax.numpy as jnp
import numpy as np


class Line:
    """Fit ``y = 2 x`` with one weight: the loss after a step of SGD is known."""

    error_name = "misfit"

    def __init__(self, cfg):
        self.cfg = cfg

    def init_params(self):
        return {"w": jnp.zeros((3,), jnp.float32)}

    def loss(self, params, x, y):
        return jnp.mean((x @ params["w"] - y) ** 2)

    def batch(self, step, workers):
        rng = np.random.default_rng([self.cfg.seed, step])
        x = rng.normal(size=(workers, self.cfg.batch_size, 3)).astype(np.float32)
        return x, x.sum(-1) * 2

    def evaluate(self, params):
        err = float(jnp.sum((params["w"] - 2.0) ** 2))
        return {"loss": err, "accuracy": float(err < 0.01), "distance": err**0.5}


def line(cfg):
    return Line(cfg)


class _NoWorkerAxis(Line):
    def batch(self, step, workers):
        x, y = super().batch(step, workers)
        return x[0], y[0]


def no_worker_axis(cfg):
    return _NoWorkerAxis(cfg)


class _IntegerParams(Line):
    def init_params(self):
        return {"w": jnp.zeros((3,), jnp.int32)}


def integer_params(cfg):
    return _IntegerParams(cfg)


def not_a_task(cfg):
    return object()
