"""An integer gradient is a bug upstream: every transformation in shoal.optim refuses it
with a ValueError naming the transformation and the leaf, instead of returning an
integer update (a mean of 3.5 as 3). The checks are static: they fire while tracing,
before any collective runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_table import TABLE

from shoal.comms import (
    AxisCollective,
    Float32,
    OneBit,
    Quantized,
    TopK,
)

PARAMS = {"b": jnp.zeros((2,)), "w": jnp.zeros((3,))}
FLOAT_GRADS = {"b": jnp.ones((2,)), "w": jnp.ones((3,))}
INT_GRADS = {"b": jnp.ones((2,)), "w": jnp.array([3, 4, -1], jnp.int32)}


def build(name):
    """The transformation on 2 simulated workers, and its workers' leading dimensions."""
    row = TABLE[name]
    if row.two_tier:  # groups of one, two groups
        return row.build((AxisCollective("member", 1), AxisCollective("w", 2))), (2, 1)
    return row.build(AxisCollective("w", 2)), (2,)


def run_update(name, grads, apply=False):
    """One update (or ``apply_step``) on every simulated worker, from ``init(PARAMS)``."""
    tx, lead = build(name)

    def worker(params, grads):
        state = tx.init(params)
        if apply:
            return tx.apply_step(grads, state, params)
        return tx.update(grads, state, params)

    fn = jax.vmap(worker, axis_name="w")
    if TABLE[name].two_tier:
        fn = jax.vmap(jax.vmap(worker, axis_name="member"), axis_name="w")
    stack = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, lead + x.shape), t)
    return fn(stack(PARAMS), stack(grads))


@pytest.mark.parametrize("name", sorted(TABLE))
def test_integer_gradient_is_refused_by_name(name):
    jax.eval_shape(lambda g: run_update(name, g), FLOAT_GRADS)  # the control
    with pytest.raises(
        ValueError,
        match=rf"^{name}: updates must be floating point; "
        r"leaf \['w'\] has dtype int32",
    ):
        run_update(name, INT_GRADS)
    if getattr(build(name)[0], "apply_step", None) is not None:  # update_and_apply's path
        with pytest.raises(ValueError, match=rf"^{name}: .*leaf \['w'\] has dtype int32"):
            run_update(name, INT_GRADS, apply=True)


@pytest.mark.parametrize(
    "call",
    [
        lambda x, c: Quantized("int8", block=2, error_feedback=False).mean(x, collective=c),
        lambda x, c: Quantized("fp4", block=2).mean(
            x, Quantized("fp4", block=2).init(4, 2), collective=c
        ),
        lambda x, c: OneBit().mean(x, OneBit().init(4, 2), collective=c),
        lambda x, c: TopK(fraction=0.5).mean(x, TopK(fraction=0.5).init(4, 2), collective=c),
        lambda x, c: Float32().mean(x, collective=c),
    ],
    ids=["Quantized_int8_no_feedback", "Quantized", "OneBit", "TopK", "Float32"],
)
def test_comms_exchanges_refuse_integer_vectors(call):
    # The flat-vector exchanges take float32 only (a TypeError naming x and the dtype).
    coll = AxisCollective("w", 2)
    x = np.arange(8, dtype=np.int32).reshape(2, 4)
    with pytest.raises(TypeError, match="x must be float32, got dtype int32"):
        jax.vmap(lambda v: call(v, coll), axis_name="w")(x)
