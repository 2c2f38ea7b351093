"""OneBit().mean against a NumPy oracle of the two-phase 1-bit all-reduce (1-bit
Adam/LAMB), on simulated workers (P = 1..4) and under mpiexec -n 4."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import UNDER_MPI, n_workers, run_workers

from shoal.comms import AxisCollective, OneBit
from shoal.comms.wire import all_reduce_bytes


def sign(v):
    return np.where(v >= 0, np.float32(1), np.float32(-1))


def oracle(x):
    """x[T, P, n] float32 -> outputs [T, n], worker errors [P, n_pad], server [P, c]."""
    steps, p, n = x.shape
    unit = p * p * 8 // math.gcd(p, 8)
    n_pad = -(-n // unit) * unit
    c = n_pad // p
    we = np.zeros((p, n_pad), np.float32)
    se = np.zeros((p, c), np.float32)
    ys = []
    for t in range(steps):
        scales, signs = [], []
        for i in range(p):
            v = np.zeros(n_pad, np.float32)
            v[:n] = x[t, i]
            v = v + we[i]
            s = np.sqrt(np.sum(v.astype(np.float64) ** 2) / n_pad).astype(np.float32)
            we[i] = v - s * sign(v)
            scales.append(s)
            signs.append(sign(v))
        y = np.zeros(n_pad, np.float32)
        for r in range(p):
            part = slice(r * c, (r + 1) * c)
            m = scales[0] * signs[0][part]
            for j in range(1, p):
                m = m + scales[j] * signs[j][part]
            m = m / np.float32(p) + se[r]
            s_r = np.sqrt(np.mean(m.astype(np.float64) ** 2)).astype(np.float32)
            se[r] = m - s_r * sign(m)
            y[part] = s_r * sign(m)
        ys.append(y[:n])
    return np.stack(ys), we, se


def run(x, p, impl=None):
    """Run OneBit().mean over x[T, P, n] on P workers; {rank: (y[T], we, se)}."""
    steps, _, n = x.shape
    coll = None if UNDER_MPI else AxisCollective("workers", p)
    codec = OneBit(impl=impl)

    def worker(coll, xs):
        we, se = codec.init(n, coll.size)
        ys = []
        for t in range(steps):
            y, (we, se) = codec.mean(xs[t], (we, se), collective=coll)
            ys.append(y)
        return jnp.stack(ys), we, se

    return run_workers(worker, jnp.asarray(x.transpose(1, 0, 2)), collective=coll)


def needs(p):
    if UNDER_MPI and p != n_workers():
        pytest.skip(f"under mpiexec only P = {n_workers()} workers exist")


@pytest.mark.mpi
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [5, 389])
def test_matches_oracle(p, n):
    needs(p)
    rng = np.random.default_rng(10 * p + n)
    # A common drift plus per-worker noise, as gradients of one model look.
    x = (rng.normal(size=(1, 1, n)) + 0.5 * rng.normal(size=(4, p, n))).astype(np.float32)
    ys, we, se = oracle(x)
    out = run(x, p)
    assert len(out) == (1 if UNDER_MPI else p)
    for rank, (y, w, s) in out.items():
        np.testing.assert_allclose(np.asarray(y), ys, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(np.asarray(w), we[rank], rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(np.asarray(s), se[rank], rtol=2e-5, atol=2e-6)
        assert w.shape == (OneBit().padded_size(n, p),)


@pytest.mark.mpi
def test_pallas_interpret_path_matches_oracle():
    p = n_workers()
    x = np.random.default_rng(3).normal(size=(2, p, 100)).astype(np.float32)
    ys, _, _ = oracle(x)
    for _, (y, _, _) in run(x, p, impl="pallas").items():
        np.testing.assert_allclose(np.asarray(y), ys, rtol=2e-5, atol=2e-6)


def test_padding_rule():
    # Multiples of P * lcm(P, 8): 16 for P=2, 72 for P=3, 32 for P=4, 8 for P=1.
    assert [OneBit().padded_size(1, p) for p in (1, 2, 3, 4)] == [8, 16, 72, 32]
    assert OneBit().padded_size(72, 3) == 72
    assert OneBit().padded_size(73, 3) == 144
    we, se = OneBit().init(73, 3)
    assert we.shape == (144,) and se.shape == (48,) and we.dtype == jnp.float32
    assert not we.any() and not se.any()


@pytest.mark.mpi
def test_output_identical_on_every_worker_and_signs_times_scales():
    p = n_workers()
    x = np.random.default_rng(4).normal(size=(3, p, 77)).astype(np.float32)
    out = run(x, p)
    ys = oracle(x)[0]
    for y, _, _ in out.values():
        y = np.asarray(y)
        # Every chunk of the output is +-one scale: 1 bit and 1 float per chunk.
        c = OneBit().padded_size(77, p) // p
        for r in range(p):
            chunk = np.abs(y[:, r * c : (r + 1) * c])
            if chunk.size:
                np.testing.assert_array_equal(chunk, chunk[:, :1] * np.ones_like(chunk))
        np.testing.assert_array_equal(np.sign(y), np.sign(ys))


@pytest.mark.mpi
def test_error_feedback_conserves_and_tracks_the_mean():
    """sum_t y_t + (1/P) sum_i e_i(T) + server errors == sum_t mean_i x_i,t (padded), and
    the running sum of outputs tracks the running sum of means ever more closely."""
    p, n, steps = n_workers(), 300, 40
    rng = np.random.default_rng(5)
    x = (rng.normal(size=(1, 1, n)) + rng.normal(size=(steps, p, n))).astype(np.float32)
    coll = None if UNDER_MPI else AxisCollective("workers", p)

    def worker(coll, xs):
        we, se = OneBit().init(n, coll.size)

        def body(carry, x_t):
            y, (we, se) = OneBit().mean(x_t, carry, collective=coll)
            return (we, se), y

        (we, se), ys = jax.lax.scan(body, (we, se), xs)
        return ys, coll.all_reduce(we, "mean"), coll.all_gather(se).reshape(-1)

    out = run_workers(worker, jnp.asarray(x.transpose(1, 0, 2)), collective=coll)
    true = np.cumsum(x.mean(axis=1, dtype=np.float64), axis=0)
    for ys, we_mean, se_all in out.values():
        got = np.cumsum(np.asarray(ys, np.float64), axis=0)
        lhs = got[-1] + np.asarray(we_mean)[:n] + np.asarray(se_all)[:n]
        np.testing.assert_allclose(lhs, true[-1], rtol=1e-4, atol=1e-4)
        rel = np.linalg.norm(got - true, axis=1) / np.linalg.norm(true, axis=1)
        assert rel[-1] < 0.1, rel
        assert rel[-1] < rel[4] / 3, rel
        # Without feedback the error of a sum of T one-bit estimates does not shrink.
        first_mean = x[0].mean(0)
        one_shot = np.linalg.norm(np.asarray(ys)[0] - first_mean) / np.linalg.norm(first_mean)
        assert rel[-1] < one_shot / 3


class CountingCollective:
    """Wraps an AxisCollective and records the rows it moves (at trace time)."""

    def __init__(self, inner):
        self.inner, self.size, self.log = inner, inner.size, []

    def rank(self):
        return self.inner.rank()

    def uniform(self, x):
        return self.inner.uniform(x)

    def all_reduce(self, tree, op="mean"):
        raise AssertionError("OneBit().mean must not all-reduce")

    def all_to_all(self, x):
        self.log.append(("all_to_all", x.dtype, x.shape))
        return self.inner.all_to_all(x)

    def all_gather(self, x):
        self.log.append(("all_gather", x.dtype, x.shape))
        return self.inner.all_gather(x)


@pytest.mark.parametrize(("n", "p"), [(1000, 4), (10, 3), (1 << 20, 4)])
def test_wire_bytes_hand_computed(n, p):
    n_pad = -(-n // (p * math.lcm(p, 8))) * p * math.lcm(p, 8)
    b = n_pad // p // 8  # sign bytes per chunk
    # all-to-all of n_pad/8 bytes, all-gather of 4 + b + 4 bytes, (P-1)/P and (P-1) rules.
    expected = (p - 1) * (n_pad // 8) // p + (p - 1) * 4 + (p - 1) * b + (p - 1) * 4
    assert OneBit().wire_bytes(n, p) == (expected, expected)
    if (n, p) == (1000, 4):
        assert expected == 3 * 32 + 12 + 3 * 32 + 12 == 216
    dense = all_reduce_bytes(4 * n, p)[0]
    ratio = dense / expected
    assert ratio > (31.0 if n >= 1 << 20 else 1.0), ratio

    # What is really exchanged: uint8 rows of b + 4 bytes, once each way.
    coll = CountingCollective(AxisCollective("workers", p))
    jax.eval_shape(
        jax.vmap(
            lambda x, we, se: OneBit().mean(x, (we, se), collective=coll),
            axis_name="workers",
        ),
        jax.ShapeDtypeStruct((p, n), jnp.float32),
        jax.ShapeDtypeStruct((p, n_pad), jnp.float32),
        jax.ShapeDtypeStruct((p, n_pad // p), jnp.float32),
    )
    assert coll.log == [("all_to_all", jnp.uint8, (p, b + 4)), ("all_gather", jnp.uint8, (b + 4,))]
    moved = (p - 1) * (p * (b + 4)) // p + (p - 1) * (b + 4)
    assert moved == expected


def test_bytes_against_float32_allreduce_16m():
    n, p = 1 << 24, 4
    sent, received = OneBit().wire_bytes(n, p)
    assert sent == received == 2 * 3 * (n // 4 // 8 + 4)
    assert all_reduce_bytes(4 * n, p)[0] / sent == pytest.approx(32, rel=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"x": np.ones(10, np.float64)}, TypeError, "x must be float32"),
        ({"x": np.ones((2, 5), np.float32)}, ValueError, "x must be a non-empty 1-D"),
        ({"x": np.ones(0, np.float32)}, ValueError, "x must be a non-empty 1-D"),
        ({"worker_error": np.zeros(10, np.float32)}, ValueError, r"worker_error must be"),
        ({"server_error": np.zeros(32, np.float32)}, ValueError, r"server_error must be"),
        ({"server_error": np.zeros(8, np.int32)}, ValueError, r"server_error must be"),
    ],
)
def test_bad_input(kwargs, error, match):
    coll = AxisCollective("workers", 4)
    args = {"x": np.ones(10, np.float32)}
    args["worker_error"], args["server_error"] = OneBit().init(10, 4)
    args.update(kwargs)
    memory = (args["worker_error"], args["server_error"])
    with pytest.raises(error, match=match):
        OneBit().mean(args["x"], memory, collective=coll)


def test_memory_of_the_wrong_length():
    coll = AxisCollective("workers", 4)
    we, _ = OneBit().init(10, 4)
    with pytest.raises(ValueError, match="memory must hold 2 buffers"):
        OneBit().mean(np.ones(10, np.float32), (we,), collective=coll)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        OneBit().init(bad, 4)
    with pytest.raises(ValueError, match="size must be an int >= 1"):
        OneBit().wire_bytes(10, bad)
