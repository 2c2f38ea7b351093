"""onebit_lamb and onebit_adam against a NumPy oracle of Algorithm 1 (Li et al. 2021;
Tang et al. 2021), across the freeze boundary, on 4 simulated workers, on 1 worker, and
under mpiexec -n 4 (rank-agnostic)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import UNDER_MPI, n_workers, run_workers, world

from shoal.comms import AxisCollective, wire_bytes
from shoal.optim import onebit_adam, onebit_lamb, onebit_moments

N = n_workers()
SHAPES = {"b": (7,), "w": (5, 6)}  # tree_leaves order: b, w; n = 37
STEPS, FREEZE = 10, 4
# Weight decay is local arithmetic: under mpiexec the exchange is checked without it.
WD = [
    pytest.param(0.0, id="no-wd"),
    pytest.param(
        0.01, id="wd", marks=pytest.mark.skipif(UNDER_MPI, reason="checked in one process")
    ),
]
F32 = np.float32


def sign(v):
    return np.where(v >= 0, F32(1), F32(-1))


def ca_oracle(xs, we, se):
    """One compressed all-reduce of xs[P, n]; updates we[P, n_pad], se[P, c] in place."""
    p, n = xs.shape
    n_pad = we.shape[1]
    c = n_pad // p
    scales, signs = [], []
    for i in range(p):
        v = np.concatenate([xs[i], np.zeros(n_pad - n, F32)]) + we[i]
        s = F32(np.sqrt(np.sum(v.astype(np.float64) ** 2) / n_pad))
        we[i] = v - s * sign(v)
        scales.append(s)
        signs.append(sign(v))
    y = np.zeros(n_pad, F32)
    for r in range(p):
        part = slice(r * c, (r + 1) * c)
        m = sum((scales[j] * signs[j][part] for j in range(1, p)), scales[0] * signs[0][part])
        m = m / F32(p) + se[r]
        s_r = F32(np.sqrt(np.mean(m.astype(np.float64) ** 2)))
        se[r] = m - s_r * sign(m)
        y[part] = s_r * sign(m)
    return y[:n]


def norm(x):
    return F32(np.sqrt(np.sum(x.astype(np.float64) ** 2)))


def lamb_oracle(params, grads, lr, wd, mask=None, b1=0.9, b2=0.999, eps=1e-8):
    """Algorithm 1 of 1-bit LAMB for grads[P][T] (lists of leaf lists), params: leaf list.

    Returns the params after each step [T][leaves] (identical on every worker)."""
    max_c, min_c, cbeta, fmax, fmin, thr = 10.0, 0.01, 0.9, 4.0, 0.5, 0.1
    p_workers = len(grads)
    L = len(params)
    p = [x.astype(F32).copy() for x in params]
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    v_fresh = [np.zeros_like(x) for x in p]
    coeff_avg = [F32(0)] * L
    last = [F32(1)] * L
    scale = [F32(1)] * L
    n = sum(x.size for x in p)
    unit = p_workers * math.lcm(p_workers, 8)
    n_pad = -(-n // unit) * unit
    we = np.zeros((p_workers, n_pad), F32)
    se = np.zeros((p_workers, n_pad // p_workers), F32)
    history = []
    for t in range(1, STEPS + 1):
        rate = F32(lr(t - 1) if callable(lr) else lr)
        if t <= FREEZE:
            for k in range(L):
                g = np.mean([grads[i][t - 1][k] for i in range(p_workers)], axis=0, dtype=F32)
                m[k] = b1 * m[k] + (1 - b1) * g
                v[k] = b2 * v[k] + (1 - b2) * g * g
                u = m[k] / (np.sqrt(v[k]) + eps) + wd * p[k]
                pn, un = norm(p[k]), norm(u)
                c = np.clip(pn / un, min_c, max_c) if pn > 0 and un > 0 else 1.0
                if c != 1.0:
                    coeff_avg[k] = cbeta * coeff_avg[k] + (1 - cbeta) * c
                p[k] = p[k] - rate * c * u
                if t == FREEZE:
                    v_fresh[k] = v[k].copy()
        else:
            if t == FREEZE + 1:
                r = [norm(x) / np.sqrt(x.size) for x in m]
                united = np.mean(r)
                scale = [united / x if x > 0 else 1.0 for x in r]
            m_last = [x.copy() for x in m]
            local = np.stack(
                [
                    np.concatenate(
                        [((b1 * m[k] + (1 - b1) * grads[i][t - 1][k]) * scale[k]).ravel()
                         for k in range(L)]
                    )
                    for i in range(p_workers)
                ]
            ).astype(F32)  # fmt: skip
            flat = ca_oracle(local, we, se)
            start = 0
            for k in range(L):
                m[k] = flat[start : start + p[k].size].reshape(p[k].shape) / scale[k]
                if mask is not None:
                    m[k] = m[k] * mask[k]
                start += p[k].size
                g_rec = (m[k] - b1 * m_last[k]) / (1 - b1)
                v_fresh[k] = b2 * v_fresh[k] + (1 - b2) * g_rec**2
                denom = np.sqrt(v[k]) + eps
                u_pre = m[k] / denom
                u = u_pre + wd * p[k]
                f = np.max(denom / (np.sqrt(v_fresh[k]) + eps))
                if wd > 0:
                    ratio = min(1.0, norm(u_pre) / norm(u))
                    f = f * ratio + (1 - ratio)
                f = np.clip(f, fmin, fmax)
                f = np.clip(f, last[k] * (1 - thr), last[k] * (1 + thr))
                last[k] = f
                p[k] = p[k] - rate * coeff_avg[k] * f * u
        history.append([x.copy() for x in p])
    return history


def adam_oracle(params, grads, lr, wd, b1=0.9, b2=0.999, eps=1e-8):
    p_workers = len(grads)
    p = [x.astype(F32).copy() for x in params]
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    n = sum(x.size for x in p)
    unit = p_workers * math.lcm(p_workers, 8)
    n_pad = -(-n // unit) * unit
    we = np.zeros((p_workers, n_pad), F32)
    se = np.zeros((p_workers, n_pad // p_workers), F32)
    history = []
    for t in range(1, STEPS + 1):
        if t <= FREEZE:
            for k in range(len(p)):
                g = np.mean([grads[i][t - 1][k] for i in range(p_workers)], axis=0, dtype=F32)
                m[k] = b1 * m[k] + (1 - b1) * g
                v[k] = b2 * v[k] + (1 - b2) * g * g
        else:
            local = np.stack(
                [
                    np.concatenate(
                        [(b1 * m[k] + (1 - b1) * grads[i][t - 1][k]).ravel() for k in range(len(p))]
                    )
                    for i in range(p_workers)
                ]
            ).astype(F32)
            flat = ca_oracle(local, we, se)
            start = 0
            for k in range(len(p)):
                m[k] = flat[start : start + p[k].size].reshape(p[k].shape)
                start += p[k].size
        for k in range(len(p)):
            p[k] = p[k] - lr * (m[k] / (np.sqrt(v[k]) + eps) + wd * p[k])
        history.append([x.copy() for x in p])
    return history


def make_problem(workers, seed=0):
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(size=s).astype(F32) for k, s in SHAPES.items()}
    # A shared drift plus per-worker noise, so that momenta have a direction to track.
    drift = {k: rng.normal(size=s) for k, s in SHAPES.items()}
    grads = {
        k: (drift[k] + 0.5 * rng.normal(size=(workers, STEPS, *s))).astype(F32)
        for k, s in SHAPES.items()
    }
    return params, grads


def to_oracle(params, grads):
    leaves = jax.tree.leaves(params)
    g = jax.tree.leaves(grads)
    workers = g[0].shape[0]
    return leaves, [[[x[i, t] for x in g] for t in range(STEPS)] for i in range(workers)]


def run_tx(make_tx, params, grads, collective=None, whole=False):
    """{rank: (params after each step [T], final state)}; ``whole``: and the moments read
    whole at the end (`shoal.optim.onebit_moments`)."""

    def worker(coll, g):
        tx = make_tx(coll)
        p = jax.tree.map(jnp.asarray, params)
        state = tx.init(p)
        hist = []
        for t in range(STEPS):
            u, state = tx.update(jax.tree.map(lambda x, t=t: x[t], g), state, p)
            p = optax.apply_updates(p, u)
            hist.append(p)
        hist = jax.tree.map(lambda *x: jnp.stack(x), *hist)
        return (hist, state, onebit_moments(state, p, collective=coll)) if whole else (hist, state)

    return run_workers(worker, grads, collective=collective)


def check_history(out, expected, rtol=2e-5, atol=2e-6):
    for hist, _ in out.values():
        got = jax.tree.leaves(hist)
        for t in range(STEPS):
            for k, leaf in enumerate(got):
                np.testing.assert_allclose(
                    np.asarray(leaf[t]), expected[t][k], rtol=rtol, atol=atol,
                    err_msg=f"step {t + 1}, leaf {k}",
                )  # fmt: skip


@pytest.mark.mpi
@pytest.mark.parametrize("wd", WD)
def test_onebit_lamb_matches_oracle(wd):
    params, grads = make_problem(N, seed=1)
    lr = 0.02
    out = run_tx(
        lambda c: onebit_lamb(lr, collective=c, freeze_step=FREEZE, weight_decay=wd),
        params,
        grads,
    )
    check_history(out, lamb_oracle(*to_oracle(params, grads), lr, wd))
    for _, state in out.values():
        assert int(state.count) == STEPS
        # coeff_avg moved, factors stayed within the threshold band of 1.
        assert all(0 < float(c) for c in jax.tree.leaves(state.coeff_avg))
        for f in jax.tree.leaves(state.last_factor):
            assert 0.5 <= float(f) <= 1.1 ** (STEPS - FREEZE) + 1e-6


@pytest.mark.parametrize("wd", [0.0, 0.01], ids=["no-wd", "wd"])
def test_onebit_lamb_one_worker_with_schedule(wd):
    params, grads = make_problem(1, seed=2)
    lr = optax.linear_schedule(0.03, 0.01, STEPS)
    coll = AxisCollective("solo", 1)
    out = run_tx(
        lambda c: onebit_lamb(lr, collective=c, freeze_step=FREEZE, weight_decay=wd),
        params,
        grads,
        collective=coll,
    )
    check_history(out, lamb_oracle(*to_oracle(params, grads), lr, wd))


@pytest.mark.mpi
def test_onebit_lamb_momentum_mask():
    params, grads = make_problem(N, seed=3)
    grads["b"][:, :, 2:] = 0.0  # structurally zero part of a leaf
    mask = {"b": (np.arange(7) < 2).astype(F32), "w": np.ones((5, 6), F32)}
    out = run_tx(
        lambda c: onebit_lamb(0.02, collective=c, freeze_step=FREEZE, momentum_mask=mask),
        params,
        grads,
        whole=True,
    )
    leaves, g = to_oracle(params, grads)
    expected = lamb_oracle(leaves, g, 0.02, 0.0, mask=jax.tree.leaves(mask))
    check_history({r: o[:2] for r, o in out.items()}, expected)
    for hist, _, whole in out.values():
        assert np.asarray(whole["mu"]["b"])[:2].all()
        assert not np.asarray(whole["mu"]["b"])[2:].any()
        # Masked elements of b never move after the freeze (no weight decay).
        b = np.asarray(hist["b"])
        np.testing.assert_array_equal(b[FREEZE:, 2:], b[FREEZE - 1 : FREEZE, 2:].repeat(6, 0))


@pytest.mark.mpi
@pytest.mark.parametrize("wd", WD)
def test_onebit_adam_matches_oracle(wd):
    params, grads = make_problem(N, seed=4)
    out = run_tx(
        lambda c: onebit_adam(0.01, collective=c, freeze_step=FREEZE, weight_decay=wd),
        params,
        grads,
    )
    check_history(out, adam_oracle(*to_oracle(params, grads), 0.01, wd))


@pytest.mark.mpi
def test_wire_bytes_per_stage():
    params, grads = make_problem(N, seed=5)
    tx = onebit_lamb(0.01, collective=world(), freeze_step=1)

    def worker(coll, g):
        p = jax.tree.map(jnp.asarray, params)
        state = tx.init(p)
        _, s1 = tx.update(jax.tree.map(lambda x: x[0], g), state, p)
        _, s2 = tx.update(jax.tree.map(lambda x: x[1], g), s1, p)
        return wire_bytes(s1, "step"), wire_bytes(s2, "step"), wire_bytes(s2, "total")

    n = 37
    dense = 2 * (N - 1) * (4 * n) // N  # ring all-reduce of the float32 gradient
    # n_pad = 64 for 4 workers (48 for 2): chunks of 16 signs = 2 bytes, +4 bytes of
    # scale, each all-to-all'd and all-gathered: 2 (P-1) (2 + 4) bytes each way.
    unit = N * math.lcm(N, 8)
    n_pad = -(-n // unit) * unit
    compressed = 2 * (N - 1) * (n_pad // N // 8 + 4)
    for w1, w2, total in run_workers(worker, grads).values():
        assert int(w1.sent) == int(w1.received) == dense
        assert int(w2.sent) == int(w2.received) == compressed
        assert int(total.sent) == int(total.received) == dense + compressed
    if N == 4:
        assert (dense, compressed) == (222, 36)


def test_volume_reduction_for_a_large_model():
    """Compression-stage bytes against a float32 all-reduce, for 2**22 parameters."""
    from shoal.comms import OneBit
    from shoal.comms.wire import all_reduce_bytes

    n = 1 << 22
    ratio = all_reduce_bytes(4 * n, 4)[0] / OneBit().wire_bytes(n, 4)[0]
    assert 31.9 < ratio <= 32


def _primitives(jaxpr):
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
            names |= _primitives(sub)
        for p in eqn.params.values():
            for j in p if isinstance(p, (tuple, list)) else (p,):
                if hasattr(j, "jaxpr"):
                    names |= _primitives(j.jaxpr)
    return names


@pytest.mark.mpi
def test_stages_are_real_branches():
    """With a rank-uniform (unbatched) counter the stages are two in-place branches
    (`run_if`: a loop of 0 or 1 trips each): warm-up all-reduces, compression exchanges
    signs, never both. (Under vmap an all-to-all/all-gather becomes a transpose/broadcast,
    so only MPI shows them.)"""
    params, grads = make_problem(N, seed=6)
    tx = onebit_lamb(0.01, collective=world(), freeze_step=2)
    state = tx.init(params)
    g0 = jax.tree.map(lambda x: x[:, 0], grads)
    if UNDER_MPI:
        update = lambda g, s: tx.update(g, s, params)
        g0 = jax.tree.map(lambda x: x[0], g0)
    else:
        update = jax.vmap(
            lambda g, s: tx.update(g, s, params), in_axes=(0, None), axis_name="workers"
        )
    jaxpr = jax.make_jaxpr(update)(g0, state).jaxpr
    loops = [e for e in jaxpr.eqns if e.primitive.name == "while"]
    assert len(loops) == 2
    for e in loops:  # the predicate (first carry) is one scalar, not one per worker
        pred = e.invars[e.params["cond_nconsts"] + e.params["body_nconsts"]]
        assert pred.aval.shape == () and pred.aval.dtype == bool
    warmup, compressed = (_primitives(e.params["body_jaxpr"].jaxpr) for e in loops)
    # Under vmap the simulated all-reduce is a dot with a ones vector over the gathered rows.
    marks = ("psum", "allreduce") if UNDER_MPI else ("dot_general",)
    reduces = lambda names: any(k in x for x in names for k in marks)
    exchanges = lambda names: any(k in x for x in names for k in ("alltoall", "allgather"))
    assert reduces(warmup) and not reduces(compressed)
    assert "bitcast_convert_type" in compressed  # the scales travel as bytes
    if UNDER_MPI:
        assert exchanges(compressed) and not exchanges(warmup)


def test_params_required():
    tx = onebit_lamb(0.01, collective=AxisCollective("w", 1), freeze_step=1)
    state = tx.init({"w": jnp.zeros(3)})
    with pytest.raises(ValueError, match="needs params"):
        tx.update({"w": jnp.zeros(3)}, state)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"freeze_step": 0}, "freeze_step must be an int >= 1"),
        ({"freeze_step": 2.0}, "freeze_step must be an int >= 1"),
        ({"min_coeff": 5.0, "max_coeff": 1.0}, "min_coeff .* must not exceed max_coeff"),
        ({"factor_min": 2.0, "factor_max": 1.0}, "factor_min .* must not exceed factor_max"),
        ({"b1": 1.0}, r"b1 must be in \[0.0, 1.0\)"),
        ({"b2": -0.1}, r"b2 must be in \[0.0, 1.0\)"),
        ({"eps": 0.0}, r"eps must be in \(0.0"),
        ({"weight_decay": -1.0}, "weight_decay must be in"),
        ({"coeff_beta": 1.0}, "coeff_beta must be in"),
        ({"factor_threshold": -0.1}, "factor_threshold must be in"),
        ({"learning_rate": -0.1}, "learning_rate must be in"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    args = {"learning_rate": 0.01, "freeze_step": 3}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        onebit_lamb(collective=AxisCollective("w", 2), **args)


@pytest.mark.parametrize("factory", [onebit_lamb, onebit_adam])
def test_non_float_leaves_rejected(factory):
    coll = AxisCollective("w", 1)
    tx = factory(0.01, collective=coll, freeze_step=1)
    with pytest.raises(ValueError, match=r"params must be floating point; leaf \['i'\]"):
        tx.init({"i": jnp.zeros(3, jnp.int32), "x": jnp.zeros(2)})
    with pytest.raises(ValueError, match="freeze_step"):
        factory(0.01, collective=coll, freeze_step=0)
    with pytest.raises(TypeError, match="not a callable"):
        factory(0.01, collective=lambda x: x, freeze_step=1)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", [onebit_lamb, onebit_adam], ids=lambda f: f.__name__)
def test_moments_held_once_on_simulated_workers(algorithm):
    """Under vmap each worker holds one chunk of m, v (and v_fresh): worker r elements [r c,
    (r + 1) c) of each leaf's padded ravel, c = ceil(numel / P), so the N workers hold one
    copy; under MPI each holds them whole. `onebit_moments` reads them whole, the same everywhere,
    and the oracle tests above pass on both layouts."""
    params, grads = make_problem(N, seed=4)  # leaves of 7 and 30: 7 does not cut into 4
    out = run_tx(lambda c: algorithm(0.02, collective=c, freeze_step=FREEZE), params, grads,
                 whole=True)  # fmt: skip
    fields = ("mu", "nu", "nu_fresh") if algorithm is onebit_lamb else ("mu", "nu")
    wholes = [w for _, _, w in out.values()]
    for f in fields:
        for name, p in params.items():
            got = np.asarray(wholes[0][f][name])
            assert got.shape == p.shape and np.abs(got).max() > 0
            for w in wholes[1:]:
                np.testing.assert_array_equal(np.asarray(w[f][name]), got)
            held = [np.asarray(getattr(state, f)[name]) for _, state, _ in out.values()]
            if UNDER_MPI:
                np.testing.assert_array_equal(held[0], got)
                continue
            c = -(-p.size // N)
            assert all(h.shape == (c,) for h in held)
            np.testing.assert_array_equal(np.concatenate(held)[: p.size], got.ravel())
