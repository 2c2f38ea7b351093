"""shoal.optim.sma (synchronous model averaging) against a NumPy oracle, on 4 simulated
workers and under mpiexec -n 4 (same file, rank-agnostic)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from averaging_cases import INNERS, LR, N_BYTES, flat, make_case
from averaging_cases import train as train_workers
from harness import n_workers, run_workers, world
from parabola_cases import TARGET, descend, different_starts

from shoal.comms.wire import all_reduce_bytes
from shoal.optim import SMAState, sma

N = n_workers()
STEPS = 3
P0, GRADS = make_case(seed=1, steps=STEPS)


def oracle(alpha, mu, wd, steps=STEPS):
    """SMA in float64: v_r <- (1 - alpha) v_r + alpha mean(v) + u_r, with u_r the
    heavy-ball SGD step at the pre-averaging v_r. Returns params after every step."""
    v = flat(P0).astype(np.float64)
    g_all = flat({"b": GRADS["b"].swapaxes(0, 1), "w": GRADS["w"].swapaxes(0, 1)})
    mom = np.zeros_like(v)
    out = []
    for t in range(steps):
        mom = mu * mom + g_all[t] + wd * v
        v = (1 - alpha) * v + alpha * v.mean(0) - LR * mom
        out.append(v.copy())
    return np.stack(out)


def train(make_tx):
    return train_workers(make_tx, P0, GRADS)


@pytest.mark.mpi
@pytest.mark.parametrize("inner", list(INNERS))
@pytest.mark.parametrize("alpha", [None, 0.5, 1.0], ids=["default", "half", "one"])
def test_matches_oracle(alpha, inner):
    make, mu, wd = INNERS[inner]
    kwargs = {} if alpha is None else {"alpha": alpha}
    out = train(lambda c: sma(make(), collective=c, **kwargs))
    expect = oracle(0.1 if alpha is None else alpha, mu, wd)
    sync = all_reduce_bytes(N_BYTES, N)[0]
    assert sync == 2 * (N - 1) * N_BYTES // N
    for rank, ((params, wire), state) in out.items():
        np.testing.assert_allclose(flat(params), expect[:, rank], rtol=1e-5, atol=1e-5)
        assert np.asarray(wire.sent).tolist() == [sync] * STEPS
        assert np.asarray(wire.received).tolist() == [sync] * STEPS
        assert int(state.wire.total.received) == sync * STEPS
        assert isinstance(state, SMAState)


@pytest.mark.mpi
def test_alpha_one_restarts_from_the_mean_model():
    out = train(lambda c: sma(optax.sgd(LR), collective=c, alpha=1.0))
    v0 = flat(P0).astype(np.float64)
    g0 = flat(GRADS)[:, 0]
    for rank, ((params, _), _) in out.items():
        np.testing.assert_allclose(
            flat(params)[0], v0.mean(0) - LR * g0[rank], rtol=1e-5, atol=1e-6
        )


@pytest.mark.mpi
def test_zero_gradients_contract_towards_the_fixed_mean():
    # With u = 0 the mean is invariant and each deviation shrinks by (1 - alpha) a step.
    alpha = 0.3

    def worker(coll, p0):
        tx = sma(optax.sgd(LR), collective=coll, alpha=alpha)
        state = tx.init(p0)
        p = p0
        for _ in range(STEPS):
            u, state = tx.update(jax.tree.map(jnp.zeros_like, p), state, p)
            p = optax.apply_updates(p, u)
        return p

    v0 = flat(P0).astype(np.float64)
    for rank, p in run_workers(worker, P0).items():
        want = v0.mean(0) + (1 - alpha) ** STEPS * (v0[rank] - v0.mean(0))
        np.testing.assert_allclose(flat(p), want, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
def test_alpha_can_be_injected():
    def worker(coll, p0, grads):
        g = jax.tree.map(lambda x: x[0], grads)
        plain = sma(optax.sgd(LR), collective=coll, alpha=0.4)
        injected = optax.inject_hyperparams(sma)(optax.sgd(LR), collective=coll, alpha=0.4)
        u, _ = plain.update(g, plain.init(p0), p0)
        ui, si = injected.update(g, injected.init(p0), p0)
        return u, ui, si.hyperparams["alpha"]

    for u, ui, alpha in run_workers(worker, P0, GRADS).values():
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), u, ui)
        np.testing.assert_allclose(alpha, 0.4)


@pytest.mark.parametrize("alpha", [0.0, 1.5, -0.1, float("nan"), True])
def test_bad_alpha(alpha):
    with pytest.raises(ValueError, match=r"alpha must be a number in \(0, 1\]"):
        sma(optax.sgd(0.1), collective=world(), alpha=alpha)


def test_optimises_parabola_from_different_starts():
    # optax's contract test, from a different start on every worker.
    def worker(coll, p):
        tx = sma(optax.sgd(0.05), collective=coll)
        return descend(tx, p, 500)

    for p in run_workers(worker, different_starts(N)).values():
        np.testing.assert_allclose(p, TARGET, rtol=1e-4, atol=1e-4)
