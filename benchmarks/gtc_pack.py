"""Benchmark: gtc_pack on 16M float32 values against a read-only pass over the same data.

Usage: ``.venv/bin/python benchmarks/gtc_pack.py [--reps 40]``

Setup as in the optimizer: ~1% of the values above tau (normal data, tau the 99th
percentile of |v|), capacity 2% of n so that everything fits, and the residual buffer
donated, so that the remainder updates it in place. Before each timed call the buffer is
refilled in place (untimed), which is what accumulating a gradient into the error
feedback does. The baseline is ``jnp.sum(v * v)`` (jitted), timed in the same loop.
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from shoal.kernels import gtc_pack

N = 1 << 24
DENSITY = 0.01
CAPACITY = int(0.02 * N)


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


if __name__ == "__main__":
    main()
