"""glibc malloc settings under which XLA:CPU reuses its large buffers instead of
re-faulting them every step.

XLA:CPU takes every step's temporaries (gradients, all-reduce buffers) from ``malloc``.
glibc serves an allocation above its mmap threshold (at most 32 MB) with a fresh
``mmap`` and gives it back with ``munmap`` on free, so each step pays one page fault per
4 KiB page of every large buffer, again and again: on a 2-core machine a jitted
``x + 1`` on 64 MB takes 18 ms that way and 3.3 ms with the heap kept (a read of the
same buffer: 1.3 ms). With ``mmap_max=0`` glibc serves large blocks from the heap, with
the largest ``trim_threshold`` it keeps freed ones for the next step, and with
``arena_max=1`` every thread (XLA's pool) shares that heap. The process then keeps its
peak memory until it exits.

glibc reads ``GLIBC_TUNABLES`` when a process starts, so `reexec_with_tunables` restarts
the current command with them (``shoal-run`` and ``benchmarks/sim_scale.py`` call it
first thing); ``SHOAL_MALLOC=system`` keeps glibc's defaults. In your own scripts, export
``GLIBC_TUNABLES`` as `TUNABLES` says before starting Python.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967295:glibc.malloc.arena_max=1"
_MARK = "SHOAL_MALLOC_REEXEC"


def wanted() -> bool:
    """Whether this process should run under `TUNABLES` and does not yet."""
    if os.environ.get("SHOAL_MALLOC", "tuned") == "system" or os.environ.get(_MARK):
        return False
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    return "glibc.malloc.mmap_max" not in os.environ.get("GLIBC_TUNABLES", "")


def reexec_with_tunables() -> None:
    """Restart this command (same interpreter, arguments, PID and open files) with
    `TUNABLES` added to ``GLIBC_TUNABLES``; returns at once if it is not `wanted`.

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
