"""Misuse of a transformation's update gets an error naming the transformation, the
leaf and what was expected vs got: a gradient tree that does not match the state (or
the params), and a state that was never initialised or belongs to another
transformation. The checks are static, so tracing (``jax.eval_shape``) suffices."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from contract_table import TABLE

from shoal.comms import AxisCollective

PARAMS = {"b": jnp.zeros((2,)), "w": jnp.zeros((3,))}
WRONG_SHAPE = {"b": jnp.zeros((2,)), "w": jnp.zeros((4,))}
MISSING_LEAF = {"w": jnp.zeros((3,))}


def trace_update(name, grads, make_state):
    """Trace one update on every simulated worker (shapes only: nothing runs)."""
    row = TABLE[name]
    if row.two_tier:
        tx = row.build(AxisCollective("w", 4).split(2))
        lead = (2, 2)
    else:
        tx = row.build(AxisCollective("w", 2))
        lead = (2,)

    def worker(params, grads):
        return tx.update(grads, make_state(tx, params), params)

    fn = worker
    if row.two_tier:
        fn = jax.vmap(jax.vmap(fn, axis_name="member"), axis_name="group")
    else:
        fn = jax.vmap(fn, axis_name="w")
    stack = lambda t: jax.tree.map(lambda x: jnp.zeros(lead + x.shape, x.dtype), t)
    return jax.eval_shape(fn, stack(PARAMS), stack(grads))


init_state = lambda tx, params: tx.init(params)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_matching_update_traces(name):
    trace_update(name, PARAMS, init_state)  # the control: no false alarm


@pytest.mark.parametrize("name", sorted(TABLE))
def test_wrong_leaf_shape_is_named(name):
    with pytest.raises(ValueError) as info:
        trace_update(name, WRONG_SHAPE, init_state)
    msg = str(info.value)
    assert msg.startswith(f"{name}: "), msg
    assert "['w']" in msg and "(4,)" in msg and "(3,)" in msg, msg


@pytest.mark.parametrize("name", sorted(TABLE))
def test_missing_leaf_is_named(name):
    with pytest.raises(ValueError, match=rf"^{name}: .*missing leaves \['b'\]"):
        trace_update(name, MISSING_LEAF, init_state)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_uninitialised_state_is_named(name):
    expected = TABLE[name].state.__name__
    with pytest.raises(TypeError, match=rf"^{name}: .*empty tuple.*expected a {expected}"):
        trace_update(name, PARAMS, lambda tx, params: ())


@pytest.mark.parametrize("name", sorted(TABLE))
def test_another_transformations_state_is_named(name):
    other = optax.sgd(0.1, momentum=0.9)
    expected = TABLE[name].state.__name__
    with pytest.raises(TypeError, match=rf"^{name}: .*expected a {expected}"):
        trace_update(name, PARAMS, lambda tx, params: other.init(params))
    # A shoal state of the wrong transformation is refused too.
    wrong = "sma" if name != "sma" else "bmuf"
    with pytest.raises(TypeError, match=re.escape(f"expected a {expected}")):
        trace_update(name, PARAMS, lambda tx, params: _state_of(wrong, params))


def _state_of(name, params):
    return TABLE[name].build(AxisCollective("w", 2)).init(params)
