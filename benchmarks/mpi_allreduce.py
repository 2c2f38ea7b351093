"""Benchmark: shoal's MPI all-reduces against mpi4py on NumPy arrays, side by side.

Usage: ``.venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/mpi_allreduce.py
[--n 16777216] [--reps 10]``

Four things are timed, interleaved in one run (each rep starts after a barrier; a rep's
time is the slowest rank's; medians):

* ``numpy``: mpi4py's ``Allreduce`` of a NumPy float32[n] into a preallocated array (the
  floor for a float32 all-reduce from Python);
* ``all_reduce``: ``MPICollective.all_reduce(x, "mean")``, jitted;
* ``compressed``: `shoal.comms.OneBit`'s ``mean`` with its error buffers donated, as
  1-bit Adam/LAMB run it;
* ``floor``: a jitted pass that reads ``x`` and an error buffer and writes the buffer (in
  place) and a float32[n] result: the least memory any error-feedback compressor moves.

It prints the two ratios of issue 17 (``all_reduce / numpy``, ``compressed / all_reduce``),
``floor / all_reduce``, minor page faults per call, and the bytes each worker sends.

Like ``shoal-run --backend mpi`` it runs with the heap kept (`shoal.experiments.runner.malloc`;
``SHOAL_MALLOC=system`` for glibc's defaults, where every call page-faults its fresh
result). Without mpiexec (one process) there is nobody to talk to: it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import time

from shoal.experiments.runner.malloc import reexec_with_tunables


def main() -> None:
    reexec_with_tunables(default="keep")  # before MPI_Init, as shoal-run --backend mpi
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1 << 24, help="float32 values per rank")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    if args.n < 1 or args.reps < 1:
        parser.error("--n and --reps must be >= 1")

    try:
        from mpi4py import MPI
    except ImportError:
        print("mpi_allreduce benchmark: mpi4py is not installed, skipped")
        return
    if MPI.COMM_WORLD.Get_size() == 1:
        print(
            "mpi_allreduce benchmark: skipped in a single process; run it with "
            "`.venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/mpi_allreduce.py`"
        )
        return

    import jax
    import jax.numpy as jnp
    import numpy as np

    from shoal.comms import MPICollective, OneBit
    from shoal.comms.wire import all_reduce_bytes

    coll = MPICollective()
    comm = MPI.COMM_WORLD.Clone()  # mpi4py's own traffic, apart from shoal's and timing's
    timing = MPI.COMM_WORLD
    p, rank, n = coll.size, timing.Get_rank(), args.n
    x_np = np.random.default_rng(rank).standard_normal(n, dtype=np.float32)
    out_np = np.empty_like(x_np)
    x = jnp.asarray(x_np)

    dense = jax.jit(lambda x: coll.all_reduce(x, "mean"))
    codec = OneBit()
    compressed = jax.jit(
        lambda x, memory: codec.mean(x, memory, collective=coll),
        donate_argnums=1,
    )
    floor = jax.jit(lambda x, e: (x + e, x - e), donate_argnums=1)
    state = {"compressed": codec.init(n, p), "floor": jnp.zeros(n, jnp.float32)}

    def run_compressed():
        y, state["compressed"] = compressed(x, state["compressed"])
        return y

    def run_floor():
        state["floor"], y = floor(x, state["floor"])
        return y

    cases = {
        "numpy": lambda: comm.Allreduce(x_np, out_np, op=MPI.SUM),
        "all_reduce": lambda: dense(x),
        "compressed": run_compressed,
        "floor": run_floor,
    }
    # Warm up (compile), and check the results against NumPy's.
    for run in cases.values():
        jax.block_until_ready(run())
    mean = np.asarray(dense(x))
    np.testing.assert_allclose(mean, out_np / p, rtol=1e-6, atol=1e-6)
    agree = float(np.mean(np.sign(np.asarray(run_compressed())) == np.sign(mean)))

    times = {k: [] for k in cases}
    faults = {k: [] for k in cases}
    for _ in range(args.reps):
        for name, run in cases.items():
            timing.Barrier()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            jax.block_until_ready(run())
            elapsed = time.perf_counter() - start
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            times[name].append(timing.allreduce(elapsed, op=MPI.MAX))

    if rank != 0:
        return
    ms = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
    sent = {
        "numpy": all_reduce_bytes(4 * n, p)[0],
        "all_reduce": all_reduce_bytes(4 * n, p)[0],
        "compressed": codec.wire_bytes(n, p)[0],
        "floor": 0,
    }
    tunables = os.environ.get("GLIBC_TUNABLES")
    malloc = f"heap kept (GLIBC_TUNABLES={tunables})" if tunables else "glibc defaults"
    print(f"n = {n} float32 per rank, P = {p} MPI ranks, {platform.machine()}, "
          f"{os.cpu_count()} cores, jax {jax.__version__}, malloc: {malloc}; "
          f"median of {args.reps} interleaved reps, a rep = the slowest rank")  # fmt: skip
    print()
    print(
        "| case | ms | / all_reduce | minor page faults per call (rank 0) | bytes sent per worker |"
    )
    print("|---|---:|---:|---:|---:|")
    for name in cases:
        print(f"| {name} | {ms[name]:.1f} | {ms[name] / ms['all_reduce']:.2f} | "
              f"{int(np.median(faults[name]))} | {sent[name]} |")  # fmt: skip
    print()
    print(f"all_reduce / numpy: {ms['all_reduce'] / ms['numpy']:.2f} (target <= 1.3)")
    print(f"compressed / all_reduce: {ms['compressed'] / ms['all_reduce']:.2f} (target <= 0.5)")
    print(f"floor / all_reduce: {ms['floor'] / ms['all_reduce']:.2f} (read x and e, write e and y)")
    print(f"sign agreement of a compressed result with the mean: {agree:.3f}")


if __name__ == "__main__":
    main()
