"""shoal.optim.powersgd against a NumPy float64 oracle of PowerSGD (PyTorch's powerSGD_hook
semantics), on simulated workers and under mpiexec -n 4 (the tests marked mpi are
rank-agnostic)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import my_ranks, n_workers, run_workers, world
from jax import lax

from shoal.comms import AxisCollective, wire_bytes
from shoal.optim import PowerSGDState, allreduce_gradients, powersgd

N = n_workers()
STEPS = 4
SHAPES = {"b": (5,), "t": (4, 3, 2), "w": (6, 5)}  # jax.tree.leaves order: b, t, w
RNG = np.random.default_rng(7)
# Per worker, per step: [N, STEPS, *shape].
GRADS = {k: RNG.normal(size=(N, STEPS, *s)).astype(np.float32) for k, s in SHAPES.items()}
TOL = dict(rtol=1e-4, atol=1e-5)


def ring(nbytes, n):
    return 2 * (n - 1) * nbytes // n


def matrix(shape):
    return shape[0], math.prod(shape[1:])


def compressed_rank(shape, rank, min_compression):
    """The rank a leaf is sent with, 0 when it is all-reduced uncompressed."""
    if len(shape) < 2:
        return 0
    n, m = matrix(shape)
    r = min(rank, n, m)
    # PyTorch's _should_compress: compressed_size * min_compression_rate < uncompressed.
    return r if (n + m) * r * min_compression < n * m else 0


def orth(a):
    """Orthonormal columns, independently of shoal's Gram-Schmidt: NumPy's QR with the
    signs chosen so that R has a positive diagonal."""
    q, r = np.linalg.qr(a)
    s = np.sign(np.diag(r))
    s[s == 0] = 1
    return q * s


def oracle(grads, q_init, rank, min_compression, start_step=0, draws=None):
    """PowerSGD in float64. ``grads[k]``: [N, steps, *shape]; ``q_init[k]``: the initial Q
    of leaf k; ``draws(k, t)``: the fresh Q of update t (warm_start=False), else None.
    Returns the updates [steps, *shape] and every worker's errors [steps, N, *shape]."""
    updates, errors = {}, {}
    for k, g in grads.items():
        g = np.asarray(g, np.float64)
        workers, steps, shape = g.shape[0], g.shape[1], g.shape[2:]
        r = compressed_rank(shape, rank, min_compression)
        u_k, e_k = [], []
        if not r:
            for t in range(steps):
                u_k.append(g[:, t].mean(0))
            updates[k] = np.stack(u_k)
            continue
        n, m = matrix(shape)
        err = np.zeros((workers, n, m))
        q = np.asarray(q_init[k], np.float64)
        for t in range(steps):
            if t < start_step:
                u_k.append(g[:, t].mean(0))
                e_k.append(err.reshape(workers, *shape).copy())
                continue
            mm = g[:, t].reshape(workers, n, m) + err
            q0 = orth(q if draws is None else np.asarray(draws(k, t), np.float64))
            p = orth(sum(mm[i] @ q0 for i in range(workers)))  # all-reduce (sum), orth
            q = sum(mm[i].T @ p for i in range(workers)) / workers  # all-reduce (mean)
            approx = p @ q.T
            err = mm - approx  # PyTorch's error: M_i minus the decompressed all-reduced P Q^T
            u_k.append(approx.reshape(shape))
            e_k.append(err.reshape(workers, *shape).copy())
        updates[k], errors[k] = np.stack(u_k), np.stack(e_k)
    return updates, errors


def worker_fn(make):
    """Worker fn: init from zeros shaped like the gradient, then one update per step of
    ``grads`` (leaves [steps, *shape]). Returns the initial state, per step (updates,
    error, wire bytes of the step) and the final state."""

    def worker(coll, grads):
        tx = make(coll)
        state = tx.init(jax.tree.map(lambda g: jnp.zeros(g.shape[1:], g.dtype), grads))

        def body(s, g):
            u, s = tx.update(g, s)
            return s, (u, s.error, wire_bytes(s, "step"))

        final, traj = lax.scan(body, state, grads)
        return state, traj, final

    return worker


def all_errors(out, k):
    """[steps, N, *shape]: every worker's error of leaf k (only this process's ranks)."""
    return np.stack([out[r][1][1][k] for r in sorted(out)], axis=1)


CASES = {
    # rank 1: both matrices compress at the default min_compression (30/11, 24/10).
    "rank1": dict(rank=1),
    # w: 30/22 >= 1.25 compresses; t: 24/20 < 1.25 goes uncompressed with b.
    "mixed": dict(rank=2, min_compression=1.25),
    # rank 3 after two plain all-reduces.
    "start_step": dict(rank=3, min_compression=0.5, start_step=2),
    # a fresh seeded Q every update.
    "cold": dict(rank=2, min_compression=1.0, warm_start=False, seed=3),
}


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES)
def test_matches_oracle(case):
    kw = CASES[case]
    out = run_workers(worker_fn(lambda c: powersgd(collective=c, **kw)), GRADS)
    rank, min_c = kw["rank"], kw.get("min_compression", 2.0)
    init = out[my_ranks()[0]][0]
    q_init = {k: np.asarray(v) for k, v in init.q.items()}
    draws = None
    if not kw.get("warm_start", True):
        leaves = sorted(SHAPES)  # jax.tree.leaves order of a dict

        def draws(k, t):
            n, m = matrix(SHAPES[k])
            r = compressed_rank(SHAPES[k], rank, min_c)
            key = jax.random.PRNGKey(kw["seed"])
            key = jax.random.fold_in(jax.random.fold_in(key, leaves.index(k)), t)
            return jax.random.normal(key, (m, r), jnp.float32)

    want_u, want_e = oracle(GRADS, q_init, rank, min_c, kw.get("start_step", 0), draws)
    for k, shape in SHAPES.items():
        r = compressed_rank(shape, rank, min_c)
        for rk, (state, (u, err, _), final) in out.items():
            np.testing.assert_allclose(u[k], want_u[k], err_msg=k, **TOL)
            if r:
                np.testing.assert_allclose(err[k], want_e[k][:, rk], err_msg=k, **TOL)
                assert state.q[k].shape == (matrix(shape)[1], r)
                assert final.error[k].shape == shape
                # The stored Q is the all-reduced one: the same on every worker.
                np.testing.assert_array_equal(final.q[k], out[my_ranks()[0]][2].q[k])
            else:  # uncompressed: no error, no Q
                assert state.error[k].shape == (0,) and final.q[k].shape == (0,)
            assert int(final.step) == STEPS
    if case == "mixed":
        assert compressed_rank(SHAPES["t"], rank, min_c) == 0  # the case's premise
        assert compressed_rank(SHAPES["w"], rank, min_c) == 2


@pytest.mark.mpi
def test_full_rank_is_the_mean_gradient():
    """At rank min(n, m) (clamped from 10) with zero error, P P^T spans the mean gradient:
    the update is S-SGD's mean gradient."""
    out = run_workers(worker_fn(lambda c: powersgd(10, collective=c, min_compression=0.1)), GRADS)
    for _, (u, _, _), final in out.values():
        for k in SHAPES:
            np.testing.assert_allclose(u[k][0], GRADS[k][:, 0].mean(0), rtol=1e-5, atol=1e-5)
        assert final.q["t"].shape == (6, 4) and final.q["w"].shape == (5, 5)  # rank clamped
        assert final.q["b"].shape == (0,)
    # PyTorch's error: each worker keeps its own deviation from the mean, G_i - mean.
    for k in ("t", "w"):
        dev = GRADS[k][my_ranks(), 0] - GRADS[k][:, 0].mean(0)
        np.testing.assert_allclose(all_errors(out, k)[0], dev, rtol=1e-5, atol=1e-5)


@pytest.mark.mpi
def test_update_plus_error_is_the_fed_back_gradient():
    """Conservation, every worker, every step: U_t + E_t == G_t + E_{t-1}."""
    out = run_workers(worker_fn(lambda c: powersgd(1, collective=c)), GRADS)
    for rk, (_, (u, err, _), _) in out.items():
        for k in ("t", "w"):
            prev = np.concatenate([np.zeros_like(err[k][:1]), err[k][:-1]])
            np.testing.assert_allclose(u[k] + err[k], GRADS[k][rk] + prev, rtol=1e-5, atol=1e-5)
            assert np.abs(err[k]).max() > 0.1  # rank 1 does lose something


@pytest.mark.mpi
def test_before_start_step_the_update_is_the_all_reduced_mean():
    start = 2
    got = run_workers(worker_fn(lambda c: powersgd(1, collective=c, start_step=start)), GRADS)

    def ssgd(coll, grads):
        tx = allreduce_gradients(collective=coll)
        state = tx.init(jax.tree.map(lambda g: g[0], grads))
        return lax.scan(lambda s, g: tx.update(g, s)[::-1], state, grads)[1]

    want = run_workers(ssgd, GRADS)
    for rk, (_, (u, err, wire), _) in got.items():
        for k in SHAPES:
            np.testing.assert_array_equal(u[k][:start], want[rk][k][:start])  # bit-exact
        for k in ("t", "w"):  # compressed from then on (b never is)
            assert np.all(err[k][:start] == 0) and np.abs(err[k][start]).max() > 0.1
            assert not np.allclose(u[k][start], want[rk][k][start])
        n_bytes = 4 * sum(math.prod(s) for s in SHAPES.values())
        plain = ring(n_bytes, N)
        assert np.asarray(wire.sent).tolist()[:start] == [plain] * start


@pytest.mark.mpi
def test_wire_bytes_exact():
    """rank 2, min_compression 1.25: w (6x5) compressed at rank 2, t and b uncompressed;
    one plain step first."""
    kw = dict(rank=2, min_compression=1.25, start_step=1)
    out = run_workers(worker_fn(lambda c: powersgd(collective=c, **kw)), GRADS)
    plain = ring(4 * (5 + 24 + 30), N)  # the whole gradient, 236 bytes
    p, q, rest = 4 * 6 * 2, 4 * 5 * 2, 4 * (5 + 24)  # P of w, Q of w, t and b batched
    compressed = ring(p, N) + ring(q, N) + ring(rest, N)
    expect = [plain] + [compressed] * (STEPS - 1)
    for _, (_, _, wire), final in out.values():
        assert np.asarray(wire.sent).tolist() == expect
        assert np.asarray(wire.received).tolist() == expect
        total = int(final.wire.total.sent)
        assert total == int(final.wire.total.received) == sum(expect)
    if N == 4:  # the formula's values, written out
        assert expect == [354] + [72 + 60 + 174] * 3


@pytest.mark.mpi
def test_state_is_a_checkpointable_named_tuple():
    """State: a NamedTuple of arrays; restored from host copies it resumes exactly."""

    def worker(coll, grads):
        tx = powersgd(1, collective=coll)
        state = tx.init(jax.tree.map(lambda g: g[0], grads))
        _, state = tx.update(jax.tree.map(lambda g: g[0], grads), state)
        return state

    states = run_workers(worker, GRADS)
    for state in states.values():
        assert isinstance(state, PowerSGDState)
        assert state._fields == ("error", "q", "step", "wire")
        leaves = jax.tree.leaves(state)
        assert leaves and all(isinstance(x, jax.Array) for x in leaves)
        assert state.step.dtype == jnp.int32

    def resumed(coll, grads, saved):
        tx = powersgd(1, collective=coll)
        u, _ = tx.update(jax.tree.map(lambda g: g[1], grads), saved)
        return u

    def straight(coll, grads):
        tx = powersgd(1, collective=coll)
        state = tx.init(jax.tree.map(lambda g: g[0], grads))
        _, state = tx.update(jax.tree.map(lambda g: g[0], grads), state)
        u, _ = tx.update(jax.tree.map(lambda g: g[1], grads), state)
        return u

    host = {r: jax.tree.map(np.asarray, s) for r, s in states.items()}  # the checkpoint
    if len(host) == 1:  # one rank per process: its own saved state
        (r, saved), = host.items()  # fmt: skip
        stacked = jax.tree.map(lambda x: np.stack([x] * N), saved)
    else:
        stacked = jax.tree.map(lambda *xs: np.stack(xs), *[host[r] for r in sorted(host)])
    a = run_workers(resumed, GRADS, stacked)
    b = run_workers(straight, GRADS)
    for r in a:
        for k in SHAPES:
            np.testing.assert_array_equal(a[r][k], b[r][k])


@pytest.mark.parametrize(
    "shape, rank, compressed",
    [
        ((4, 4), 1, False),  # 16 = 2 * 8 * 1: exactly 2x, PyTorch sends it whole
        ((3, 6), 1, False),  # 18 = 2 * 9 * 1
        ((8, 8), 2, False),  # 64 = 2 * 16 * 2
        ((4, 5), 1, True),  # 20 > 18
        ((8, 9), 2, True),  # 72 > 68
    ],
)
def test_compression_test_is_strict_as_pytorchs(shape, rank, compressed):
    """A leaf that saves exactly ``min_compression`` (2 by default) is all-reduced whole,
    as PyTorch's ``_should_compress`` (``compressed * rate < uncompressed``) decides: its
    state keeps no warm-start Q and its update is the exact mean."""
    coll = AxisCollective("w", 2)
    tx = powersgd(rank, collective=coll)
    grads = jnp.asarray(RNG.normal(size=(2, *shape)), jnp.float32)

    def step(g):
        updates, state = tx.update(g, tx.init(g))
        return updates, state.q

    updates, q = jax.vmap(step, axis_name="w")(grads)
    assert q.shape[1:] == ((math.prod(shape[1:]), rank) if compressed else (0,))
    mean = np.asarray(grads).mean(0)
    if compressed:  # rank < min(n, m): a low-rank estimate, not the mean
        assert np.abs(np.asarray(updates[0]) - mean).max() > 1e-3
    else:
        np.testing.assert_allclose(updates[0], mean, rtol=1e-6, atol=1e-6)


def test_mismatched_gradient_is_refused():
    coll = AxisCollective("w", 1)
    tx = powersgd(1, collective=coll)
    state = jax.vmap(tx.init)({"w": jnp.zeros((1, 6, 5))})
    with pytest.raises(ValueError, match=r"powersgd: .*\['w'\] has shape \(5, 6\)"):
        jax.vmap(tx.update, axis_name="w")({"w": jnp.zeros((1, 5, 6))}, state)
    with pytest.raises(TypeError, match="expected a PowerSGDState"):
        jax.vmap(tx.update, axis_name="w")({"w": jnp.zeros((1, 6, 5))}, ())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rank=0), "rank must be an int >= 1"),
        (dict(rank=1.5), "rank must be an int >= 1"),
        (dict(rank=True), "rank must be an int >= 1"),
        (dict(rank=None), "rank must be an int >= 1"),
        (dict(min_compression=0), "min_compression must be a finite number > 0"),
        (dict(min_compression=-1.0), "min_compression must be a finite number > 0"),
        (dict(min_compression=float("nan")), "min_compression must be a finite number > 0"),
        (dict(min_compression="2"), "min_compression must be a finite number > 0"),
        (dict(start_step=-1), "start_step must be an int >= 0"),
        (dict(start_step=1.0), "start_step must be an int >= 0"),
        (dict(warm_start="yes"), "warm_start must be True or False"),
        (dict(seed=0.5), "seed must be an int"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    kwargs = {"rank": 1, **kwargs}
    rank = kwargs.pop("rank")
    with pytest.raises(ValueError, match=match):
        powersgd(rank, collective=world(), **kwargs)
