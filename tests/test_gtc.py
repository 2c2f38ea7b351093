"""shoal.optim.gtc against a NumPy oracle of Strom's equations, on 4 simulated workers
and under mpiexec -n 4 (same file, rank-agnostic)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import n_workers, run_workers, world

from shoal.comms import AxisCollective, wire_bytes
from shoal.optim import gtc, skip_nonfinite
from shoal.optim._gtc import residual_tree, resolve_capacity

N = n_workers()
SHAPES = {"b": (7,), "w": (5, 6)}  # flattened in key order: b then w, n = 37
N_ELEM = 37


def make_grads(steps, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return {
        k: (scale * rng.normal(size=(N, steps, *s))).astype(np.float32) for k, s in SHAPES.items()
    }


def flat(tree_of_worker_step):
    """[N, T, ...] leaves -> [N, T, n] in the fused buffer's order (jax.tree.leaves)."""
    leaves = jax.tree.leaves(tree_of_worker_step)
    return np.concatenate([x.reshape(x.shape[0], x.shape[1], -1) for x in leaves], axis=-1)


def oracle(g, tau, cap, average=True):
    """Strom's GTC for g[N, T, n] with the documented capacity rule.

    Returns per-step aggregates [T, n] and final residuals [N, n]."""
    n_w, steps, n = g.shape
    r = np.zeros((n_w, n), np.float32)
    tau = np.float32(tau)
    offset = 0
    aggs = []
    for t in range(steps):
        agg = np.zeros(n, np.float32)
        for i in range(n_w):
            a = g[i, t] + r[i]
            cyclic = (offset + np.arange(n)) % n
            qualifying = cyclic[np.abs(a[cyclic]) > tau][:cap]
            q = np.zeros(n, np.float32)
            q[qualifying] = np.where(a[qualifying] > 0, tau, -tau)
            r[i] = a - q
            agg += q
        aggs.append(agg / n_w if average else agg)
        offset = (offset + cap) % n
    return np.stack(aggs), r


def run_gtc(grads, tx):
    """Apply ``tx`` on every worker for every step; returns {rank: (updates[T], state)}."""

    def worker(coll, g):
        params = jax.tree.map(lambda x: jnp.zeros(x.shape[1:]), g)
        state = tx(coll).init(params)
        outs = []
        for t in range(jax.tree.leaves(g)[0].shape[0]):
            u, state = tx(coll).update(jax.tree.map(lambda x, t=t: x[t], g), state, params)
            outs.append(u)
        return jax.tree.map(lambda *u: jnp.stack(u), *outs), state

    return run_workers(worker, grads)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "tau,capacity,average",
    [(0.8, 1.0, True), (0.5, 0.1, True), (1.2, 3, False)],
    ids=["no-overflow", "overflow-fraction", "overflow-count-sum"],
)
def test_gtc_matches_oracle(tau, capacity, average):
    steps = 6
    grads = make_grads(steps)
    out = run_gtc(grads, lambda c: gtc(tau, collective=c, capacity=capacity, average=average))
    cap = resolve_capacity(capacity, N_ELEM)
    agg, r = oracle(flat(grads), tau, cap, average)
    for rank, (u, state) in out.items():
        u_flat = flat(jax.tree.map(lambda x: np.asarray(x)[None], u))[0]
        np.testing.assert_allclose(u_flat, agg, rtol=1e-6, atol=1e-6)
        res = np.concatenate([np.ravel(x) for x in jax.tree.leaves(state.residual)])
        np.testing.assert_allclose(res, r[rank], rtol=1e-6, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("capacity", [1.0, 2], ids=["fits", "overflows"])
def test_conservation(capacity):
    """N * sum_t aggregate_t + sum_i r_i(T) == sum_t sum_i g_i(t), also on overflow."""
    steps = 8
    grads = make_grads(steps, seed=1, scale=0.7)
    tx = gtc(0.3, collective=world(), capacity=capacity)

    def worker(coll, g):
        params = jax.tree.map(lambda x: jnp.zeros(x.shape[1:]), g)
        state, total = tx.init(params), jax.tree.map(jnp.zeros_like, params)
        for t in range(steps):
            u, state = tx.update(jax.tree.map(lambda x, t=t: x[t], g), state, params)
            total = jax.tree.map(jnp.add, total, u)
        # Every worker sees the sum of all residuals, so each rank can check the identity.
        return total, coll.all_reduce(state.residual, "sum"), state.residual

    out = run_workers(worker, grads)
    g = flat(grads)
    for total, residual_sum, _ in out.values():
        lhs = N * flat(jax.tree.map(lambda x: np.asarray(x)[None, None], total))[0, 0]
        lhs = lhs + flat(jax.tree.map(lambda x: np.asarray(x)[None, None], residual_sum))[0, 0]
        np.testing.assert_allclose(lhs, g.sum(axis=(0, 1)), rtol=1e-5, atol=1e-5)
    if capacity == 2:  # overflow really happened: mass is waiting in the residuals
        assert max(np.abs(np.asarray(x)).max() for x in jax.tree.leaves(residual_sum)) > 0.3


@pytest.mark.mpi
def test_wire_bytes_hand_computed():
    grads = make_grads(1)
    out = run_gtc(grads, lambda c: gtc(0.5, collective=c, capacity=4))
    # all-gather of (4 words + 1 header) int32 per worker: (N-1) * 5 * 4 bytes each way
    for _, (_, state) in out.items():
        for which in ("step", "total"):  # one step: its bytes are all there are
            w = wire_bytes(state, which)
            assert int(w.sent) == (N - 1) * 20 and int(w.received) == (N - 1) * 20


@pytest.mark.mpi
def test_nonfinite_gradient_skips_step_on_every_worker():
    # In skip_nonfinite (the one mechanism: gtc does not check by itself).
    steps = 3
    grads = make_grads(steps, seed=3)
    grads["w"][N - 1, 1, 2, 3] = np.nan  # one worker, step 1
    grads["b"][0, 2, 0] = np.inf  # another worker, step 2
    out = run_gtc(grads, lambda c: skip_nonfinite(gtc(0.5, collective=c), collective=c))
    g = flat(grads)
    n = N_ELEM
    cap = resolve_capacity(0.02, n)
    # Oracle: step 0 normal; steps 1 and 2 skipped on every worker: update 0, the
    # residuals stay as step 0 left them (the gradients of skipped steps are discarded).
    agg0, r = oracle(g[:, :1], 0.5, cap)
    for rank, (u, state) in out.items():
        u_flat = flat(jax.tree.map(lambda x: np.asarray(x)[None], u))[0]
        np.testing.assert_allclose(u_flat[0], agg0[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(u_flat[1:], 0.0)
        res = np.concatenate([np.ravel(x) for x in jax.tree.leaves(state.inner_state.residual)])
        assert np.isfinite(res).all()
        np.testing.assert_allclose(res, r[rank], rtol=1e-6, atol=1e-6)
        assert int(state.skipped) == 2


@pytest.mark.mpi
def test_chains_with_sgd_and_jits():
    grads = make_grads(2)
    tx = lambda c: optax.chain(gtc(0.5, collective=c, capacity=1.0), optax.sgd(0.1))
    out = run_gtc(grads, tx)
    agg, _ = oracle(flat(grads), 0.5, N_ELEM)
    for _, (u, state) in out.items():
        u_flat = flat(jax.tree.map(lambda x: np.asarray(x)[None], u))[0]
        np.testing.assert_allclose(u_flat, -0.1 * agg, rtol=1e-6, atol=1e-7)
        assert int(wire_bytes(state, "step").sent) == (N - 1) * 4 * (N_ELEM + 1)
        assert int(wire_bytes(state, "total").sent) == 2 * (N - 1) * 4 * (N_ELEM + 1)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(threshold=0.0), "threshold must be a finite number > 0"),
        (dict(threshold=-1.0), "threshold must be a finite number > 0"),
        (dict(threshold=True), "threshold must be a finite number > 0"),
        (dict(threshold=np.float32("nan")), "threshold must be a finite number > 0"),
        (dict(threshold=0.1, capacity=0.0), r"capacity as a fraction must lie in \(0, 1\]"),
        (dict(threshold=0.1, capacity=1.5), r"capacity as a fraction must lie in \(0, 1\]"),
        (dict(threshold=0.1, capacity=0), "capacity as a count must be >= 1"),
        (dict(threshold=0.1, capacity="all"), "capacity must be a float"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gtc(collective=world(), **kwargs)


def test_integer_gradients_rejected():
    coll = AxisCollective("workers", 1)
    tx = gtc(0.1, collective=coll)
    with pytest.raises(ValueError, match="params must be floating point"):
        tx.init({"w": jnp.zeros(3, jnp.int32)})
    state = tx.init({"w": jnp.zeros(3)})
    with pytest.raises(ValueError, match=r"updates must be floating point; leaf \['w'\]"):
        jax.vmap(lambda g, s: tx.update(g, s), axis_name="workers")(
            {"w": jnp.ones((1, 3), jnp.int32)}, jax.tree.map(lambda x: x[None], state)
        )


def test_mismatched_gradient_is_refused():
    # A gradient of the same size but other leaves would scramble the exchanged buffer's
    # layout: refused, naming both layouts.
    tx = gtc(0.5, collective=AxisCollective("w", 1))
    state = jax.vmap(tx.init)({"a": jnp.zeros((1, 2)), "b": jnp.zeros((1, 2, 3))})
    update = jax.vmap(tx.update, axis_name="w")
    same_size = {"a": jnp.zeros((1, 3)), "b": jnp.zeros((1, 5))}
    with pytest.raises(
        ValueError, match=r"gtc: .*\{'a': \(2,\), 'b': \(2, 3\)\}.*got \{'a': \(3,\)"
    ):
        update(same_size, state)
    with pytest.raises(ValueError, match=r"gtc: .*got \{'a': \(2,\)\} \(2 elements\)"):
        update({"a": jnp.zeros((1, 2))}, state)
    # The residual is a tree like the params; a flat one (states made before it was kept
    # leaf by leaf) maps back to the params' leaves, stacked over the workers.
    tree = residual_tree(state, {"a": jnp.zeros(2), "b": jnp.zeros((2, 3))})
    assert jax.tree.map(jnp.shape, tree) == {"a": (1, 2), "b": (1, 2, 3)}
    flat = jnp.arange(8.0)[None]
    tree = residual_tree(state._replace(residual=flat), {"a": jnp.zeros(2), "b": jnp.zeros((2, 3))})
    np.testing.assert_array_equal(tree["a"], [[0, 1]])
    np.testing.assert_array_equal(tree["b"], [[[2, 3, 4], [5, 6, 7]]])
