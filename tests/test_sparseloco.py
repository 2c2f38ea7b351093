"""shoal.optim.sparseloco against a NumPy float64 oracle of SparseLoCo's Algorithm 1 (Sarfi
et al. 2025), on simulated workers and under mpiexec -n 4 (the tests marked mpi are
rank-agnostic); TopK's decayed error feedback; SparseLoCo is diloco with that exchange and
a plain SGD outer step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from block_cases import block_worker, flat, linear_problem
from harness import n_workers, run_workers

from shoal.comms import AxisCollective, TopK
from shoal.optim import DiLoCoState, diloco, sparseloco

N = n_workers()
PROBLEM = linear_problem(seed=3, n=N)
X, Y, P0, grad_np = PROBLEM.x, PROBLEM.y, PROBLEM.p0, PROBLEM.grad
LR, MU = 0.1, 0.9  # inner SGD with momentum, kept across rounds
H, ROUNDS = 3, 4
ALPHA, BETA = 0.8, 0.9
CHUNK, DENSITY = 5, 0.4  # 10 values: two chunks of 5, two values sent from each
TOL = dict(rtol=2e-5, atol=2e-5)


def two_bit(sent):
    """The 2-bit quantizer of `shoal.comms.TopK` on one chunk's sent values: a sign and
    s/2 or s, s the largest magnitude; the rounding boundary is |v| = 0.75 s."""
    s = np.abs(sent).max()
    if s == 0:
        return np.zeros_like(sent), np.inf
    j = np.clip(np.round(np.abs(sent) * 2 / s) - 1, 0, 1)
    margin = np.abs(np.abs(sent) / s - 0.75).min()  # distance from the boundary
    return np.sign(sent) * s * (j + 1) / 2, margin


def compress(v):
    """Q(TopK(v)) per chunk of CHUNK (ties: the lower index), and the smallest margins of
    the selection (k-th against (k+1)-th magnitude, relative) and of the rounding."""
    out, margins = np.zeros_like(v), []
    k = int(np.ceil(DENSITY * CHUNK))
    for c in range(0, v.size, CHUNK):
        chunk = v[c : c + CHUNK]
        order = np.argsort(-np.abs(chunk), kind="stable")
        mags = np.abs(chunk)[order]
        margins.append((mags[k - 1] - mags[k]) / mags[0])
        q, m = two_bit(chunk[order[:k]])
        margins.append(m)
        out[c + order[:k]] = q
    return out, min(margins)


def oracle(workers, beta=BETA):
    """SparseLoCo in float64. Every worker runs H inner steps from theta (its momentum
    persists), then ``A_r <- beta A_r + (theta - theta_r)``, sends ``D_r = Q(TopK(A_r))``
    and keeps ``A_r - D_r``; ``theta <- theta - ALPHA mean_r D_r``. Returns theta after
    every round, the residuals after the last, and the smallest decision margin."""
    theta = flat(P0)[0].astype(np.float64)
    mom = np.zeros((workers, theta.size))
    residual = np.zeros((workers, theta.size))
    thetas, margin = [], np.inf
    for _ in range(ROUNDS):
        local = np.tile(theta, (workers, 1))
        for _ in range(H):
            g = np.stack([grad_np(local[i], i) for i in range(workers)])
            mom = MU * mom + g
            local = local - LR * mom
        sent = np.zeros_like(local)
        for r in range(workers):
            v = (theta - local[r]) + beta * residual[r]
            sent[r], m = compress(v)
            residual[r] = v - sent[r]
            margin = min(margin, m)
        theta = theta - ALPHA * sent.mean(0)
        thetas.append(theta.copy())
    return np.stack(thetas), residual, margin


def make(beta=BETA, **kwargs):
    return lambda c: sparseloco(
        optax.sgd(LR, momentum=MU),
        collective=c,
        sync_every=H,
        outer_learning_rate=ALPHA,
        beta=beta,
        density=DENSITY,
        chunk_size=CHUNK,
        **kwargs,
    )


@pytest.mark.mpi
@pytest.mark.parametrize("beta", [BETA, 1.0])
def test_matches_oracle(beta):
    expect, residual, margin = oracle(N, beta)
    # The top-k and the 2-bit rounding are discontinuous: the case is meaningful only if
    # no decision sits within float32 noise of its boundary.
    assert margin > 1e-3, margin
    out = run_workers(block_worker(make(beta), H * ROUNDS), P0, X, Y)
    row = TopK(DENSITY, chunk_size=CHUNK, value_bits=2).row_bytes(10)
    # 4 codes of 2 bits packed in 1 byte, then per chunk a float32 scale and 2 uint16s.
    assert row == 1 + 2 * 4 + 2 * 2 * 2
    for rank, ((params, theta_g, wire), state) in out.items():
        assert isinstance(state, DiLoCoState)
        synced = slice(H - 1, None, H)
        np.testing.assert_allclose(flat(theta_g)[synced], expect, **TOL)
        np.testing.assert_allclose(flat(params)[synced], expect, **TOL)  # restarted
        (memory,) = state.exchange_memory
        np.testing.assert_allclose(memory, residual[rank], **TOL)
        # One all-gather of a row per outer step, nothing on inner steps.
        sent = np.asarray(wire.sent).tolist()
        assert sent == [0, 0, (N - 1) * row] * ROUNDS
        assert int(state.rounds) == ROUNDS
        assert jax.tree.leaves(state.outer_state) == []  # no outer momentum


def test_is_diloco_with_decayed_topk_and_plain_sgd():
    """sparseloco(...) is diloco(outer=sgd(alpha), exchange=TopK(..., error_decay=beta)),
    bit for bit."""
    coll = AxisCollective("workers", N)
    steps = H * ROUNDS
    got = jax.vmap(block_worker(make(), steps), axis_name="workers", in_axes=(None, 0, 0, 0))
    exchange = TopK(DENSITY, chunk_size=CHUNK, value_bits=2, error_decay=BETA)
    want = jax.vmap(
        block_worker(
            lambda c: diloco(
                optax.sgd(LR, momentum=MU),
                collective=c,
                sync_every=H,
                outer=optax.sgd(ALPHA),
                exchange=exchange,
            ),
            steps,
        ),
        axis_name="workers",
        in_axes=(None, 0, 0, 0),
    )
    a, b = got(coll, P0, X, Y), want(coll, P0, X, Y)
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_decay_changes_the_run_and_one_keeps_every_unsent_value():
    """beta matters (the oracle differs at 0.9 and 1), and with beta = 1 the error
    feedback loses nothing: what was sent plus what is kept is the sum of every
    pseudo-gradient, per worker."""
    a, _, _ = oracle(N, BETA)
    b, _, _ = oracle(N, 1.0)
    assert np.abs(a - b).max() > 1e-3
    codec = TopK(DENSITY, chunk_size=CHUNK, value_bits=2)
    coll = AxisCollective("workers", 2)
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(5, 2, 10)), jnp.float32)

    def rounds(xs):
        memory, total = codec.init(10, 2), jnp.zeros(10)
        for x in xs:
            v = x + memory[0]
            y, memory = codec.mean(x, memory, collective=coll)
            total = total + (v - memory[0])  # this worker's sent values
        return total, memory[0]

    sent, kept = jax.vmap(rounds, axis_name="workers", in_axes=1)(xs)
    np.testing.assert_allclose(sent + kept, np.asarray(xs).sum(0), rtol=1e-5, atol=1e-5)


def test_topk_error_decay_scales_the_kept_error():
    """TopK(error_decay=b): the next input is x + b e, e what the last call kept."""
    coll = AxisCollective("workers", 1)
    codec = TopK(0.5, chunk_size=2, error_decay=0.5)
    x = jnp.array([[4.0, 1.0, -2.0, 3.0]])

    def two_calls(x):
        y1, m1 = codec.mean(x, codec.init(4, 1), collective=coll)
        y2, m2 = codec.mean(jnp.zeros(4), m1, collective=coll)
        return y1, m1[0], y2, m2[0]

    y1, e1, y2, e2 = jax.vmap(two_calls, axis_name="workers")(x)
    np.testing.assert_array_equal(y1[0], [4.0, 0.0, 0.0, 3.0])
    np.testing.assert_array_equal(e1[0], [0.0, 1.0, -2.0, 0.0])
    # Second call: v = 0 + 0.5 e1 = [0, 0.5, -1, 0]; the top of each pair is sent.
    np.testing.assert_array_equal(y2[0], [0.0, 0.5, -1.0, 0.0])
    np.testing.assert_array_equal(e2[0], [0.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(beta=0.0), r"beta must be a number in \(0, 1\]"),
        (dict(beta=1.5), r"beta must be a number in \(0, 1\]"),
        (dict(beta=True), r"beta must be a number in \(0, 1\]"),
        (dict(beta="0.9"), r"beta must be a number in \(0, 1\]"),
        (dict(density=0.0), r"density must be a number in \(0, 1\]"),
        (dict(density=2.0), r"density must be a number in \(0, 1\]"),
        (dict(outer_learning_rate=0.0), "outer_learning_rate must be a finite number > 0"),
        (dict(outer_learning_rate=float("nan")), "outer_learning_rate must be a finite"),
        (dict(outer_learning_rate=True), "outer_learning_rate must be a finite number > 0"),
        (dict(chunk_size=0), "chunk_size must be an int >= 1"),
        (dict(value_bits=3), "value_bits must be None or one of"),
        (dict(sync_every=0), "sync_every must be an int >= 1"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    args = dict(collective=AxisCollective("w", 2), sync_every=2) | kwargs
    with pytest.raises(ValueError, match=match):
        sparseloco(optax.sgd(0.1), **args)


def test_topk_error_decay_is_checked():
    for bad in (0.0, 1.5, True, "1"):
        with pytest.raises(ValueError, match=r"error_decay must be a number in \(0, 1\]"):
            TopK(0.1, error_decay=bad)
    with pytest.raises(ValueError, match="needs error_feedback=True"):
        TopK(0.1, error_decay=0.5, error_feedback=False)
