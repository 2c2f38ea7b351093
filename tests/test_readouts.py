"""The per-step figures a training loop reads (`shoal.optim.readouts`): one table of
readouts, and GTC's density the same on a state stacked over workers as inside vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shoal.comms import AxisCollective
from shoal.optim import gtc, readouts

N = 4


def test_density_of_a_stacked_state_is_the_workers_not_divided_by_them():
    # 64 elements per worker; threshold 1 with values 0, 2, 0, 2, ... sends half of them.
    tx = optax.chain(gtc(1.0, collective=AxisCollective("w", N), capacity=1.0), optax.sgd(0.1))
    params = jnp.zeros((N, 64))
    grads = jnp.tile(jnp.array([0.0, 2.0] * 32), (N, 1))
    step = jax.vmap(lambda g, s, p: tx.update(g, s, p), axis_name="w")
    _, state = step(grads, jax.vmap(tx.init)(params), params)
    inside = jax.vmap(lambda s: readouts.step_figures(s)["density"])(state)
    outside = readouts.step_figures(state)["density"]  # the docstring's "stacked" case
    np.testing.assert_allclose(np.asarray(inside), 0.5)
    np.testing.assert_allclose(np.asarray(outside), 0.5)  # was 0.125: 0.5 / N


def test_every_readout_is_in_the_table_once():
    names = [r.name for r in readouts.READOUTS]
    assert names == ["density", "noise_scale", "skipped"]
    assert all(r.by_device in ("mean", "first") for r in readouts.READOUTS)
    assert all(r.over_workers in ("mean", "max") for r in readouts.READOUTS)
    # A state without any of them has no figures.
    assert readouts.step_figures(optax.sgd(0.1).init(jnp.zeros(3))) == {}
