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
6.6x against 2.7x (`benchmarks/sim_scale.py`). So glibc's defaults stay the default.

``SHOAL_MALLOC=keep`` makes ``shoal-run`` and ``benchmarks/sim_scale.py`` restart
themselves with `TUNABLES` (`reexec_with_tunables`, first thing: glibc reads
``GLIBC_TUNABLES`` only when a process starts). In your own scripts, export
``GLIBC_TUNABLES`` as `TUNABLES` says before starting Python.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967295:glibc.malloc.arena_max=1"
_MARK = "SHOAL_MALLOC_REEXEC"


def wanted() -> bool:
    """Whether ``SHOAL_MALLOC=keep`` asks for `TUNABLES` and this process does not run
    under them yet."""
    if os.environ.get("SHOAL_MALLOC", "system") != "keep" or os.environ.get(_MARK):
        return False
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    return "glibc.malloc.mmap_max" not in os.environ.get("GLIBC_TUNABLES", "")


def reexec_with_tunables() -> None:
    """Restart this command (same interpreter, arguments, PID and open files) with
    `TUNABLES` added to ``GLIBC_TUNABLES`` when ``SHOAL_MALLOC=keep``; otherwise (or
    when they are set already) returns at once.

    Call it before anything starts threads or MPI: ``os.execv`` replaces the process.
    """
    if not wanted():
        return
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES"), TUNABLES) if t)
    env[_MARK] = "1"  # once: a glibc that ignores the tunables must not loop
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
