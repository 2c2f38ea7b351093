"""The parabola of optax's contract test (optax/contrib/_common_test.py), shared by the
tests that check a transformation reaches its minimum: ``scale * |p - TARGET|^2`` from
``START`` on every worker, or from a different start per worker (`different_starts`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

TARGET = jnp.array([1.0, -1.0, 1.0])
# optax's start is [-1, 10, 1]: its last coordinate starts at the optimum, where the
# gradient is exactly 0 forever. 1-bit Adam/LAMB freeze that variance at 0 and then divide
# the +-scale compressed momentum by eps (see their `momentum_mask`).
START = jnp.array([-1.0, 10.0, 3.0])


def parabola_grad(scale=1.0):
    """The gradient of ``scale * sum((p - TARGET) ** 2)``."""
    return jax.grad(lambda p: scale * jnp.sum((p - TARGET) ** 2))


def descend(tx, params, steps, scale=1.0, tree_map_params=True):
    """``steps`` updates of ``tx`` on the parabola from ``params``; the final params. The
    state is initialised through ``optax.tree_utils.tree_map_params``, as optax's test
    does, unless ``tree_map_params`` is False."""
    grad = parabola_grad(scale)

    def body(carry, _):
        p, s = carry
        u, s = tx.update(grad(p), s, p)
        return (optax.apply_updates(p, u), s), None

    state = tx.init(params)
    if tree_map_params:
        state = optax.tree_utils.tree_map_params(tx, lambda v: v, state)
    return lax.scan(body, (params, state), None, length=steps)[0][0]


def on_workers(fn, *args, n, axis_name="workers"):
    """``fn`` on ``n`` simulated workers (vmap over ``axis_name``) that all hold ``args``."""
    stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), args)
    return jax.vmap(fn, axis_name=axis_name)(*stacked)


def different_starts(n, seed=7):
    """A different float32 start per worker, ``[n, 3]``."""
    return jnp.asarray(np.random.default_rng(seed).normal(size=(n, 3)) * 5, jnp.float32)
