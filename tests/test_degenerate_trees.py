"""Degenerate gradient trees: a zero-size leaf has nothing to send, and a tree without
values sends nothing. Every compressing transformation gives a zero-size leaf an empty
update of its shape and the other leaves exactly what it gives the tree without that
leaf, for the same bytes; an empty tree (or one of zero-size leaves only) gets its own
structure back and moves no byte."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shoal.optim as optim
from shoal.comms import AxisCollective, Quantized, TopK, wire_bytes

N, STEPS = 2, 3
COLL = AxisCollective("w", N)
OUTER = dict(collective=COLL, sync_every=1, outer=optax.sgd(1.0))

# name -> builder(full): ``full`` says whether the tree holds the zero-size leaves (only
# streaming DiLoCo's fragments differ: with them, one fragment holds a zero-size leaf only;
# on the zero-size leaves alone, every fragment does).
BUILDERS = {
    "gtc": lambda full: optim.gtc(0.1, collective=COLL, capacity=4),
    "topk": lambda full: optim.topk(0.5, collective=COLL),
    "topk_chunked": lambda full: optim.topk(0.5, collective=COLL, chunk_size=4, value_bits=4),
    "powersgd": lambda full: optim.powersgd(1, collective=COLL, min_compression=1.0),
    "demo": lambda full: optim.demo(collective=COLL, chunk_size=2, topk=1),
    "diloco_int8": lambda full: optim.diloco(
        optax.sgd(0.1), exchange=Quantized("int8", block=4), **OUTER
    ),
    "diloco_topk": lambda full: optim.diloco(optax.sgd(0.1), exchange=TopK(fraction=0.5), **OUTER),
    "streaming_diloco": lambda full: optim.streaming_diloco(
        optax.sgd(0.1), num_fragments=1, exchange=Quantized("fp4", block=4), **OUTER
    ),
    # With the zero-size leaves the fragments are (a), (e), (f, z): one holds no value.
    "streaming_diloco_empty_fragment": lambda full: optim.streaming_diloco(
        optax.sgd(0.1), num_fragments=3 if full else 2, exchange=TopK(fraction=0.5), **OUTER
    ),
    "bfb_allreduce": lambda full: optim.bfb_allreduce(collective=COLL, buffer_bytes=8),
    "partial_exchange": lambda full: optim.partial_exchange(1.0, collective=COLL),
    "onebit_adam": lambda full: optim.onebit_adam(0.01, collective=COLL, freeze_step=1),
    "onebit_lamb": lambda full: optim.onebit_lamb(0.01, collective=COLL, freeze_step=1),
}

rng = np.random.default_rng(0)
GRADS = {
    "a": rng.normal(size=(N, 3, 4)).astype(np.float32),
    "e": np.zeros((N, 0), np.float32),
    "f": np.zeros((N, 3, 0), np.float32),
    "z": rng.normal(size=(N, 5)).astype(np.float32),
}
WITHOUT_EMPTY = {k: GRADS[k] for k in ("a", "z")}


def run(tx, grads):
    """``STEPS`` updates on every worker (gradients scaled by the step, params at zero):
    the updates, each step's wire bytes ``[STEPS, 2, N]`` (sent, received) and the
    total ``[2, N]``."""

    def worker(g):
        params = jax.tree.map(jnp.zeros_like, g)
        state, updates, steps = tx.init(params), [], []
        for i in range(STEPS):
            u, state = tx.update(jax.tree.map(lambda x, i=i: x * (i + 1.0), g), state, params)
            w = wire_bytes(state, "step")
            updates.append(u)
            steps.append((w.sent, w.received))
        total = wire_bytes(state, "total")
        return updates, steps, (total.sent, total.received)

    updates, steps, total = jax.jit(jax.vmap(worker, axis_name="w", axis_size=N))(grads)
    return updates, np.asarray(steps, np.int64), np.asarray(total, np.int64)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_zero_size_leaf_beside_others(name):
    updates, steps, total = run(BUILDERS[name](True), GRADS)
    expected, expected_steps, expected_total = run(BUILDERS[name](False), WITHOUT_EMPTY)
    for u, want in zip(updates, expected):
        for k in ("e", "f"):  # an empty update of the leaf's shape and dtype
            assert u[k].shape == GRADS[k].shape and u[k].dtype == np.float32
        for k in ("a", "z"):
            np.testing.assert_array_equal(u[k], want[k])
    np.testing.assert_array_equal(steps, expected_steps)
    np.testing.assert_array_equal(total, expected_total)
    assert total.min() > 0  # the other leaves did travel


@pytest.mark.parametrize("tree", ["empty", "zero_size_only"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_tree_without_values_sends_nothing(name, tree):
    grads = {} if tree == "empty" else {k: GRADS[k] for k in ("e", "f")}
    if name.startswith("streaming_diloco") and tree == "empty":
        # No leaf to make a fragment of: refused by name, not deep in JAX.
        with pytest.raises(ValueError, match=r"num_fragments must be <= the number of"):
            run(BUILDERS[name](False), grads)
        return
    updates, steps, total = run(BUILDERS[name](False), grads)
    for u in updates:
        assert jax.tree.structure(u) == jax.tree.structure(grads)
        assert jax.tree.map(np.shape, u) == jax.tree.map(np.shape, grads)
    assert not steps.any() and not total.any()
