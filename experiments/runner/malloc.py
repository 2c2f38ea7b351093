"""glibc malloc settings under which XLA:CPU's large buffers cost fewer page faults every
step: the heap kept, and transparent huge pages for the largest simulated runs.

XLA:CPU takes every step's temporaries (gradients, all-reduce buffers) from ``malloc``.
glibc serves an allocation above its mmap threshold (at most 32 MB) with a fresh
``mmap`` and gives it back with ``munmap`` on free, so each step pays one page fault per
4 KiB page of every large buffer, again and again, and the kernel zeroes each page: on a
2-core machine a jitted ``x + 1`` on 64 MB takes 18 ms that way and 3.3 ms with the heap
kept (a read of the same buffer: 1.3 ms). Two settings (``SHOAL_MALLOC``) take that cost
away:

* ``keep``: `TUNABLES`. With ``mmap_max=0`` glibc serves large blocks from the heap, with
  the largest ``trim_threshold`` it keeps freed ones for the next step, and with
  ``arena_max=1`` every thread (XLA's pool) shares that heap. Each page faults once.
  ``MPICollective.all_reduce`` of 16M float32 on 4 ranks takes 1.7x mpi4py's
  ``Allreduce`` of NumPy arrays with glibc's defaults (each call faults in a fresh 64 MB
  result, and MPICH its own 32 MB scratch) and 1.1x with the heap kept
  (``benchmarks/mpi_allreduce.py``). Simulated workers at 1.05M params x 64: BMUF's block
  step took 239 ms with the heap kept and 400 ms with huge pages (local SGD: 149 and
  156 ms), and 1-bit LAMB's compressed step 2.3x local SGD's against 2.4-3.5x
  (`benchmarks/sim_scale.py`). But the heap never shrinks and fragments over many large
  buffers: at 4.2M x 64 (S-SGD and GTC in one process) it peaked at 15.9 GB of RSS
  against 8.8 GB with huge pages.
* ``huge``: ``glibc.malloc.hugetlb=1``. glibc asks the kernel for transparent huge pages
  (``madvise(MADV_HUGEPAGE)``) on the blocks it maps, which then fault 2 MB at a time.
  Blocks are still unmapped on free, so peak memory is what it was, but every step's
  temporaries are faulted and zeroed afresh. Nothing changes where the kernel's THP mode
  is ``never``.

``shoal-run`` keeps the heap (MPI ranks, ``jax.distributed`` processes and simulated
workers), except for simulated workers whose parameters x workers exceed `KEEP_LIMIT`:
once it has built a config's model, ``shoal-run`` restarts with huge pages for those
(`restart_simulated`; a study keeps the setting it started with), unless
``SHOAL_MALLOC`` says otherwise (``system``: glibc's defaults). ``shoal-run``,
``benchmarks/sim_scale.py`` (each case started as ``shoal-run`` would run it,
`simulated_env`), ``benchmarks/sim_profile.py`` and ``benchmarks/mpi_allreduce.py``
restart themselves with the setting's tunables (`reexec_with_tunables`, first thing:
glibc reads ``GLIBC_TUNABLES`` only when a process starts; under ``mpiexec`` every rank
restarts before ``MPI_Init``). In your own scripts, export ``GLIBC_TUNABLES`` as
`SETTINGS` says before starting Python (or ``mpiexec``).
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967295:glibc.malloc.arena_max=1"
HUGE_PAGES = "glibc.malloc.hugetlb=1"
SETTINGS = {"huge": HUGE_PAGES, "keep": TUNABLES}  # SHOAL_MALLOC -> GLIBC_TUNABLES added
# shoal-run's setting when SHOAL_MALLOC is unset (`reexec_with_tunables`).
RUNNER_DEFAULT = "keep"
_MARK = "SHOAL_MALLOC_REEXEC"  # set on restart, to the setting whose tunables were added
# Simulated workers keep the heap up to this many parameters x workers (0.8 GB of float32
# per copy of the model over the workers), and take huge pages above it (module docstring).
KEEP_LIMIT = 2e8
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_possible() -> bool:
    """Whether the kernel may back a block with transparent huge pages on request."""
    try:
        return "[never]" not in _THP.read_text()
    except OSError:
        return False


def wanted(default: str = "system") -> str | None:
    """The tunables that ``SHOAL_MALLOC`` (``default`` when unset) asks for and this
    process does not run under yet, or None (``system``, an unknown value, not glibc,
    restarted once already, or huge pages the kernel cannot give)."""
    setting = os.environ.get("SHOAL_MALLOC", default)
    tunables = SETTINGS.get(setting)
    if tunables is None or os.environ.get(_MARK):
        return None
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    if setting == "huge" and not _thp_possible():
        return None
    have = os.environ.get("GLIBC_TUNABLES", "")
    if all(t.split("=")[0] in have for t in tunables.split(":")):
        return None
    return tunables


def reexec_with_tunables(default: str = "system") -> None:
    """Restart this command (same interpreter, arguments, PID and open files) with the
    tunables of ``SHOAL_MALLOC`` (`SETTINGS`) added to ``GLIBC_TUNABLES``; returns at once
    when there are none to add (`wanted`).

    Call it before anything starts threads or MPI: ``os.execv`` replaces the process.

    Args:
      default: the setting when ``SHOAL_MALLOC`` is unset: ``"system"`` (glibc's
        defaults), ``"huge"`` or ``"keep"``.
    """
    tunables = wanted(default)
    if tunables is None:
        return
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES"), tunables) if t)
    # Once: a glibc that ignores the tunables must not loop.
    env[_MARK] = os.environ.get("SHOAL_MALLOC", default)
    _execve(env)


def _execve(env: dict[str, str]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def simulated_env(count: float) -> dict[str, str]:
    """The environment for ``count`` simulated parameters x workers: this process's, or,
    where it keeps the heap by default (not by ``SHOAL_MALLOC``) and ``count`` exceeds
    `KEEP_LIMIT`, the same with huge pages in its place (``SHOAL_MALLOC=huge``).

    The kept heap fragments over many large buffers: at 4.2M parameters x 64 workers
    `benchmarks/sim_scale.py` peaked at 15.9 GB of RSS with it and 8.8 GB with huge pages.

    Args:
      count: parameters of one worker's model times the number of simulated workers.

    Returns:
      a new dict, to start a process with (or restart this one, `restart_simulated`).
    """
    env = dict(os.environ)
    if "SHOAL_MALLOC" in env or env.get(_MARK) != "keep" or count <= KEEP_LIMIT:
        return env
    tunables = env.get("GLIBC_TUNABLES", "").removesuffix(TUNABLES).rstrip(":")
    if _thp_possible():
        tunables = ":".join(t for t in (tunables, HUGE_PAGES) if t)
    env.update(SHOAL_MALLOC="huge", GLIBC_TUNABLES=tunables)
    env[_MARK] = "huge"
    return env


def restart_simulated(count: float, what: str) -> None:
    """Restart this command with huge pages where `simulated_env` says so (saying why on
    stderr), else return. Call it before the run has written anything: it starts again.

    Args:
      count: parameters of one worker's model times the number of simulated workers.
      what: the command's name, for the message.
    """
    env = simulated_env(count)
    if env.get(_MARK) == os.environ.get(_MARK):
        return
    print(f"{what}: {count:.3g} parameters x workers (over {KEEP_LIMIT:.0e}): restarting "
          "with huge pages (SHOAL_MALLOC=huge), whose peak memory the kept heap would "
          "exceed", file=sys.stderr)  # fmt: skip
    _execve(env)


def describe() -> str:
    """The malloc setting this process runs under, for a benchmark's header."""
    tunables = os.environ.get("GLIBC_TUNABLES")
    if not tunables:
        return "glibc defaults"
    names = [k for k, v in SETTINGS.items() if v in tunables]
    return f"GLIBC_TUNABLES={tunables}" + (f" (SHOAL_MALLOC={names[0]})" if names else "")
