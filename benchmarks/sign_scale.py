"""Benchmark: the cost of sign_pack's guarded RMS scale against the plain one.

Usage: ``.venv/bin/python benchmarks/sign_scale.py [--elements 16777216] [--reps 30]``

`shoal.kernels.sign_reference.rms` computes ``sqrt(sum(v * v) / n)`` and, only when that
overflows (inf) or underflows (below 2^-60), again on ``v / max|v|`` (a ``lax.cond``). The
plain formula is timed beside it, interleaved, on the same normal values (the common case:
the guard must cost next to nothing) and on values of 1e20 (the rescaled path: the plain
formula gives inf, the guarded one the right scale).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from shoal.kernels.sign_reference import rms


def plain(values):
    return jnp.sqrt(jnp.sum(values * values, axis=-1) / jnp.float32(values.shape[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=16 * 2**20)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"sign_scale: {args.elements} float32, {args.reps} reps, interleaved; "
          f"{platform.machine()}, backend={jax.default_backend()}, jax {jax.__version__}, "
          f"load (1 min) {load:.2f}")  # fmt: skip
    f_plain, f_guarded = jax.jit(plain), jax.jit(rms)
    rng = np.random.default_rng(0)
    normal = jnp.asarray(rng.standard_normal(args.elements).astype(np.float32))
    huge = normal * jnp.float32(1e20)
    print()
    print("| values | plain ms | guarded ms | ratio guarded/plain | plain scale | guarded scale |")
    print("|---|---|---|---|---|---|")
    for label, v in (("standard normal", normal), ("normal x 1e20", huge)):
        a, b = f_plain(v).block_until_ready(), f_guarded(v).block_until_ready()
        times = {"plain": [], "guarded": []}
        for _ in range(args.reps):
            for name, f in (("plain", f_plain), ("guarded", f_guarded)):
                start = time.perf_counter()
                f(v).block_until_ready()
                times[name].append(time.perf_counter() - start)
        p, g = np.median(times["plain"]), np.median(times["guarded"])
        print(f"| {label} | {p * 1e3:.2f} | {g * 1e3:.2f} | {g / p:.2f} | {float(a):.4g} | "
              f"{float(b):.4g} |")  # fmt: skip
    print(f"\nload (1 min) at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
