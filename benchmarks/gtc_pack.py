"""Benchmark: gtc_pack on 16M float32 values against a read-only pass over the same data.

Usage: ``.venv/bin/python benchmarks/gtc_pack.py [--reps 40]``

Setup as in the optimizer: ~1% of the values above tau (normal data, tau the 99th
percentile of |v|), capacity 2% of n so that everything fits, and the residual buffer
donated, so that the remainder updates it in place. Before each timed call the buffer is
refilled in place (untimed), which is what accumulating a gradient into the error
feedback does. The baseline is ``jnp.sum(v * v)`` (jitted), timed in the same loop.

Then the error-feedback step as `shoal.optim.gtc` takes it under the simulator,
``pack(g + r)`` with the new residual written back, vmapped over 16 workers whose
gradient has 8 leaves (`sim_scale`'s reference MLP, width 512: 4 weights and 4 biases,
1.05M values per worker, 16.8M in all): a flat residual with ``g + r`` concatenated leaf
by leaf (`gtc_pack`, how `gtc` kept it before) against a residual kept leaf by leaf
(`gtc_pack_parts` with ``residuals=``, how it keeps it now), both donated, interleaved,
with their words checked equal.
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from shoal.kernels import gtc_pack, gtc_pack_parts

N = 1 << 24
DENSITY = 0.01
CAPACITY = int(0.02 * N)
WIDTH, WORKERS = 512, 16  # the error-feedback comparison: 4 (W^2 + W) values per worker


def _numpy_encoder(v: np.ndarray, tau: np.float32):
    """The NumPy threshold encoder DESIGN.md quotes (flatnonzero + pack + residual)."""
    index = np.flatnonzero(np.abs(v) > tau)[:CAPACITY]
    negative = v[index] < 0
    words = (index | np.where(negative, 1 << 31, 0)).astype(np.uint32).view(np.int32)
    remainder = v.copy()
    remainder[index] -= np.where(negative, -tau, tau)
    return words, remainder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    host = rng.standard_normal(N, dtype=np.float32)
    tau = np.float32(np.quantile(np.abs(host), 1 - DENSITY))
    values = jnp.asarray(host)

    sum_of_squares = jax.jit(lambda v: jnp.sum(v * v))
    pack = jax.jit(functools.partial(gtc_pack, capacity=CAPACITY), donate_argnums=0)
    refill = jax.jit(lambda buf, v: buf.at[:].set(v), donate_argnums=0)
    offset = jnp.int32(12345)

    # Check the result once against NumPy (everything fits, so all qualifying are sent).
    buffer = values + 0.0
    words, count, buffer = pack(buffer, tau, offset=offset)
    expected = np.flatnonzero(np.abs(host) > tau)
    assert int(count) == expected.size, (int(count), expected.size)
    np.testing.assert_array_equal(np.asarray(words)[: expected.size] & 0x7FFFFFFF, expected)
    jax.block_until_ready(sum_of_squares(values))

    t_sum, t_pack = [], []
    for _ in range(args.reps):
        buffer = jax.block_until_ready(refill(buffer, values))
        start = time.perf_counter()
        jax.block_until_ready(sum_of_squares(values))
        t_sum.append(time.perf_counter() - start)
        start = time.perf_counter()
        words, count, buffer = pack(buffer, tau, offset=offset)
        jax.block_until_ready(buffer)
        t_pack.append(time.perf_counter() - start)
    t_sum, t_pack = np.array(t_sum) * 1e3, np.array(t_pack) * 1e3

    t_numpy = []
    for _ in range(3):
        start = time.perf_counter()
        _numpy_encoder(host, tau)
        t_numpy.append(time.perf_counter() - start)
    t_numpy = np.median(t_numpy) * 1e3

    s, p = np.median(t_sum), np.median(t_pack)
    print(
        f"gtc_pack: n={N} float32, {int(count)} of {N} above tau ({int(count) / N:.2%}), "
        f"capacity={CAPACITY}, backend={jax.default_backend()}, "
        f"{jax.local_devices()[0].device_kind}, {platform.machine()}, "
        f"jax {jax.__version__}, {args.reps} reps"
    )
    print(f"  sum(v*v) read-only pass   median {s:7.2f} ms  (min {t_sum.min():.2f})")
    print(f"  gtc_pack (donated values) median {p:7.2f} ms  (min {t_pack.min():.2f})")
    print(f"  NumPy encoder             median {t_numpy:7.2f} ms  (3 reps)")
    print(
        f"  ratio gtc_pack / sum-of-squares: {p / s:.2f} (medians), "
        f"{np.median(t_pack / t_sum):.2f} (median of paired reps); NumPy: {t_numpy / s:.1f}"
    )
    error_feedback(args.reps)


def error_feedback(reps: int) -> None:
    """``pack(g + r)`` of simulated workers' gradients: flat concatenation against parts."""
    rng = np.random.default_rng(1)
    shapes = [(WIDTH, WIDTH), (WIDTH,)] * 4
    grads = [jnp.asarray(rng.standard_normal((WORKERS, *s), dtype=np.float32)) for s in shapes]
    sizes = [int(np.prod(s)) for s in shapes]
    n = sum(sizes)
    capacity = int(0.02 * n)
    tau = np.float32(2.576)  # ~1% of standard normal values above it, as above
    bounds = np.cumsum([0, *sizes])

    def flat_step(r, g, offset):
        a = jnp.concatenate([x.ravel() + r[lo:hi] for x, lo, hi in zip(g, bounds, bounds[1:])])
        return gtc_pack(a, tau, capacity, offset)

    def parts_step(r, g, offset):
        return gtc_pack_parts(g, tau, capacity, offset, residuals=r)

    flat = jax.jit(jax.vmap(flat_step, (0, 0, None)), donate_argnums=0)
    parts = jax.jit(jax.vmap(parts_step, (0, 0, None)), donate_argnums=0)
    r_flat = jnp.zeros((WORKERS, n), jnp.float32)
    r_parts = [jnp.zeros((WORKERS, *s), jnp.float32) for s in shapes]
    offset = jnp.int32(777)
    t_flat, t_parts = [], []
    for rep in range(reps + 2):  # two warm-up calls, whose words are checked equal
        start = time.perf_counter()
        words_f, count_f, r_flat = jax.block_until_ready(flat(r_flat, grads, offset))
        t_flat.append(time.perf_counter() - start)
        start = time.perf_counter()
        words_p, count_p, r_parts = jax.block_until_ready(parts(r_parts, grads, offset))
        t_parts.append(time.perf_counter() - start)
        if rep < 2:
            np.testing.assert_array_equal(np.asarray(words_f), np.asarray(words_p))
    t_flat, t_parts = np.array(t_flat[2:]) * 1e3, np.array(t_parts[2:]) * 1e3
    f, p = np.median(t_flat), np.median(t_parts)
    print(
        f"error feedback pack(g + r) under vmap: {WORKERS} workers x {n} values in "
        f"{len(shapes)} leaves (MLP width {WIDTH}), capacity={capacity} per worker, "
        f"{int(count_p[0])} sent by worker 0, residual donated:"
    )
    print(f"  flat residual, concatenation  median {f:7.2f} ms  (min {t_flat.min():.2f})")
    print(f"  residual by leaf, pack_parts  median {p:7.2f} ms  (min {t_parts.min():.2f})")
    print(
        f"  ratio parts / flat: {p / f:.2f} (medians), "
        f"{np.median(t_parts / t_flat):.2f} (median of paired reps)"
    )


if __name__ == "__main__":
    main()
