"""shoal.optim.demo against a NumPy float64 oracle of DeMo's equations, on simulated workers
and under mpiexec -n 4 (the tests marked mpi are rank-agnostic)."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import n_workers, run_workers, world
from jax import lax
from parabola_cases import START, TARGET, descend, on_workers

from shoal.comms import AxisCollective, wire_bytes
from shoal.kernels.dct_reference import dct_matrix
from shoal.optim import allreduce_gradients
from shoal.optim._demo import DeMoState, chunk_length, demo

N = n_workers()
STEPS = 4
CHUNK, TOPK, BETA = 4, 3, 0.9
# A matrix whose columns the chunk size does not divide (6 -> chunks of 3), a vector it
# divides, a vector where it does not (10 -> chunks of 2, so topk is clamped to 2), and a
# 3-D leaf (seen as [6, 4]).
SHAPES = {"m": (8, 6), "v": (12,), "u": (10,), "t": (2, 3, 4)}
RNG = np.random.default_rng(7)
GRADS = {k: RNG.normal(size=(N, STEPS, *s)).astype(np.float32) for k, s in SHAPES.items()}
TOL = dict(rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------- NumPy float64 oracle


def dct_np(n):
    """Orthonormal DCT-II from its definition, float64, by loops (rows are frequencies)."""
    d = np.zeros((n, n))
    for k in range(n):
        scale = np.sqrt(1.0 / n) if k == 0 else np.sqrt(2.0 / n)
        for j in range(n):
            # cos(pi/2 + m pi) is 0, not np.cos's 6e-17 (the middle of an odd n).
            zero = (2 * j + 1) * k % (2 * n) == n
            d[k, j] = 0.0 if zero else scale * np.cos(np.pi * (2 * j + 1) * k / (2 * n))
    return d


def chunk_len(n, c):
    return max(d for d in range(1, c + 1) if n % d == 0)


def as_matrix(shape):
    size = int(np.prod(shape))
    return (1, size) if len(shape) <= 1 else (size // shape[-1], shape[-1])


def chunks_of(shape, c):
    rows, cols = as_matrix(shape)
    h, w = chunk_len(rows, c), chunk_len(cols, c)
    return rows, cols, h, w


def extract_np(m, shape, c, topk):
    """Top-k DCT components of every chunk of ``m``: returns IDCT(q) (m's shape)."""
    rows, cols, h, w = chunks_of(shape, c)
    k = min(topk, h * w)
    dh, dw = dct_np(h), dct_np(w)
    x = m.reshape(rows, cols)
    out = np.zeros_like(x)
    for p in range(rows // h):
        for q in range(cols // w):
            block = x[p * h : (p + 1) * h, q * w : (q + 1) * w]
            coef = (dh @ block @ dw.T).ravel()
            keep = np.argsort(-np.abs(coef), kind="stable")[:k]
            sparse = np.zeros_like(coef)
            sparse[keep] = coef[keep]
            out[p * h : (p + 1) * h, q * w : (q + 1) * w] = dh.T @ sparse.reshape(h, w) @ dw
    return out.reshape(m.shape)


def oracle(grads, beta, c, topk, sign):
    """DeMo in float64 on every worker; returns per leaf updates [steps, ...] (the same on
    every worker) and momenta [workers, steps, ...] after every step."""
    updates, momenta = {}, {}
    for key, g in grads.items():
        workers, steps = g.shape[:2]
        m = np.zeros(g.shape[:1] + g.shape[2:])
        ups, moms = [], []
        for t in range(steps):
            sent = []
            for i in range(workers):
                m[i] = beta * m[i] + g[i, t]
                q = extract_np(m[i], g.shape[2:], c, topk)
                m[i] = m[i] - q
                sent.append(q)
            mean = np.mean(sent, axis=0)
            ups.append(np.sign(mean) if sign else mean)
            moms.append(m.copy())
        updates[key] = np.stack(ups)
        momenta[key] = np.stack(moms, axis=1)
    return updates, momenta


def payload_bytes(shapes, c, topk):
    """Hand count: per chunk k float32 values + k int32 indices."""
    total = 0
    for shape in shapes.values():
        rows, cols, h, w = chunks_of(shape, c)
        total += (rows // h) * (cols // w) * min(topk, h * w) * 8
    return total


# ---------------------------------------------------------------- workers


def worker_fn(steps, **kwargs):
    """Worker fn: ``steps`` DeMo updates on this worker's fixed gradients. Returns per step
    the updates, the momentum before the step (``beta m + g``) and after it, the step's
    wire bytes and the mean over workers of what left the momentum."""

    def worker(coll, grads):
        tx = demo(collective=coll, **kwargs)
        state = tx.init(jax.tree.map(lambda g: jnp.zeros(g.shape[1:]), grads))
        beta = kwargs.get("momentum", 0.999)

        def body(s, g):
            before = jax.tree.map(lambda m, x: beta * m + x, s.momentum, g)
            u, s = tx.update(g, s)
            left = jax.tree.map(jnp.subtract, before, s.momentum)
            return s, (u, before, s.momentum, wire_bytes(s, "step"), coll.all_reduce(left))

        state, traj = lax.scan(body, state, grads)
        return traj, state

    return worker


def run(steps=STEPS, grads=GRADS, **kwargs):
    return run_workers(worker_fn(steps, **kwargs), grads)


# ---------------------------------------------------------------- tests


@pytest.mark.mpi
@pytest.mark.parametrize("sign", [True, False])
def test_matches_oracle(sign):
    out = run(chunk_size=CHUNK, topk=TOPK, momentum=BETA, sign=sign)
    want_u, want_m = oracle(GRADS, BETA, CHUNK, TOPK, sign)
    for rank, ((updates, _, after, _, _), state) in out.items():
        for key in SHAPES:
            if sign:
                np.testing.assert_array_equal(np.asarray(updates[key]), want_u[key], err_msg=key)
            else:
                np.testing.assert_allclose(updates[key], want_u[key], **TOL, err_msg=key)
            np.testing.assert_allclose(after[key], want_m[key][rank], **TOL, err_msg=key)
        assert isinstance(state, DeMoState)
        assert int(state.step) == STEPS
        # The momentum keeps what was not sent: not zero, except where every coefficient
        # is sent ("u": chunks of 2, k clamped to 2).
        for key in ("m", "v", "t"):
            assert np.abs(np.asarray(state.momentum[key])).max() > 0.1, key
        np.testing.assert_allclose(state.momentum["u"], 0.0, atol=1e-5)


@pytest.mark.mpi
def test_all_coefficients_without_sign_is_synchronous_sgd():
    """topk = chunk elements, sign=False. Every coefficient is sent, so the extraction
    empties the momentum, ``m_{i,t} = m'_{i,t} - IDCT(DCT(m'_{i,t})) = 0`` with
    ``m'_{i,t} = beta m_{i,t-1} + g_{i,t}``; by induction ``m'_{i,t} = g_{i,t}`` and
    ``u_t = (1/N) sum_i m'_{i,t} = (1/N) sum_i g_{i,t}``: the S-SGD update, whatever
    beta."""
    out = run(chunk_size=CHUNK, topk=CHUNK * CHUNK, momentum=BETA, sign=False)

    def ssgd(coll, grads):
        tx = allreduce_gradients(collective=coll)
        state = tx.init(jax.tree.map(lambda g: g[0], grads))
        return lax.scan(lambda s, g: tx.update(g, s)[::-1], state, grads)[1]

    want = run_workers(ssgd, GRADS)
    mean = {k: g.astype(np.float64).mean(0) for k, g in GRADS.items()}
    for rank, ((updates, before, after, _, _), _) in out.items():
        for key in SHAPES:
            np.testing.assert_allclose(updates[key], want[rank][key], **TOL, err_msg=key)
            np.testing.assert_allclose(updates[key], mean[key], **TOL, err_msg=key)
            np.testing.assert_allclose(before[key], GRADS[key][rank], **TOL, err_msg=key)
            np.testing.assert_allclose(after[key], 0.0, atol=1e-5, err_msg=key)


@pytest.mark.mpi
def test_conservation_what_leaves_the_momentum_is_what_is_sent():
    """``m_before = m_after + IDCT(q)`` with ``q`` the top-k of ``DCT(m_before)`` per chunk,
    and the mean over workers of ``IDCT(q_i)`` is the unsigned update."""
    out = run(chunk_size=CHUNK, topk=TOPK, momentum=BETA, sign=False)
    for (updates, before, after, _, mean_left), _ in out.values():
        for key, shape in SHAPES.items():
            for t in range(STEPS):
                b = np.asarray(before[key][t], np.float64)
                sent = extract_np(b, shape, CHUNK, TOPK)
                np.testing.assert_allclose(after[key][t] + sent, b, **TOL, err_msg=key)
                np.testing.assert_allclose(b - after[key][t], sent, **TOL, err_msg=key)
            np.testing.assert_allclose(mean_left[key], updates[key], **TOL, err_msg=key)


def test_one_worker_conservation_is_exact_up_to_rounding():
    coll = AxisCollective("one", 1)
    grads = jax.tree.map(lambda g: g[:1], GRADS)
    (updates, before, after, _, _), _ = jax.jit(
        jax.vmap(
            lambda g: worker_fn(STEPS, chunk_size=CHUNK, topk=TOPK, sign=False)(coll, g),
            axis_name="one",
        )  # fmt: skip
    )(grads)
    for key in SHAPES:
        np.testing.assert_allclose(after[key] + updates[key], before[key], rtol=1e-6, atol=1e-6)


@pytest.mark.mpi
def test_wire_bytes_exact():
    out = run(chunk_size=CHUNK, topk=TOPK)
    # m (8, 6): chunks 4 x 3, 2 x 2 = 4 chunks, k = 3 -> 12 coefficients
    # v (12,): chunks of 4, 3 chunks, k = 3 -> 9
    # u (10,): chunks of 2, 5 chunks, k = min(3, 2) = 2 -> 10
    # t (2, 3, 4) as [6, 4]: chunks 3 x 4, 2 chunks, k = 3 -> 6
    payload = (12 + 9 + 10 + 6) * (4 + 4)
    assert payload == payload_bytes(SHAPES, CHUNK, TOPK) == 296
    gather = (N - 1) * payload  # all-gather: the own part to each of N - 1 peers
    for (_, _, _, wire, _), state in out.values():
        assert np.asarray(wire.sent).tolist() == [gather] * STEPS
        assert np.asarray(wire.received).tolist() == [gather] * STEPS
        total = STEPS * gather
        assert (int(state.wire.total.sent), int(state.wire.total.received)) == (total, total)


def test_chunk_rule_follows_the_reference():
    """The largest divisor of each dimension that is <= chunk_size (bytes tell the chunks)."""
    coll = AxisCollective("w", 2)
    # (127,): a prime above 64 -> chunks of 1, k = 1; (96,): chunks of 48, k = 32;
    # (5, 7): shorter than 64 -> one 5 x 7 chunk, k = 32; (0, 3): nothing to send.
    shapes = {"p": (127,), "d": (96,), "s": (5, 7), "e": (0, 3)}
    assert [chunk_length(n, 64) for n in (127, 96, 5, 7, 64)] == [1, 48, 5, 7, 64]
    params = {k: jnp.ones((2, *s)) for k, s in shapes.items()}
    tx = demo(collective=coll)

    def step(p):
        u, s = tx.update(p, tx.init(p))
        return u, s

    u, s = jax.vmap(step, axis_name="w")(params)
    payload = (127 * 1 + 2 * 32 + 32) * 8
    assert payload == payload_bytes({k: v for k, v in shapes.items() if k != "e"}, 64, 32)
    assert np.asarray(s.wire.step.sent).tolist() == [payload] * 2
    assert u["e"].shape == (2, 0, 3)
    # A constant gradient is all DC: every update is +1.
    for key in ("p", "d", "s"):
        np.testing.assert_array_equal(np.asarray(u[key]), 1.0)


def test_chained_with_sgd_descends():
    """``optax.chain(demo(...), optax.sgd(lr))`` steps params by ``-lr sign(Q)``."""
    coll = AxisCollective("w", 2)
    tx = optax.chain(demo(collective=coll, chunk_size=2, topk=1), optax.sgd(0.5))
    params = jnp.zeros((2, 4))
    grads = jnp.array([[1.0, 1.0, -2.0, -2.0], [3.0, 3.0, -1.0, -1.0]])

    def step(p, g):
        u, _ = tx.update(g, tx.init(p), p)
        return optax.apply_updates(p, u)

    new = jax.jit(jax.vmap(step, axis_name="w"))(params, grads)
    np.testing.assert_array_equal(np.asarray(new), [[-0.5, -0.5, 0.5, 0.5]] * 2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(chunk_size=0), r"chunk_size must be an int >= 1"),
        (dict(chunk_size=4.0), r"chunk_size must be an int >= 1"),
        (dict(chunk_size=True), r"chunk_size must be an int >= 1"),
        (dict(topk=0), r"topk must be an int in \[1, 4096\]"),
        (dict(topk=4097), r"topk must be an int in \[1, 4096\]"),
        (dict(chunk_size=4, topk=17), r"topk must be an int in \[1, 16\].*chunk_size \*\* 2"),
        (dict(topk=2.5), r"topk must be an int"),
        (dict(momentum=1.0), r"momentum must be a number in \[0, 1\)"),
        (dict(momentum=-0.1), r"momentum must be a number in \[0, 1\)"),
        (dict(momentum=True), r"momentum must be a number in \[0, 1\)"),
        (dict(momentum=jnp.asarray(1.5)), r"momentum must be a number in \[0, 1\)"),
        (dict(sign="yes"), r"sign must be True or False"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        demo(collective=world(), **kwargs)


def test_update_checks_the_state_and_tree():
    tx = demo(collective=AxisCollective("w", 1))
    with pytest.raises(TypeError, match="demo: update got"):
        tx.update({"w": jnp.zeros(3)}, optax.EmptyState())
    state = jax.vmap(tx.init)({"w": jnp.zeros((1, 3))})
    with pytest.raises(ValueError, match="demo: the gradient"):
        jax.vmap(tx.update, axis_name="w")({"w": jnp.zeros((1, 4))}, state)


@pytest.mark.parametrize("n", range(1, 18))
def test_dct_basis_is_exactly_zero_where_the_cosine_is(n):
    """Where ``(2 j + 1) k`` is an odd multiple of ``n`` the basis entry is 0 exactly, in
    float64 and once cast to float32; every other entry matches the definition, and
    entries of equal magnitude are bitwise equal (a zero coefficient keeps sign 0)."""
    d = dct_matrix(n)
    k, j = np.arange(n)[:, None], np.arange(n)[None, :]
    zero = (2 * j + 1) * k % (2 * n) == n
    assert (d[zero] == 0).all() and (d[~zero] != 0).all()
    assert (np.asarray(jnp.asarray(d, jnp.float32))[zero] == 0).all()
    np.testing.assert_allclose(d, dct_np(n), rtol=0, atol=1e-14)  # folded: more exact
    np.testing.assert_allclose(d @ d.T, np.eye(n), rtol=0, atol=1e-14)
    mags = np.abs(d[1:])  # rows k >= 1 share the scale sqrt(2/n)
    for v in np.unique(np.round(mags, 12)):
        assert len(np.unique(mags[np.round(mags, 12) == v])) == 1


def test_zero_coefficient_takes_no_step():
    """The issue's reproducer: an odd-length chunk's middle element has a zero basis value
    at odd frequencies, so the top-1 component moves it by sign(0) = 0, as the reference
    DeMo does; a 6e-17 basis entry used to step it by +1."""
    tx = demo(collective=AxisCollective("workers", 1), chunk_size=8, topk=1)
    g = jnp.array([[[2.0, 1.0, 0.0, -1.0, -2.0]]])
    u = jax.vmap(lambda g: tx.update(g, tx.init(g), g)[0], axis_name="workers")(g)
    np.testing.assert_array_equal(u[0], [[1.0, 1.0, 0.0, -1.0, -1.0]])


def test_docstring_example_runs():
    tests = doctest.DocTestFinder(recurse=False).find(demo, "demo", globs={})
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0 and result.attempted > 0


def test_optimises_parabola():
    """optax's contract test: signum steps with a decaying rate reach the optimum."""
    coll = AxisCollective("workers", 4)
    tx = optax.chain(demo(collective=coll), optax.sgd(optax.linear_schedule(0.05, 0.0, 1500)))
    p = on_workers(jax.jit(lambda p: descend(tx, p, 1500)), START, n=4)
    np.testing.assert_allclose(p, np.broadcast_to(TARGET, (4, 3)), rtol=3e-2, atol=3e-2)


def test_can_be_wrapped_in_inject_hyperparams():
    """momentum may be injected (traced); chunk_size, topk and sign are static."""
    coll = AxisCollective("workers", 4)
    kwargs = dict(momentum=0.9, chunk_size=4, topk=2)
    params = [-jnp.ones((2, 3)), jnp.ones((2, 5, 2))]
    grads = [jnp.ones((2, 3)), -jnp.ones((2, 5, 2)) * 0.5]
    plain = demo(collective=coll, **kwargs)
    static = ("chunk_size", "topk", "sign")
    injected = optax.inject_hyperparams(demo, static_args=static)(collective=coll, **kwargs)

    def step(tx, g, p):
        return tx.update(g, tx.init(p), p)

    u, s = jax.jit(lambda g, p: on_workers(lambda g, p: step(plain, g, p), g, p, n=4))(
        grads, params
    )
    ui, si = jax.jit(lambda g, p: on_workers(lambda g, p: step(injected, g, p), g, p, n=4))(
        grads, params
    )
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4), u, ui)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4), s, si.inner_state)
