"""Benchmark: compressed_allreduce against a float32 MPICollective.all_reduce, side by side.

Usage: ``.venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/compressed_allreduce.py
[--n 16777216] [--reps 10]``

Both are jitted once per rank; the error buffers of the compressed all-reduce are donated
(updated in place, as in the optimizer). Each rep starts after a barrier; a rep's time is
the slowest rank's. Prints the bytes per worker (the wire accounting of
`shoal.comms.wire`) and the median wall time of each. Without mpiexec (one process) there
is nobody to talk to: the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1 << 24)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()

    try:
        from mpi4py import MPI
    except ImportError:
        print("compressed_allreduce benchmark: mpi4py is not installed, skipped")
        return
    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        print(
            "compressed_allreduce benchmark: skipped in a single process; run it with "
            "`.venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/compressed_allreduce.py`"
        )
        return

    from shoal.comms import (
        MPICollective,
        compressed_allreduce,
        compressed_allreduce_bytes,
        compressed_allreduce_init,
    )
    from shoal.comms.wire import all_reduce_bytes

    coll = MPICollective()
    p, rank, n = coll.size, comm.Get_rank(), args.n
    x = jnp.asarray(np.random.default_rng(rank).standard_normal(n, dtype=np.float32))

    dense = jax.jit(lambda x: coll.all_reduce(x, "mean"))
    compressed = jax.jit(
        lambda x, we, se: compressed_allreduce(x, we, se, collective=coll),
        donate_argnums=(1, 2),
    )
    we, se = compressed_allreduce_init(n, p)

    # Warm up (compile) and check the compressed mean points the same way as the true one.
    mean = jax.block_until_ready(dense(x))
    y, we, se = jax.block_until_ready(compressed(x, we, se))
    agree = float(jnp.mean(jnp.sign(y) == jnp.sign(mean)))

    def timed(fn):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)

    t_dense, t_comp = [], []
    for _ in range(args.reps):
        t_dense.append(timed(lambda: jax.block_until_ready(dense(x))))

        def run_compressed():
            nonlocal we, se
            y, we, se = compressed(x, we, se)
            jax.block_until_ready(y)

        t_comp.append(timed(run_compressed))

    if rank == 0:
        b_dense = all_reduce_bytes(4 * n, p)[0]
        b_comp = compressed_allreduce_bytes(n, p)[0]
        t_d, t_c = np.median(t_dense) * 1e3, np.median(t_comp) * 1e3
        print(f"compressed_allreduce vs float32 all_reduce: n = {n}, P = {p} MPI ranks")
        print(f"  host: {platform.processor() or platform.machine()}, jax {jax.__version__}")
        print(f"  bytes sent per worker:  float32 {b_dense:>12d}   compressed {b_comp:>10d}")
        print(f"  bytes ratio (float32 / compressed): {b_dense / b_comp:.2f}x")
        print(f"  wall time, median of {args.reps}: float32 {t_d:.1f} ms   compressed {t_c:.1f} ms")
        print(f"  wall-time ratio (float32 / compressed): {t_d / t_c:.2f}x")
        print(f"  sign agreement of the first compressed output with the mean: {agree:.3f}")


if __name__ == "__main__":
    main()
