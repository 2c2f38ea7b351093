"""glibc malloc settings under which XLA:CPU reuses its large buffers instead of
re-faulting them every step: opt-in, because they can also double the peak memory.

XLA:CPU takes every step's temporaries (gradients, all-reduce buffers) from ``malloc``.
glibc serves an allocation above its mmap threshold (at most 32 MB) with a fresh
``mmap`` and gives it back with ``munmap`` on free, so each step pays one page fault per
4 KiB page of every large buffer, again and again: on a 2-core machine a jitted
``x + 1`` on 64 MB takes 18 ms that way and 3.3 ms with the heap kept (a read of the
same buffer: 1.3 ms). With ``mmap_max=0`` glibc serves large blocks from the heap, with
the largest ``trim_threshold`` it keeps freed ones for the next step, and with
``arena_max=1`` every thread (XLA's pool) shares that heap.

The cost: the heap never shrinks and fragments. At 1.05M parameters x 16 simulated
workers S-SGD runs at 1.58x local SGD with the heap kept against 2.22x without; at 4.2M
x 64, GTC's step peaks at 23.8 GB of RSS with it against 10.3 GB without and runs at
6.6x against 2.7x (`benchmarks/sim_scale.py`). So simulated workers keep glibc's defaults.

One worker per process (MPI ranks, ``jax.distributed``) has no such fragmentation to fear
and the most to gain: ``MPICollective.all_reduce`` of 16M float32 on 4 ranks takes 1.7x
mpi4py's ``Allreduce`` of NumPy arrays with glibc's defaults (each call faults in a fresh
64 MB result, and MPICH its own 32 MB scratch) and 1.1x with the heap kept
(``benchmarks/mpi_allreduce.py``). So ``shoal-run --backend mpi|jax`` keeps the heap unless
``SHOAL_MALLOC=system``; simulated workers keep glibc's defaults unless
``SHOAL_MALLOC=keep``.

``shoal-run``, ``benchmarks/sim_scale.py`` and ``benchmarks/mpi_allreduce.py`` restart
themselves with `TUNABLES` (`reexec_with_tunables`, first thing: glibc reads
``GLIBC_TUNABLES`` only when a process starts; under ``mpiexec`` every rank restarts before
``MPI_Init``). In your own scripts, export ``GLIBC_TUNABLES`` as `TUNABLES` says before
starting Python (or ``mpiexec``).
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967295:glibc.malloc.arena_max=1"
_MARK = "SHOAL_MALLOC_REEXEC"


def wanted(default: str = "system") -> bool:
    """Whether ``SHOAL_MALLOC`` (``default`` when unset) is ``keep`` and this process does
    not run under `TUNABLES` yet."""
    if os.environ.get("SHOAL_MALLOC", default) != "keep" or os.environ.get(_MARK):
        return False
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    return "glibc.malloc.mmap_max" not in os.environ.get("GLIBC_TUNABLES", "")


def reexec_with_tunables(default: str = "system") -> None:
    """Restart this command (same interpreter, arguments, PID and open files) with
    `TUNABLES` added to ``GLIBC_TUNABLES`` when ``SHOAL_MALLOC`` is ``keep``; otherwise (or
    when they are set already) returns at once.

    Call it before anything starts threads or MPI: ``os.execv`` replaces the process.

    Args:
      default: the setting when ``SHOAL_MALLOC`` is unset: ``"system"`` (glibc's
        defaults) or ``"keep"``.
    """
    if not wanted(default):
        return
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES"), TUNABLES) if t)
    env[_MARK] = "1"  # once: a glibc that ignores the tunables must not loop
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
