"""allreduce_gradients (S-SGD): values and wire bytes, simulated and under mpiexec."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import n_workers, run_workers

from shoal.comms import WireCount, wire_bytes
from shoal.optim import allreduce_gradients

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
        return u, wire_bytes(state)

    # 4*3 + 3 + 3 = 18 float32 = 72 bytes; ring all-reduce: 2 (N-1) / N * 72 each way,
    # plus the non-finite flag: one int32 all-reduced first, 2 (N-1) / N * 4 each way.
    expect_bytes = 2 * (N - 1) * 72 // N + 2 * (N - 1) * 4 // N
    for _, (u, w) in run_workers(worker, GRADS).items():
        for got, g in zip(jax.tree.leaves(u), jax.tree.leaves(GRADS)):
            np.testing.assert_allclose(got, -0.5 * g.mean(0), rtol=1e-6)
        assert (int(w.sent), int(w.received)) == (expect_bytes, expect_bytes)


def test_wire_bytes_sums_nested_states():
    a = WireCount.of(10, 3)
    state = (optax.EmptyState(), {"x": (a, jnp.zeros(2))}, [WireCount.of(5, 7)])
    w = wire_bytes(state)
    assert (int(w.sent), int(w.received)) == (15, 10)
    w0 = wire_bytes(optax.sgd(0.1).init(jnp.zeros(3)))
    assert (int(w0.sent), int(w0.received)) == (0, 0)
