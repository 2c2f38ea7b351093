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
from harness import adamw

import shoal.optim as optim
from shoal.comms import AxisCollective

PARAMS = {"b": jnp.zeros((2,)), "w": jnp.zeros((3,))}
WRONG_SHAPE = {"b": jnp.zeros((2,)), "w": jnp.zeros((4,))}
MISSING_LEAF = {"w": jnp.zeros((3,))}

BUILDERS = {
    "allreduce_gradients": lambda c: optim.allreduce_gradients(collective=c),
    "bfb_allreduce": lambda c: optim.bfb_allreduce(collective=c, buffer_bytes=8),
    "bmuf": lambda c: optim.bmuf(optax.sgd(0.1), collective=c, block_size=2),
    "diloco": lambda c: optim.diloco(
        adamw(1e-3), collective=c, sync_every=2, outer=optax.sgd(0.7, momentum=0.9)
    ),
    "gradient_noise_scale": lambda c: optim.gradient_noise_scale(collective=c, local_batch_size=4),
    "gtc": lambda c: optim.gtc(0.1, collective=c, capacity=2),
    "onebit_adam": lambda c: optim.onebit_adam(1e-2, collective=c, freeze_step=1),
    "onebit_lamb": lambda c: optim.onebit_lamb(1e-2, collective=c, freeze_step=1),
    "partial_exchange": lambda c: optim.partial_exchange(1.0, collective=c),
    "peer_averaging": lambda c: optim.peer_averaging(optax.sgd(0.1), collective=c),
    "sma": lambda c: optim.sma(optax.sgd(0.1), collective=c),
    "skip_nonfinite": lambda c: optim.skip_nonfinite(optax.sgd(0.1), collective=c),
    "streaming_diloco": lambda c: optim.streaming_diloco(
        adamw(1e-3), collective=c, sync_every=2, outer=optax.sgd(0.7), num_fragments=2
    ),
    "topk": lambda c: optim.topk(0.5, collective=c),
    "powersgd": lambda c: optim.powersgd(1, collective=c),
    "demo": lambda c: optim.demo(collective=c, chunk_size=2, topk=1),
    "bmuf_gtc": lambda tiers: optim.bmuf_gtc(
        optax.sgd(0.1), intra=tiers[0], inter=tiers[1], block_size=2, threshold=0.1
    ),
}
STATE_TYPES = {
    "allreduce_gradients": optim.AllReduceState,
    "bfb_allreduce": optim.BFBState,
    "bmuf": optim.BMUFState,
    "bmuf_gtc": optim.BMUFState,
    "diloco": optim.DiLoCoState,
    "gradient_noise_scale": optim.NoiseScaleState,
    "gtc": optim.GTCState,
    "onebit_adam": optim.OneBitAdamState,
    "onebit_lamb": optim.OneBitLambState,
    "partial_exchange": optim.PartialExchangeState,
    "peer_averaging": optim.PeerAveragingState,
    "sma": optim.SMAState,
    "skip_nonfinite": optim.SkipNonFiniteState,
    "streaming_diloco": optim.StreamingDiLoCoState,
    "topk": optim.TopKState,
    "powersgd": optim.PowerSGDState,
    "demo": optim.DeMoState,
}


def test_every_transformation_is_covered():
    factories = {
        name
        for name in optim.__all__
        if callable(getattr(optim, name))
        and name.islower()
        and name
        not in (
            "noise_scale",
            "onebit_moments",
            "peer_permutation",
            "pgx_partition",
            "update_and_apply",
        )
    }
    assert factories == set(BUILDERS)


def trace_update(name, grads, make_state):
    """Trace one update on every simulated worker (shapes only: nothing runs)."""
    if name == "bmuf_gtc":
        intra, inter = AxisCollective("w", 4).split(2)
        tx = BUILDERS[name]((intra, inter))
        lead = (2, 2)
    else:
        tx = BUILDERS[name](AxisCollective("w", 2))
        lead = (2,)

    def worker(params, grads):
        return tx.update(grads, make_state(tx, params), params)

    fn = worker
    if name == "bmuf_gtc":
        fn = jax.vmap(jax.vmap(fn, axis_name="member"), axis_name="group")
    else:
        fn = jax.vmap(fn, axis_name="w")
    stack = lambda t: jax.tree.map(lambda x: jnp.zeros(lead + x.shape, x.dtype), t)
    return jax.eval_shape(fn, stack(PARAMS), stack(grads))


init_state = lambda tx, params: tx.init(params)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_matching_update_traces(name):
    trace_update(name, PARAMS, init_state)  # the control: no false alarm


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_wrong_leaf_shape_is_named(name):
    with pytest.raises(ValueError) as info:
        trace_update(name, WRONG_SHAPE, init_state)
    msg = str(info.value)
    assert msg.startswith(f"{name}: "), msg
    assert "['w']" in msg and "(4,)" in msg and "(3,)" in msg, msg


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_missing_leaf_is_named(name):
    with pytest.raises(ValueError, match=rf"^{name}: .*missing leaves \['b'\]"):
        trace_update(name, MISSING_LEAF, init_state)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_uninitialised_state_is_named(name):
    expected = STATE_TYPES[name].__name__
    with pytest.raises(TypeError, match=rf"^{name}: .*empty tuple.*expected a {expected}"):
        trace_update(name, PARAMS, lambda tx, params: ())


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_another_transformations_state_is_named(name):
    other = optax.sgd(0.1, momentum=0.9)
    expected = STATE_TYPES[name].__name__
    with pytest.raises(TypeError, match=rf"^{name}: .*expected a {expected}"):
        trace_update(name, PARAMS, lambda tx, params: other.init(params))
    # A shoal state of the wrong transformation is refused too.
    wrong = "sma" if name != "sma" else "bmuf"
    with pytest.raises(TypeError, match=re.escape(f"expected a {expected}")):
        trace_update(name, PARAMS, lambda tx, params: _state_of(wrong, params))


def _state_of(name, params):
    return BUILDERS[name](AxisCollective("w", 2)).init(params)
