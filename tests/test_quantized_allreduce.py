"""Quantized(fmt).mean (int8 / fp8 e4m3 / fp4 e2m1 with absmax block scales) against a
NumPy oracle, on simulated workers (P = 1..4) and under mpiexec -n 4."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from harness import UNDER_MPI, n_workers, run_workers

from shoal.comms import AxisCollective, Quantized
from shoal.comms.wire import all_reduce_bytes
from shoal.kernels.quant_reference import dequantize_reference, quantize_reference

FORMATS = ("int8", "fp8", "fp4")
TOP = {"int8": 127, "fp8": 448, "fp4": 6}
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


# ---- NumPy oracle -------------------------------------------------------------------


def round_e2m1(u):
    """Nearest e2m1 magnitude by distance to every grid point; on a tie the even index
    (the e2m1 pattern whose last mantissa bit is 0)."""
    a = np.abs(u).astype(np.float64)
    dist = np.abs(a[..., None] - E2M1.astype(np.float64))
    best = dist.min(axis=-1, keepdims=True)
    tied = dist == best
    # Among the tied candidates (at most two) take the one with an even index.
    index = np.where(
        tied.sum(-1) > 1, np.argmax(tied & (np.arange(8) % 2 == 0), -1), dist.argmin(-1)
    )
    return np.where(u < 0, -1, 1).astype(np.float32) * E2M1[index], index


def np_quantize(v, fmt, block):
    """float32[n] -> (dequantized float32[n], integer-ish code values, scales)."""
    blocks = v.astype(np.float32).reshape(-1, block)
    scale = np.abs(blocks).max(axis=1) * np.float32(1 / TOP[fmt])  # float32 product
    safe = np.where(scale > 0, scale, np.float32(1))
    u = np.clip(blocks / safe[:, None], -TOP[fmt], TOP[fmt]).astype(np.float32)
    if fmt == "int8":
        q = np.rint(u)  # half to even
    elif fmt == "fp8":
        q = u.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        q = round_e2m1(u)[0]
    return (q * scale[:, None]).astype(np.float32).reshape(-1), q.reshape(-1), scale


def np_dq(v, fmt, block):
    return np_quantize(v, fmt, block)[0]


def oracle(x, fmt, block, feedback=True):
    """x[T, P, n] -> outputs [T, n], worker errors [P, n_pad], server errors [P, c]."""
    steps, p, n = x.shape
    n_pad = -(-n // (p * block)) * p * block
    c = n_pad // p
    we = np.zeros((p, n_pad), np.float32)
    se = np.zeros((p, c), np.float32)
    ys = []
    for t in range(steps):
        sent = []
        for i in range(p):
            v = np.zeros(n_pad, np.float32)
            v[:n] = x[t, i]
            v = v + we[i]
            d = np_dq(v, fmt, block)
            if feedback:
                we[i] = v - d
            sent.append(d)
        y = np.zeros(n_pad, np.float32)
        for r in range(p):
            part = slice(r * c, (r + 1) * c)
            m = sent[0][part]
            for j in range(1, p):
                m = m + sent[j][part]
            m = m / np.float32(p) + se[r]
            d = np_dq(m, fmt, block)
            if feedback:
                se[r] = m - d
            y[part] = d
        ys.append(y[:n])
    return np.stack(ys), we, se


# ---- the quantizers alone -----------------------------------------------------------


def test_int8_rounding_and_layout():
    v = np.array([127.0, 63.5, 62.5, -0.5, 1.5, -127.0, 0.0, 12.0], np.float32)  # scale 1
    codes, scales = quantize_reference(jnp.asarray(v), "int8", 8)
    assert scales.tolist() == [1.0]
    # Ties to even: 63.5 -> 64, 62.5 -> 62, -0.5 -> 0, 1.5 -> 2; two's complement bytes.
    expected = np.array([127, 64, 62, 0, 2, -127, 0, 12], np.int8)
    np.testing.assert_array_equal(np.asarray(codes), expected.view(np.uint8))
    out = dequantize_reference(codes, scales, "int8", 8)
    np.testing.assert_array_equal(np.asarray(out), expected.astype(np.float32))


def test_fp8_codes_are_the_e4m3fn_bits():
    rng = np.random.default_rng(0)
    v = (rng.normal(size=4096) * np.exp(rng.normal(size=4096) * 3)).astype(np.float32)
    codes, scales = quantize_reference(jnp.asarray(v), "fp8", 32)
    dq, q, sc = np_quantize(v, "fp8", 32)
    np.testing.assert_array_equal(np.asarray(scales), sc)
    np.testing.assert_array_equal(
        np.asarray(codes), q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    )
    np.testing.assert_array_equal(np.asarray(dequantize_reference(codes, scales, "fp8", 32)), dq)
    # Each block's largest magnitude becomes exactly 448 (the largest finite e4m3).
    assert np.all(np.abs(q.reshape(-1, 32)).max(1) == 448)


def test_fp4_ties_to_even_and_nibble_layout():
    # Scale 1 (block max 6): grid points, every midpoint, and just around two of them.
    v = np.array(
        [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.75, -5, 0.2500001, 4.9999995, 3, -1.5, 0.5, 0],
        np.float32,
    )
    want = np.array([6, 0, 1, 1, 2, 2, 4, 4, -1, -4, 0.5, 4, 3, -1.5, 0.5, 0], np.float32)
    q, _ = round_e2m1(v)
    np.testing.assert_array_equal(q, want)  # the oracle's own rule, spelled out
    codes, scales = quantize_reference(jnp.asarray(v), "fp4", 16)
    assert scales.tolist() == [1.0] and codes.shape == (8,)
    nibble = {float(g): k for k, g in enumerate(E2M1)}
    expected = [nibble[abs(float(w))] | (8 if w < 0 else 0) for w in want]
    lo, hi = np.asarray(codes) & 0xF, np.asarray(codes) >> 4
    np.testing.assert_array_equal(lo, expected[0::2])  # value 2k in the low nibble
    np.testing.assert_array_equal(hi, expected[1::2])
    out = dequantize_reference(codes, scales, "fp4", 16)
    np.testing.assert_array_equal(np.asarray(out), want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_matches_numpy(fmt):
    rng = np.random.default_rng(1)
    v = rng.normal(size=(3, 256)).astype(np.float32)
    v[1, :16] = 0  # an all-zero block: scale 0, codes 0
    codes, scales = quantize_reference(jnp.asarray(v), fmt, 16)
    out = np.asarray(dequantize_reference(codes, scales, fmt, 16))
    for row in range(3):
        dq, _, sc = np_quantize(v[row], fmt, 16)
        np.testing.assert_array_equal(np.asarray(scales[row]), sc)
        np.testing.assert_array_equal(out[row], dq)
    assert not out[1, :16].any() and scales[1, 0] == 0
    # Round to nearest: the error is at most half the largest gap of the grid (x scale).
    half_gap = {"int8": 0.5, "fp8": 16.0, "fp4": 1.0}[fmt]
    err = np.abs(out - v).reshape(3, -1, 16)
    assert np.all(err <= half_gap * np.asarray(scales)[..., None] * (1 + 1e-6))


# ---- the all-reduce -----------------------------------------------------------------


def run(x, fmt, block, feedback=True):
    """Quantized(fmt).mean over x[T, P, n] on P workers; {rank: (y[T], we, se)}."""
    steps, p, n = x.shape
    coll = None if UNDER_MPI else AxisCollective("workers", p)
    codec = Quantized(fmt, block=block)
    plain = Quantized(fmt, block=block, error_feedback=False)

    def worker(coll, xs):
        we, se = codec.init(n, coll.size)

        def body(carry, x_t):
            if not feedback:
                return carry, plain.mean(x_t, collective=coll)[0]
            y, (we, se) = codec.mean(x_t, carry, collective=coll)
            return (we, se), y

        (we, se), ys = jax.lax.scan(body, (we, se), xs)
        return ys, we, se

    return run_workers(worker, jnp.asarray(x.transpose(1, 0, 2)), collective=coll)


def needs(p):
    if UNDER_MPI and p != n_workers():
        pytest.skip(f"under mpiexec only P = {n_workers()} workers exist")


def inputs(seed, steps, p, n):
    rng = np.random.default_rng(seed)
    # A common drift plus per-worker noise, with block-to-block changes of magnitude.
    x = rng.normal(size=(1, 1, n)) + 0.5 * rng.normal(size=(steps, p, n))
    return (x * np.exp(rng.normal(size=(1, 1, n)))).astype(np.float32)


@pytest.mark.mpi
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("feedback", [True, False])
def test_matches_oracle(fmt, p, feedback):
    needs(p)
    n, block = 389, 16
    x = inputs(10 * p + len(fmt), 3, p, n)
    ys, we, se = oracle(x, fmt, block, feedback)
    out = run(x, fmt, block, feedback)
    assert len(out) == (1 if UNDER_MPI else p)
    for rank, (y, w, s) in out.items():
        np.testing.assert_allclose(np.asarray(y), ys, rtol=1e-6, atol=1e-7)
        if feedback:
            # An error is a difference of close values (XLA may fuse it into an FMA):
            # equal up to a few float32 ulps of the values, not of the error.
            tol = 1e-6 * np.abs(x).max()
            np.testing.assert_allclose(np.asarray(w), we[rank], rtol=0, atol=tol)
            np.testing.assert_allclose(np.asarray(s), se[rank], rtol=0, atol=tol)
        assert w.shape == (Quantized(fmt, block=block).padded_size(n, p),)


@pytest.mark.mpi
@pytest.mark.parametrize("fmt", FORMATS)
def test_short_input_default_block(fmt):
    """n smaller than one block per worker: mostly padding, which stays exactly zero."""
    p, n = n_workers(), 5
    x = inputs(7, 2, p, n)
    ys, we, _ = oracle(x, fmt, 128)
    for rank, (y, w, s) in run(x, fmt, 128).items():
        np.testing.assert_allclose(np.asarray(y), ys, rtol=1e-6, atol=1e-7)
        assert w.shape == (128 * p,) and s.shape == (128,)
        assert not np.asarray(w)[n:].any()
        np.testing.assert_allclose(np.asarray(w), we[rank], rtol=0, atol=1e-6 * np.abs(x).max())


@pytest.mark.mpi
@pytest.mark.parametrize("fmt", FORMATS)
def test_output_identical_on_every_worker(fmt):
    p = n_workers()
    coll = None if UNDER_MPI else AxisCollective("workers", p)
    x = inputs(4, 1, p, 100)[0]

    def worker(coll, x):
        y = Quantized(fmt, block=8, error_feedback=False).mean(x, collective=coll)[0]
        return y, coll.all_gather(y)

    for y, everyone in run_workers(worker, jnp.asarray(x), collective=coll).values():
        np.testing.assert_array_equal(np.asarray(everyone), np.broadcast_to(y, (p, 100)))
        # Close to the mean: two quantizations of at most half a step each.
        mean = x.mean(0)
        step = {"int8": 1 / 127, "fp8": 32 / 448, "fp4": 2 / 6}[fmt]
        assert np.max(np.abs(np.asarray(y) - mean)) <= 2 * step * np.max(np.abs(x))


@pytest.mark.mpi
@pytest.mark.parametrize("fmt", FORMATS)
def test_error_feedback_telescopes_and_tracks_the_mean(fmt):
    """From zero errors, after T calls (elementwise, padded):

        sum_t y_t + (1/P) sum_i e_i(T) + e_server(T) = sum_t mean_i x_i,t

    (each call's y is m minus the new server error, and m holds the workers' sent values,
    v minus the new worker errors), so

        |sum_t y_t - sum_t mean_t| <= |(1/P) sum_i e_i(T)| + |e_server(T)|

    with the errors bounded by half a quantization step: the running sum of outputs
    tracks the running sum of means, far closer than without feedback.
    """
    p, n, steps, block = n_workers(), 300, 30, 32
    x = inputs(5, steps, p, n)
    coll = None if UNDER_MPI else AxisCollective("workers", p)

    def worker(coll, xs, feedback):
        codec = Quantized(fmt, block=block, error_feedback=feedback)
        we, se = Quantized(fmt, block=block).init(n, coll.size)

        def body(carry, x_t):
            if feedback:
                y, carry = codec.mean(x_t, carry, collective=coll)
            else:
                y = codec.mean(x_t, collective=coll)[0]
            return carry, y

        (we, se), ys = jax.lax.scan(body, (we, se), xs)
        return ys, coll.all_reduce(we, "mean"), coll.all_gather(se).reshape(-1)

    xs = jnp.asarray(x.transpose(1, 0, 2))
    with_fb = run_workers(lambda c, xs: worker(c, xs, True), xs, collective=coll)
    without = run_workers(lambda c, xs: worker(c, xs, False), xs, collective=coll)
    true = np.cumsum(x.mean(axis=1, dtype=np.float64), axis=0)
    scale = np.abs(true[-1]).max()
    for rank, (ys, we_mean, se_all) in with_fb.items():
        got = np.cumsum(np.asarray(ys, np.float64), axis=0)
        we_mean, se_all = np.asarray(we_mean, np.float64), np.asarray(se_all, np.float64)
        # The identity, to float32 rounding over T steps.
        np.testing.assert_allclose(got[-1] + we_mean[:n] + se_all[:n], true[-1], atol=1e-5 * scale)
        bound = np.abs(we_mean[:n]) + np.abs(se_all[:n])
        assert np.all(np.abs(got[-1] - true[-1]) <= bound + 1e-5 * scale)
        assert not we_mean[n:].any() and not se_all[n:].any()  # padding stays zero
        drift = np.abs(got[-1] - true[-1]).max()
        plain = np.abs(np.cumsum(np.asarray(without[rank][0], np.float64), 0)[-1] - true[-1])
        if fmt != "int8":  # int8 rounding errors are small and cancel even without feedback
            assert drift < plain.max() / 2, (drift, plain.max())


# ---- bytes --------------------------------------------------------------------------


class CountingCollective:
    """Wraps an AxisCollective and records the rows it moves (at trace time)."""

    def __init__(self, inner):
        self.inner, self.size, self.log = inner, inner.size, []

    def rank(self):
        return self.inner.rank()

    def all_reduce(self, tree, op="mean"):
        raise AssertionError("Quantized(fmt).mean must not all-reduce")

    def all_to_all(self, x):
        self.log.append(("all_to_all", x.dtype, x.shape))
        return self.inner.all_to_all(x)

    def all_gather(self, x):
        self.log.append(("all_gather", x.dtype, x.shape))
        return self.inner.all_gather(x)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "p", "block"), [(1024, 4, 128), (10, 3, 8), (1 << 20, 4, 32)])
def test_wire_bytes_hand_computed(fmt, n, p, block):
    n_pad = -(-n // (p * block)) * p * block
    c = n_pad // p
    bits = 4 if fmt == "fp4" else 8
    row = c * bits // 8 + 4 * (c // block)
    expected = 2 * (p - 1) * row
    assert Quantized(fmt, block=block).wire_bytes(n, p) == (expected, expected)
    if (fmt, n, p, block) == ("fp4", 1024, 4, 128):
        assert expected == 2 * 3 * (128 + 8) == 816
    if n == 1 << 20:  # n_pad == n: 32 / (bits + 32 / block) times less than float32
        dense = all_reduce_bytes(4 * n, p)[0]
        assert dense / expected == pytest.approx(32 / (bits + 32 / block), rel=1e-9)

    # What is really exchanged: uint8 rows of `row` bytes, once each way.
    coll = CountingCollective(AxisCollective("workers", p))
    for errors in (False, True):
        coll.log.clear()
        codec = Quantized(fmt, block=block, error_feedback=errors)
        memory = ()
        if errors:
            memory = (
                jax.ShapeDtypeStruct((p, n_pad), jnp.float32),
                jax.ShapeDtypeStruct((p, c), jnp.float32),
            )
        jax.eval_shape(
            jax.vmap(functools.partial(codec.mean, collective=coll), axis_name="workers"),
            jax.ShapeDtypeStruct((p, n), jnp.float32),
            memory,
        )
        assert coll.log == [("all_to_all", jnp.uint8, (p, row)), ("all_gather", jnp.uint8, (row,))]


# ---- bad input ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fmt": "int4"}, ValueError, "fmt must be one of"),
        ({"fmt": None}, ValueError, "fmt must be one of"),
        ({"block": 0}, ValueError, "block must be an int >= 1"),
        ({"block": 2.0}, ValueError, "block must be an int >= 1"),
        ({"block": True}, ValueError, "block must be an int >= 1"),
        ({"fmt": "fp4", "block": 7}, ValueError, "block must be even for fmt='fp4'"),
        ({"x": np.ones(10, np.float64)}, TypeError, "x must be float32"),
        ({"x": np.ones((2, 5), np.float32)}, ValueError, "x must be a non-empty 1-D"),
        (
            {"worker_error": np.zeros(10, np.float32)},
            ValueError,
            r"worker_error must be float32\[32\]",
        ),
        (
            {"worker_error": np.zeros(32, np.int32)},
            ValueError,
            r"worker_error must be float32\[32\]",
        ),
        (
            {"server_error": np.zeros(32, np.float32)},
            ValueError,
            r"server_error must be float32\[8\]",
        ),
        ({"server_error": np.zeros((8, 1), np.float32)}, ValueError, r"server_error must be"),
    ],
)
def test_bad_input(kwargs, error, match):
    args = {"x": np.ones(10, np.float32), "fmt": "int8", "block": 8}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        codec = Quantized(args["fmt"], block=args["block"])
        worker_error, server_error = codec.init(10, 4)
        memory = (args.get("worker_error", worker_error), args.get("server_error", server_error))
        codec.mean(args["x"], memory, collective=AxisCollective("workers", 4))


def test_bad_sizes():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="n must be an int >= 1"):
            Quantized("int8").init(bad, 4)
        with pytest.raises(ValueError, match="size must be an int >= 1"):
            Quantized("int8").wire_bytes(10, bad)
        with pytest.raises(ValueError, match="block must be an int >= 1"):
            Quantized("int8", block=bad).padded_size(10, 4)
    with pytest.raises(ValueError, match="fmt must be one of"):
        Quantized("fp16").wire_bytes(10, 4)
    with pytest.raises(ValueError, match="block must be even"):
        Quantized("fp4", block=3).init(10, 4)


def test_padding_rule_and_init():
    assert Quantized("int8", block=8).padded_size(1, 3) == 24
    assert Quantized("int8", block=8).padded_size(24, 3) == 24
    assert Quantized("int8", block=8).padded_size(25, 3) == 48
    we, se = Quantized("fp8", block=8).init(25, 3)
    assert we.shape == (48,) and se.shape == (16,) and we.dtype == se.dtype == jnp.float32
    assert not we.any() and not se.any()
