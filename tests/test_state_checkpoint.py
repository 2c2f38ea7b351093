"""A checkpoint of any shoal transformation's state resumes it exactly, one case per row
of the contract table (tests/contract_table.py): after some updates the state has the
structure, shapes and dtypes of a freshly initialised one (so a checkpoint restores into
``init``'s structure, as orbax does with a target), every leaf is an array that a host
copy keeps (no weak type to lose, no Python object), and the update after a round trip
through host copies is the update without it, bit for bit. The runner's checkpoint of a
whole run is tests/test_checkpoint.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from contract_table import TABLE

from shoal.comms import AxisCollective

LEAVES = {"b": (2,), "w": (3, 4)}
STEPS = 3  # updates before the checkpoint (1-bit Adam/LAMB past their freeze step)


def setup(name):
    """The row's transformation, and how to run a per-worker function on all workers."""
    row = TABLE[name]
    if row.two_tier:  # two groups of two
        tx = row.build(AxisCollective("w", 4).split(2))
        lead = (2, 2)
        on = lambda fn: jax.vmap(jax.vmap(fn, axis_name="member"), axis_name="group")
    else:
        tx = row.build(AxisCollective("w", 2))
        lead = (2,)
        on = lambda fn: jax.vmap(fn, axis_name="w")
    return tx, lead, on


def avals(tree):
    return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x), _weak(x)), tree)


def _weak(x):
    return bool(getattr(x, "weak_type", False))


@pytest.mark.parametrize("name", sorted(TABLE))
def test_state_resumes_from_host_copies(name):
    tx, lead, on = setup(name)
    rng = np.random.default_rng(3)
    stack = lambda shape, scale: (scale * rng.normal(size=lead + shape)).astype(np.float32)
    p0 = {k: stack(s, 1.0) for k, s in LEAVES.items()}
    grads = [{k: stack(s, 0.1) for k, s in LEAVES.items()} for _ in range(STEPS + 1)]

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, u

    step = jax.jit(on(step))
    init = jax.jit(on(tx.init))
    p, state = p0, init(p0)
    fresh = jax.eval_shape(on(tx.init), p0)
    for g in grads[:STEPS]:
        p, state, _ = step(p, state, g)

    assert isinstance(state, TABLE[name].state)
    # init's structure, shapes and dtypes, and no weak type (a host copy would drop it).
    assert jax.tree.structure(state) == jax.tree.structure(fresh)
    assert avals(state) == avals(fresh)
    assert not any(_weak(x) for x in jax.tree.leaves(state)), avals(state)
    leaves = jax.tree.leaves(state)
    assert leaves and all(isinstance(x, jax.Array) for x in leaves)

    # The checkpoint: host copies, restored into the fresh state's structure.
    host = [np.asarray(x) for x in leaves]
    restored = jax.tree.unflatten(jax.tree.structure(fresh), host)
    want = step(p, state, grads[STEPS])
    got = step(jax.tree.map(np.asarray, p), restored, grads[STEPS])
    jax.tree.map(np.testing.assert_array_equal, got, want)
