"""Benchmark: each compressor's encode and decode against a read pass of the same buffer.

Usage: ``.venv/bin/python benchmarks/encoders.py [--elements 16777216] [--reps 15]``

Every `shoal.comms.Compressor` turns a float32 buffer into uint8 wire rows (``encode``) and
back (``decode``); its error feedback needs both on every call. Each is timed, jitted, on
the same standard-normal buffer (one row, as a worker encodes its whole buffer), beside a
read-only pass over it (the sum of squares: the least any encoder must do), interleaved so
that machine noise hits all alike; medians. The ratio to the read pass is what the
encoder costs in units of touching the data once.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from shoal.comms import OneBit, Quantized, TopK

CODECS = {
    "OneBit (signs + scale)": OneBit(),
    "Quantized int8": Quantized("int8"),
    "Quantized fp8 (e4m3)": Quantized("fp8"),
    "Quantized fp4 (e2m1)": Quantized("fp4"),
    "TopK 1% of 64, float32": TopK(fraction=0.01, chunk_size=64),
    "TopK 10% of 64, 2-bit": TopK(fraction=0.1, chunk_size=64, value_bits=2),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=16 * 2**20)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    n = args.elements - args.elements % 1024  # whole blocks and chunks for every codec
    print(f"encoders: {n} float32 ({4 * n / 2**20:.0f} MiB), {args.reps} reps, interleaved; "
          f"{platform.machine()}, backend={jax.default_backend()}, jax {jax.__version__}, "
          f"load (1 min) {os.getloadavg()[0]:.2f}")  # fmt: skip
    v = jnp.asarray(np.random.default_rng(0).standard_normal((1, n)).astype(np.float32))
    fns = {"read pass": jax.jit(lambda v: jnp.sum(v * v))}
    for name, codec in CODECS.items():
        encode = jax.jit(codec.encode)
        rows = encode(v)
        fns[f"{name}: encode"] = encode
        fns[f"{name}: decode"] = (jax.jit(lambda r, c=codec: c.decode(r, n)), rows)
    times: dict[str, list[float]] = {k: [] for k in fns}
    calls = {k: (f if isinstance(f, tuple) else (f, v)) for k, f in fns.items()}
    for f, x in calls.values():
        jax.block_until_ready(f(x))  # compile
    for _ in range(args.reps):
        for k, (f, x) in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(f(x))
            times[k].append(time.perf_counter() - start)
    read = np.median(times["read pass"])
    print()
    print("| compressor: step | wire bytes / float32 bytes | ms | x read pass |")
    print("|---|---:|---:|---:|")
    print(f"| read pass | - | {read * 1e3:.2f} | 1.00 |")
    for name, codec in CODECS.items():
        ratio = codec.row_bytes(n) / (4 * n)
        for step in ("encode", "decode"):
            t = np.median(times[f"{name}: {step}"])
            print(f"| {name}: {step} | {ratio:.4f} | {t * 1e3:.2f} | {t / read:.2f} |")
    print(f"\nload (1 min) at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
