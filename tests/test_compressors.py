"""The compressor interface (shoal.comms.Compressor): TopK against a NumPy oracle, the
telescoping (no mass lost) of every error-feedback compressor, exact bytes, bad input;
on simulated workers (P = 2..4) and under mpiexec -n 4."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import UNDER_MPI, n_workers, run_workers
from topk_oracle import np_topk

from shoal.comms import AxisCollective, Float32, OneBit, Quantized, TopK
from shoal.comms.wire import all_gather_bytes, all_reduce_bytes


def run(codec, x):
    """codec.mean over x[T, P, n] on P workers, memory carried; {rank: (y[T], memory)}."""
    steps, p, n = x.shape
    coll = None if UNDER_MPI else AxisCollective("workers", p)

    def worker(coll, xs):
        def body(memory, x_t):
            y, memory = codec.mean(x_t, memory, collective=coll)
            return memory, y

        memory, ys = jax.lax.scan(body, codec.init(n, coll.size), xs)
        return ys, memory

    return run_workers(worker, jnp.asarray(x.transpose(1, 0, 2)), collective=coll)


def needs(p):
    if UNDER_MPI and p != n_workers():
        pytest.skip(f"under mpiexec only P = {n_workers()} workers exist")


def inputs(seed, steps, p, n):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(1, 1, n)) + 0.5 * rng.normal(size=(steps, p, n))
    return (x * np.exp(rng.normal(size=(1, 1, n)))).astype(np.float32)


# ---- TopK against NumPy -------------------------------------------------------------


def topk_oracle(x, fraction, chunk, bits):
    steps, p, n = x.shape
    chunk = chunk or n
    n_pad = -(-n // chunk) * chunk
    e = np.zeros((p, n_pad), np.float32)
    ys = []
    for t in range(steps):
        total = np.zeros(n_pad, np.float32)
        for i in range(p):
            v = np.pad(x[t, i], (0, n_pad - n)) + e[i]
            d = np_topk(v, fraction, chunk, bits)
            e[i] = v - d
            total = total + d  # source order
        ys.append((total / np.float32(p))[:n])
    return np.stack(ys), e


CASES = [(0.25, 8, None), (0.1, None, None), (0.3, 16, 2), (0.5, 8, 4), (0.2, 8, 8)]


@pytest.mark.mpi
@pytest.mark.parametrize("fraction,chunk,bits", CASES)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_topk_matches_oracle(p, fraction, chunk, bits):
    needs(p)
    x = inputs(p, 4, p, 61)  # 61: the last chunk is padded
    codec = TopK(fraction=fraction, chunk_size=chunk, value_bits=bits)
    want, errors = topk_oracle(x, fraction, chunk, bits)
    for rank, (ys, (error,)) in run(codec, x).items():
        np.testing.assert_allclose(np.asarray(ys), want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(error), errors[rank], rtol=1e-6, atol=1e-6)


def test_topk_keeps_the_largest_and_packs_the_codes():
    # One chunk of 8, k = 2: -5 and 4 are sent; 2-bit codes give +-s/2 or +-s, s = 5.
    v = jnp.array([[0.5, -5.0, 1.0, 4.0, -1.0, 0.0, 2.0, 0.1]])
    for bits, sent in ((None, (-5.0, 4.0)), (2, (-5.0, 5.0)), (8, (-5.0, 5 * 102 / 128))):
        codec = TopK(fraction=0.25, value_bits=bits)
        out = np.asarray(codec.decode(codec.encode(v), 8))[0]
        np.testing.assert_allclose(out[[1, 3]], sent, rtol=1e-6)
        assert not np.delete(out, [1, 3]).any()
    # Two values at 2 bits in one byte, one float32 scale, two uint16 indices.
    assert TopK(fraction=0.25, value_bits=2).row_bytes(8) == 1 + 4 + 4
    assert TopK(fraction=0.25).row_bytes(8) == 8 + 4
    assert TopK(fraction=1.0, chunk_size=70000).row_bytes(70000) == 70000 * 8  # uint32


def test_topk_takes_its_fraction_positionally():
    # As the diloco docstring and the README write it: TopK(0.01), like Quantized("fp4").
    assert TopK(0.01) == TopK(fraction=0.01)
    assert TopK(0.25, chunk_size=8, value_bits=2) == TopK(fraction=0.25, chunk_size=8,
                                                          value_bits=2)  # fmt: skip
    # 1% of a chunk of 200 is 2 values: a float32 and a uint16 index each.
    assert TopK(0.01, chunk_size=200).row_bytes(200) == 2 * (4 + 2)
    with pytest.raises(TypeError, match="positional"):
        TopK(0.01, 64)  # the others are keyword-only: TopK(0.01, chunk_size=64)
    with pytest.raises(ValueError, match="fraction"):
        TopK(0.0)


@pytest.mark.mpi
def test_topk_full_fraction_is_the_exact_mean():
    p = n_workers()
    x = inputs(7, 3, p, 40)
    for ys, (error,) in run(TopK(fraction=1.0, chunk_size=8), x).values():
        np.testing.assert_allclose(np.asarray(ys), x.mean(1), rtol=1e-6, atol=1e-6)
        assert not np.asarray(error).any()


# ---- every error-feedback compressor loses nothing -------------------------------------

FEEDBACK = [
    OneBit(),
    Quantized("fp4", block=8),
    Quantized("int8", block=16),
    TopK(fraction=0.25, chunk_size=8),
    TopK(fraction=0.1, value_bits=2),
]


@pytest.mark.mpi
@pytest.mark.parametrize("codec", FEEDBACK, ids=repr)
def test_error_feedback_telescopes(codec):
    """sum_t y_t = sum_t mean_i x_i,t - (1/P) sum_i e_i(T) [- e_server(T)]: what was sent
    plus what remains in memory is what came in."""
    p = n_workers()
    steps, n = 6, 50
    x = inputs(11, steps, p, n)
    out = run(codec, x)
    worker_errors = sum(np.asarray(memory[0], np.float64) for _, memory in out.values())
    if UNDER_MPI:
        from mpi4py import MPI

        worker_errors = MPI.COMM_WORLD.allreduce(worker_errors)
        servers = MPI.COMM_WORLD.allgather(np.asarray(out[my_rank(out)][1][-1]))
    elif codec.pattern == "two_phase":
        servers = [np.asarray(out[r][1][1]) for r in range(p)]
    left = worker_errors / p
    if codec.pattern == "two_phase":
        left = left + np.concatenate(servers).astype(np.float64)
    for ys, _ in out.values():
        sent = np.asarray(ys, np.float64).sum(0)
        want = x.astype(np.float64).mean(1).sum(0)
        np.testing.assert_allclose(sent + left[:n], want, rtol=1e-5, atol=1e-5)
    assert np.abs(left).max() > 0  # something was held back


def my_rank(out):
    (rank,) = out
    return rank


# ---- bytes and the plain exchange -------------------------------------------------


def test_wire_bytes_by_pattern():
    assert Float32().wire_bytes(1000, 4) == all_reduce_bytes(4000, 4)
    # TopK: 1000 values in chunks of 64 (16 chunks, 1024 padded), k = 7: float32 values
    # and uint16 indices, all-gathered.
    assert TopK(fraction=0.1, chunk_size=64).wire_bytes(1000, 4) == all_gather_bytes(
        16 * 7 * (4 + 2), 4
    )
    # 2-bit: 112 codes in 28 bytes, 16 scales.
    assert TopK(fraction=0.1, chunk_size=64, value_bits=2).wire_bytes(1000, 4) == all_gather_bytes(
        28 + 64 + 16 * 7 * 2, 4
    )
    # Two-phase: 2 (P-1) R per worker; OneBit R = c / 8 + 4 with n_pad = 1024, c = 256.
    assert OneBit().wire_bytes(1000, 4) == (2 * 3 * 36, 2 * 3 * 36)


@pytest.mark.mpi
def test_float32_is_the_all_reduce_mean():
    p = n_workers()
    x = inputs(3, 2, p, 10)
    for ys, memory in run(Float32(), x).values():
        np.testing.assert_allclose(np.asarray(ys), x.mean(1), rtol=1e-6)
        assert memory == ()


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda: TopK(fraction=0.0), "fraction"),
        (lambda: TopK(fraction=1.5), "fraction"),
        (lambda: TopK(fraction=0.1, chunk_size=0), "chunk_size"),
        (lambda: TopK(fraction=0.1, value_bits=3), "value_bits"),
        (lambda: Quantized("fp5"), "fmt"),
        (lambda: Quantized("fp4", block=3), "block"),
        (lambda: Float32(error_feedback=True), "error_feedback"),
    ],
)
def test_bad_compressors(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_wrong_memory_is_named():
    coll = AxisCollective("workers", 2)
    codec = TopK(fraction=0.5)
    x = jnp.ones((2, 8))
    with pytest.raises(ValueError, match="memory must hold 1"):
        jax.vmap(lambda x: codec.mean(x, (), collective=coll), axis_name="workers")(x)
    bad = (jnp.zeros(7),)
    with pytest.raises(ValueError, match=r"error must be float32\[8\]"):
        jax.vmap(lambda x: codec.mean(x, bad, collective=coll), axis_name="workers")(x)


# ---- a list of parts is their concatenation ------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("codec", [*FEEDBACK, Float32()], ids=repr)
def test_parts_are_the_concatenation(codec):
    """mean([a, b, c]) is mean(concat([a, b, c])), outputs and memory, over steps that
    carry the error feedback (`tree_mean` hands the leaves over this way): within float32
    rounding, as XLA may contract a multiply-add into an FMA in one program and not in
    the other (bit for bit on simulated workers here; not fp4's decode under MPI)."""
    p = n_workers()
    steps, sizes = 3, (13, 1, 36)  # 50 values: the padding holds error feedback too
    x = inputs(5, steps, p, sum(sizes))
    cuts = np.cumsum(sizes)[:-1].tolist()
    coll = None if UNDER_MPI else AxisCollective("workers", p)

    def worker(coll, xs):
        def body(carry, x_t):
            whole, parts = carry
            y, whole = codec.mean(x_t, whole, collective=coll)
            z, parts = codec.mean(jnp.split(x_t, cuts), parts, collective=coll)
            return (whole, parts), (y, z)

        memory = codec.init(sum(sizes), coll.size)
        return jax.lax.scan(body, (memory, memory), xs)

    out = run_workers(worker, jnp.asarray(x.transpose(1, 0, 2)), collective=coll)
    same = lambda a, b: np.testing.assert_allclose(
        np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6
    )
    for (whole, parts), (y, z) in out.values():
        same(z, y)
        assert np.abs(np.asarray(y)).max() > 0
        for a, b in zip(whole, parts):
            same(b, a)


@pytest.mark.parametrize(
    "parts,error,words",
    [
        ([jnp.ones(3), jnp.ones(2, jnp.float16)], TypeError, r"x\[1\] must be float32"),
        ([jnp.ones(3), jnp.ones((2, 2))], ValueError, r"x\[1\] must be a 1-D"),
        ([], ValueError, "at least one value"),
        ([jnp.ones(0)], ValueError, "at least one value"),
    ],
)
def test_bad_parts_are_named(parts, error, words):
    coll = AxisCollective("workers", 1)
    codec = OneBit()
    with pytest.raises(error, match=words):
        codec.mean(parts, codec.init(8, 1), collective=coll)
