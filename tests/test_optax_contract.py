"""Optax's contract for shoal's transformations (after optax/contrib/_common_test.py), one
case per row of the contract table (tests/contract_table.py): they optimise a parabola,
survive inject_hyperparams, and tree_map_params; and the contract every shoal
transformation shares: a collective is a Collective (never a callable), and an update that
reads the model refuses a missing params by name."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from contract_table import TABLE, rows, with_case
from parabola_cases import START, TARGET, descend, on_workers

from shoal.comms import AxisCollective

N = 4
COLL = AxisCollective("workers", N)


def make(name):
    row = TABLE[name]
    tx = row.factory(collective=COLL, **row.parabola.kwargs)
    return tx if row.parabola.then is None else optax.chain(tx, row.parabola.then)


@pytest.mark.parametrize("name", with_case("parabola"))
def test_optimises_parabola(name):
    tx, case = make(name), TABLE[name].parabola
    run = jax.jit(lambda p: descend(tx, p, 1500, case.scale, case.tree_map_params))
    p = on_workers(run, START, n=N)
    np.testing.assert_allclose(p, np.broadcast_to(TARGET, (N, 3)), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("name", with_case("inject"))
def test_can_be_wrapped_in_inject_hyperparams(name):
    row = TABLE[name]
    kwargs, static = row.inject.kwargs, row.inject.static
    params = [-jnp.ones((2, 3)), jnp.ones((2, 5, 2))]
    grads = [jnp.ones((2, 3)), -jnp.ones((2, 5, 2)) * 0.5]
    plain = row.factory(collective=COLL, **kwargs)
    injected = optax.inject_hyperparams(row.factory, static_args=static)(collective=COLL, **kwargs)

    def step(tx, g, p):
        state = tx.init(p)
        return tx.update(g, state, p)

    on = lambda tx: jax.jit(lambda g, p: on_workers(lambda g, p: step(tx, g, p), g, p, n=N))
    u, s = on(plain)(grads, params)
    ui, si = on(injected)(grads, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4), u, ui)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4), s, si.inner_state)


def build(name, collective):
    """The row's transformation on ``collective``: a two-tier row gets it as both tiers."""
    row = TABLE[name]
    return row.build((collective, collective) if row.two_tier else collective)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_collective_must_be_a_collective_not_a_callable(name):
    # optax.inject_hyperparams would call a callable argument as a schedule.
    with pytest.raises(TypeError, match="shoal Collective object, not a callable"):
        build(name, lambda x: x)
    with pytest.raises(TypeError, match=r"must be a shoal Collective \(missing \.size.*got str"):
        build(name, "workers")


@pytest.mark.parametrize("name", rows(needs_params=True))
def test_params_are_required(name):
    # Refused at trace time, before any collective runs. Two leaves: streaming DiLoCo's
    # row makes two fragments.
    params = {"b": jnp.zeros((2, 2)), "w": jnp.zeros((2, 3))}
    if TABLE[name].two_tier:  # groups of one, two groups
        tx = TABLE[name].build((AxisCollective("member", 1), AxisCollective("workers", 2)))
    else:
        tx = TABLE[name].build(AxisCollective("workers", 2))
    state = jax.vmap(tx.init)(params)
    update = jax.vmap(lambda g, s: tx.update(g, s), axis_name="workers")
    with pytest.raises(ValueError, match=f"^{name} needs params: call update"):
        update(params, state)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(TABLE))
def test_low_precision_model_under_strict_promotion(name, dtype):
    # The session's dtype promotion is strict (tests/conftest.py): a half-precision model
    # traces through init and two updates with every mix of dtypes cast explicitly (a
    # schedule's float32, float32 accumulators and error feedback), and the updates keep
    # the model's dtype.
    assert jax.config.jax_numpy_dtype_promotion == "strict"
    row = TABLE[name]
    if row.two_tier:
        tx, lead = row.build(AxisCollective("w", 4).split(2)), (2, 2)
        on = lambda fn: jax.vmap(jax.vmap(fn, axis_name="member"), axis_name="group")
    else:
        tx, lead = row.build(AxisCollective("w", 2)), (2,)
        on = lambda fn: jax.vmap(fn, axis_name="w")
    params = {"b": jnp.zeros(lead + (2,), dtype), "w": jnp.zeros(lead + (3, 4), dtype)}

    def worker(p, g):
        state = tx.init(p)
        u, state = tx.update(g, state, p)
        return tx.update(g, state, optax.apply_updates(p, u))

    updates, _ = jax.eval_shape(on(worker), params, params)
    assert all(u.dtype == jnp.dtype(dtype) for u in jax.tree.leaves(updates))
