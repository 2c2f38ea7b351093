"""gradient_noise_scale against a NumPy oracle of McCandlish et al.'s appendix A estimators,
on 4 simulated workers and under mpiexec -n 4 (same file, rank-agnostic)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import n_workers, run_workers

from shoal.comms import AxisCollective, wire_bytes
from shoal.optim import NoiseScaleState, gradient_noise_scale, skip_nonfinite
from shoal.optim.helpers import noise_scale

N = n_workers()
T = 3  # steps in the EMA tests
B = 8  # local batch size
RNG = np.random.default_rng(0)


def make_grads(steps):
    """[N, steps, ...] per leaf: a shared signal plus per-worker noise of similar size, so
    the oracle's differences are well conditioned."""
    mean = {"w": RNG.normal(size=(steps, 4, 3)), "b": RNG.normal(size=(steps, 3))}
    return jax.tree.map(
        lambda m: (m + RNG.normal(size=(N, *m.shape))).astype(np.float32),
        mean,
    )


GRADS = make_grads(T)
N_BYTES = 4 * (4 * 3 + 3)  # float32 gradient tree


def flat(tree):
    """Per-worker flat float64 vectors, [N, n] from a tree of [N, ...] leaves."""
    return np.concatenate(
        [np.asarray(x, np.float64).reshape(N, -1) for x in jax.tree.leaves(tree)], axis=1
    )


def oracle(steps, b, ema):
    """McCandlish et al.'s formulas in float64, literally, with Adam-style bias correction.

    ``steps`` is a list of [N, n] arrays. Returns (g2_ema, s_ema, g2_hat, s_hat, B_simple)."""
    b_small, b_big = b, N * b
    m_g2 = m_s = 0.0
    for g in steps:
        small = np.mean(np.sum(g**2, axis=1))
        big = np.sum(g.mean(0) ** 2)
        g2 = (b_big * big - b_small * small) / (b_big - b_small)
        s = (small - big) / (1 / b_small - 1 / b_big)
        m_g2 = ema * m_g2 + (1 - ema) * g2
        m_s = ema * m_s + (1 - ema) * s
    corr = 1 - ema ** len(steps)
    return m_g2, m_s, m_g2 / corr, m_s / corr, (m_s / corr) / (m_g2 / corr)


def step_grads(grads, t):
    return jax.tree.map(lambda x: x[:, t], grads)


def run_steps(ema, grads, steps, b=B):
    def worker(coll, g):
        tx = gradient_noise_scale(collective=coll, local_batch_size=b, ema=ema)
        state = tx.init(jax.tree.map(lambda x: x[0], g))
        outs = []
        for t in range(steps):
            u, state = tx.update(jax.tree.map(lambda x, t=t: x[t], g), state)
            outs.append(u)
        return outs, state

    return run_workers(worker, grads)


@pytest.mark.mpi
def test_one_step_mean_estimates_and_wire_bytes():
    out = run_steps(0.9, GRADS, 1)
    g0 = step_grads(GRADS, 0)
    _, _, g2, s, ratio = oracle([flat(g0)], B, 0.9)
    # one ring all-reduce of the gradient tree and one more float32 (the squared norm).
    expect = 2 * (N - 1) * (N_BYTES + 4) // N
    for _, ([u], state) in out.items():
        for got, g in zip(jax.tree.leaves(u), jax.tree.leaves(g0)):
            np.testing.assert_allclose(got, g.mean(0), rtol=1e-6, atol=1e-7)
        assert int(state.step) == 1
        np.testing.assert_allclose(state.g2, g2, rtol=1e-5)
        np.testing.assert_allclose(state.s, s, rtol=1e-5)
        np.testing.assert_allclose(state.noise_scale, ratio, rtol=1e-5)
        np.testing.assert_allclose(noise_scale(state), ratio, rtol=1e-5)
        for which in ("step", "total"):  # one step: its bytes are all there are
            w = wire_bytes(state, which)
            assert (int(w.sent), int(w.received)) == (expect, expect)


@pytest.mark.mpi
@pytest.mark.parametrize("ema", [0.0, 0.5, 0.9])
def test_three_steps_match_ema_oracle(ema):
    out = run_steps(ema, GRADS, T)
    steps = [flat(step_grads(GRADS, t)) for t in range(T)]
    g2_ema, s_ema, g2, s, ratio = oracle(steps, B, ema)
    if ema == 0.0:  # no smoothing: the raw estimates of the last step
        _, _, g2_raw, s_raw, _ = oracle(steps[-1:], B, 0.0)
        np.testing.assert_allclose((g2, s), (g2_raw, s_raw))
    for _, (us, state) in out.items():
        for t, u in enumerate(us):
            for got, g in zip(jax.tree.leaves(u), jax.tree.leaves(step_grads(GRADS, t))):
                np.testing.assert_allclose(got, g.mean(0), rtol=1e-6, atol=1e-7)
        assert int(state.step) == T
        for name, want in [
            ("g2_ema", g2_ema),
            ("s_ema", s_ema),
            ("g2", g2),
            ("s", s),
            ("noise_scale", ratio),
        ]:
            got = getattr(state, name)
            assert got.dtype == jnp.float32, name
            np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=name)


@pytest.mark.mpi
def test_half_precision_leaf_norms_in_float32():
    """A bfloat16 leaf: the update keeps its dtype, the estimates are float32 and use the
    squared norms of the bf16 values (inputs and the averaged gradient as returned)."""
    g = step_grads(GRADS, 0)
    g = {"w": g["w"], "b": g["b"].astype(jnp.bfloat16)}

    def worker(coll, g):
        tx = gradient_noise_scale(collective=coll, local_batch_size=B, ema=0.9)
        return tx.update(g, tx.init(g))

    for _, (u, state) in run_workers(worker, g).items():
        assert u["b"].dtype == jnp.bfloat16 and u["w"].dtype == jnp.float32
        np.testing.assert_allclose(
            np.asarray(u["b"], np.float32), g["b"].astype(np.float32).mean(0), rtol=1e-2
        )
        local = flat(g)
        mean = np.concatenate([np.asarray(u["b"], np.float64), np.asarray(u["w"]).ravel()])
        small, big = np.mean(np.sum(local**2, 1)), np.sum(mean**2)
        g2 = (N * big - small) / (N - 1)
        s = (small - big) / (1 / B - 1 / (N * B))
        assert state.g2.dtype == state.s.dtype == state.noise_scale.dtype == jnp.float32
        np.testing.assert_allclose((state.g2, state.s), (g2, s), rtol=1e-5)


@pytest.mark.mpi
def test_non_finite_gradients():
    g = step_grads(GRADS, 0)
    g = {"w": g["w"].copy(), "b": g["b"]}
    g["w"][N - 1, 0, 0] = np.nan

    def worker(coll, g, wrapped):
        tx = gradient_noise_scale(collective=coll, local_batch_size=B)
        if wrapped:
            tx = skip_nonfinite(tx, collective=coll)
        return tx.update(g, tx.init(g))

    # In skip_nonfinite: zero update, estimates and EMAs untouched.
    for _, (u, state) in run_workers(lambda c, g: worker(c, g, True), g).items():
        assert all(np.all(x == 0) for x in jax.tree.leaves(u))
        assert int(state.skipped) == 1 and int(state.inner_state.step) == 0
        assert float(state.inner_state.g2_ema) == 0.0
        assert float(state.inner_state.noise_scale) == 0.0
    # Unchecked: the NaN reaches the mean and every estimate.
    for _, (u, state) in run_workers(lambda c, g: worker(c, g, False), g).items():
        assert np.isnan(u["w"][0, 0]) and np.all(np.isfinite(u["b"]))
        assert np.isnan(state.g2) and np.isnan(state.s) and np.isnan(state.noise_scale)


def test_noise_scale_approaches_trace_sigma_over_g2():
    """Workers average B per-example gradients ``G + sigma * eps`` (diagonal covariance):
    the smoothed estimate approaches ``tr(Sigma) / |G|^2``."""
    n, d, b, steps = 4, 16, 8, 3000
    rng = np.random.default_rng(1)
    G = rng.normal(size=d) * 0.25
    sigma = rng.uniform(0.5, 1.5, size=d)
    per_example = G + sigma * rng.normal(size=(steps, n, b, d))
    grads = per_example.mean(axis=2).astype(np.float32)  # [steps, n, d]
    truth_g2, truth_s = np.sum(G**2), np.sum(sigma**2)
    truth = truth_s / truth_g2

    coll = AxisCollective("workers", n)
    tx = gradient_noise_scale(collective=coll, local_batch_size=b, ema=0.995)

    def worker(g):  # g: [steps, d] of one worker
        def body(state, gt):
            _, state = tx.update(gt, state)
            return state, None

        state, _ = jax.lax.scan(body, tx.init(g[0]), g)
        return state

    state = jax.jit(jax.vmap(worker, axis_name="workers"))(np.swapaxes(grads, 0, 1))
    assert np.ptp(np.asarray(state.noise_scale)) == 0  # identical on every worker
    np.testing.assert_allclose(state.g2[0], truth_g2, rtol=0.1)
    np.testing.assert_allclose(state.s[0], truth_s, rtol=0.1)
    np.testing.assert_allclose(noise_scale(state)[0], truth, rtol=0.15)


@pytest.mark.mpi
def test_inject_hyperparams_and_chain():
    """ema and local_batch_size may be injected (traced inside jit); the result matches
    the plain transformation, and `noise_scale` finds the state inside the wrappers."""
    g0 = step_grads(GRADS, 0)

    def worker(coll, g):
        plain = optax.chain(
            gradient_noise_scale(collective=coll, local_batch_size=B, ema=0.5), optax.sgd(0.1)
        )
        injected = optax.chain(
            optax.inject_hyperparams(gradient_noise_scale)(
                collective=coll, local_batch_size=B, ema=0.5
            ),
            optax.sgd(0.1),
        )
        p = jax.tree.map(jnp.zeros_like, g)
        out = []
        for tx in (plain, injected):
            state = optax.tree_utils.tree_map_params(tx, lambda v: v, tx.init(p))
            u, state = tx.update(g, state, p)
            u, state = tx.update(jax.tree.map(lambda x: 2 * x, g), state, p)
            out.append((u, noise_scale(state), state))
        return out

    _, _, ratio = oracle([flat(g0), flat(jax.tree.map(lambda x: 2 * x, g0))], B, 0.5)[2:]
    for _, ((u, ns, state), (ui, nsi, _)) in run_workers(worker, g0).items():
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), u, ui)
        np.testing.assert_allclose(ns, ratio, rtol=1e-5)
        np.testing.assert_allclose(nsi, ratio, rtol=1e-5)
        assert isinstance(state[0], NoiseScaleState)


def test_noise_scale_finder():
    def fake(value):
        z = jnp.zeros(())
        return NoiseScaleState(jnp.int32(1), z, z, z, z, jnp.float32(value), None)

    assert noise_scale(optax.sgd(0.1).init(jnp.zeros(3))) is None
    assert noise_scale(()) is None
    nested = (optax.EmptyState(), {"a": [fake(3.0)], "b": fake(5.0)})
    assert float(noise_scale(nested)) == 3.0
    assert float(jax.jit(noise_scale)(nested)) == 3.0  # also under tracing


COLL4 = AxisCollective("workers", 4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(local_batch_size=0), "local_batch_size must be an int >= 1"),
        (dict(local_batch_size=-2), "local_batch_size"),
        (dict(local_batch_size=2.5), "local_batch_size"),
        (dict(local_batch_size=8.0), "local_batch_size"),
        (dict(local_batch_size=True), "local_batch_size"),
        (dict(local_batch_size="8"), "local_batch_size"),
        (dict(local_batch_size=None), "local_batch_size"),
        (dict(local_batch_size=jnp.float32(8)), "local_batch_size"),
        (dict(local_batch_size=8, ema=-0.1), r"ema must be a number in \[0, 1\)"),
        (dict(local_batch_size=8, ema=False), r"ema must be a number in \[0, 1\)"),
        (dict(local_batch_size=8, ema=1.0), "ema"),
        (dict(local_batch_size=8, ema=float("nan")), "ema"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gradient_noise_scale(collective=COLL4, **kwargs)


def test_accepts_integer_scalars():
    # Any integer type is a batch size, and the one used: S is the oracle's for it.
    g0 = [flat(step_grads(GRADS, 0))]
    for b in (1, np.int64(8), jnp.int32(3)):
        s = oracle(g0, int(b), 0.0)[3]
        for _, (_, state) in run_steps(0.0, GRADS, 1, b=b).items():
            np.testing.assert_allclose(state.s, s, rtol=1e-5)


def test_single_worker_is_rejected():
    with pytest.raises(ValueError, match="collective must have size >= 2"):
        gradient_noise_scale(collective=AxisCollective("workers", 1), local_batch_size=8)
