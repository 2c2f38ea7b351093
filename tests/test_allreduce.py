"""allreduce_gradients (S-SGD): values and wire bytes, simulated and under mpiexec."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import n_workers, run_workers

from shoal.comms import AxisCollective, WireCount, WireMeter, wire_bytes
from shoal.optim import allreduce_gradients, skip_nonfinite

N = n_workers()
RNG = np.random.default_rng(0)
GRADS = {
    "dense": {
        "w": RNG.normal(size=(N, 4, 3)).astype(np.float32),
        "b": RNG.normal(size=(N, 3)).astype(np.float32),
    },
    "head": RNG.normal(size=(N, 3)).astype(np.float32),
}


@pytest.mark.mpi
def test_mean_gradient_and_wire_bytes():
    def worker(coll, g):
        tx = optax.chain(allreduce_gradients(collective=coll), optax.sgd(0.5))
        state = tx.init(g)
        u, state = tx.update(g, state, g)
        return u, wire_bytes(state, "step"), wire_bytes(state, "total")

    # 4*3 + 3 + 3 = 18 float32 = 72 bytes; ring all-reduce: 2 (N-1) / N * 72 each way.
    expect_bytes = 2 * (N - 1) * 72 // N
    for _, (u, w, total) in run_workers(worker, GRADS).items():
        for got, g in zip(jax.tree.leaves(u), jax.tree.leaves(GRADS)):
            np.testing.assert_allclose(got, -0.5 * g.mean(0), rtol=1e-6)
        assert (int(w.sent), int(w.received)) == (expect_bytes, expect_bytes)
        assert (int(total.sent), int(total.received)) == (expect_bytes, expect_bytes)


def test_wire_bytes_sums_nested_states():
    a = WireMeter(WireCount.of(10, 3), WireCount.of(100, 30))
    b = WireMeter(WireCount.of(5, 7), WireCount.of(2**32 + 5, 70))
    state = (optax.EmptyState(), {"x": (a, jnp.zeros(2))}, [b])
    w = wire_bytes(state, "step")
    assert (int(w.sent), int(w.received)) == (15, 10)
    w = wire_bytes(state, "total")
    assert (int(w.sent), int(w.received)) == (2**32 + 105, 100)
    w0 = wire_bytes(optax.sgd(0.1).init(jnp.zeros(3)), "total")
    assert (int(w0.sent), int(w0.received)) == (0, 0)
    with pytest.raises(ValueError, match="which"):
        wire_bytes(state, "last")


def sgd_step(coll, tx):
    """One worker's S-SGD step on the loss ``sum(w * x)``: ``(w, state, x) -> (w, state)``."""

    def loss(w, x):
        return sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(x)))

    def step(w, state, x):
        g = jax.grad(loss)(w, x)
        u, state = tx.update(g, state, w)
        return optax.apply_updates(w, u), state

    return step


def test_336m_params_on_64_workers_trace_and_a_small_model_counts_exactly():
    # 320 * 2**20 = 335,544,320 float32 parameters (an embedding and 24 blocks, GPT-2
    # medium's scale): 1,342,177,280 bytes; one ring all-reduce among 64 workers moves
    # 2 * 63 / 64 of it, 2,642,411,520 bytes each way, past int32 (2**31 - 1).
    p = 64
    coll = AxisCollective("workers", p)
    tx = optax.chain(allreduce_gradients(collective=coll), optax.sgd(0.1))
    shapes = {"embed": (32768, 1024), "blocks": (24, 1024, 12288)}
    big = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((p, *s), jnp.float32),
        shapes,
        is_leaf=lambda s: isinstance(s, tuple),
    )
    state = jax.eval_shape(jax.vmap(tx.init), big)
    step = jax.vmap(sgd_step(coll, tx), axis_name="workers")
    w, state = jax.eval_shape(lambda *a: step(*a), big, state, big)
    total = jax.eval_shape(jax.vmap(lambda s: wire_bytes(s, "total")), state)
    for n in jax.tree.leaves(total):
        assert (n.shape, n.dtype) == ((p,), jnp.uint32)  # (hi, lo) words per worker

    # The same step run for real on a small model (26 floats = 104 bytes) and 64 workers:
    # 2 * 63 * 104 // 64 = 204 bytes of gradient per step, each way; the total after three
    # steps is three of them.
    small = {"embed": jnp.ones((p, 2, 5)), "blocks": jnp.ones((p, 2, 2, 4))}
    state = jax.vmap(tx.init)(small)
    run = jax.jit(step)
    w = small
    for _ in range(3):
        w, state = run(w, state, small)
    steps = jax.vmap(lambda s: wire_bytes(s, "step"))(state)
    totals = jax.vmap(lambda s: wire_bytes(s, "total"))(state)
    assert np.asarray(steps.sent).tolist() == [204] * p
    assert np.asarray(steps.received).tolist() == [204] * p
    assert np.asarray(totals.sent).tolist() == [612] * p
    assert np.asarray(totals.received).dtype == np.int64
    np.testing.assert_allclose(w["embed"], 1 - 3 * 0.1, rtol=1e-6)


def test_totals_add_up_over_steps_and_a_skipped_step():
    # 4 workers, 4 float32 gradients (16 bytes): per step 2 * 3 * 16 // 4 = 24 bytes of
    # gradient and 2 * 3 * 4 // 4 = 6 of the flag, each way. Step 1 (of 0..3) has a NaN
    # on worker 2: every worker skips it (skip_nonfinite) and moves only the flag.
    coll = AxisCollective("workers", 4)
    tx = optax.chain(allreduce_gradients(collective=coll), optax.sgd(0.1))
    tx = skip_nonfinite(tx, collective=coll)
    grads = np.ones((4, 4, 4), np.float32)  # [step, worker, element]
    grads[1, 2, 0] = np.nan

    def one(state, g):
        u, state = tx.update(g, state)
        return state, (wire_bytes(state, "step"), wire_bytes(state, "total"))

    state = jax.vmap(tx.init)(jnp.zeros((4, 4)))
    update = jax.jit(jax.vmap(one, axis_name="workers"))
    steps, totals = [], []
    for g in grads:
        state, (step, total) = update(state, g)
        steps.append(int(step.sent[0]))
        totals.append(int(total.received[3]))
    assert steps == [30, 6, 30, 30]
    assert totals == [30, 36, 66, 96]
    assert np.asarray(state.skipped).tolist() == [1] * 4
