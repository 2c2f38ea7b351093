"""Out of memory under an address-space limit (``ulimit -v``, ``RLIMIT_AS``): one line on
stderr and a non-zero exit, never a hang.

Why a run hung: XLA:CPU (jaxlib 0.10) runs a computation on its own thread pool whenever
one of its inputs is not ready yet or async dispatch is on (the default), and it allocates
the computation's outputs and temporaries there, when the inputs are ready
(``CpuPjRtRawLoadedExecutable::Execute``, ``BufferAlloc::Allocate``). When ``malloc``
fails (``mmap``: ``ENOMEM`` under the limit), ``BufferAlloc`` marks that one buffer as
failed and returns: the buffers after it are never allocated, nor marked. The
execution's event does carry the error (``RESOURCE_EXHAUSTED: Out of memory allocating N
bytes``), but ``jax.device_get`` / ``np.asarray`` of an output waits on the output's
*memory* (``CpuRawBuffer::OpaqueDeviceMemoryDataPointer`` -> ``tsl::BlockUntilReady``),
which never arrives: every thread idle, forever. ``jax.block_until_ready`` waits on the
execution's event instead, and raises the error. Disabling async dispatch
(``jax_cpu_enable_async_dispatch``) is not enough: a batch copied from NumPy (over 100
KiB) is an input that is not ready yet, so the step still runs on the pool.

So the runner calls `ready` on a step's results before it reads any of them, and turns
the error into one line with `oom_message`.
"""

from __future__ import annotations

import re
import resource
from typing import Any

import jax

# float32: what one parameter of one worker takes in bytes.
ITEMSIZE = 4
# Copies of parameters x workers that a simulated step keeps alive at once, about: the
# parameters and the optimizer state (momentum) in, and both again out (no donation).
# Measured with S-SGD (momentum 0.9) at 5000 and 10000 workers: 4.5 and 4.3 copies of
# resident memory above what the process held before training.
STEP_COPIES = 4
_OOM_MARKS = ("RESOURCE_EXHAUSTED", "Out of memory", "std::bad_alloc")


def address_space_limit() -> int | None:
    """This process's address-space limit in bytes (the soft ``RLIMIT_AS``, what ``ulimit
    -v`` sets), or None when there is none."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


def address_space_used() -> int | None:
    """The address space this process has mapped now in bytes (``VmSize``: what
    ``RLIMIT_AS`` limits), or None where ``/proc`` does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def estimate_bytes(count: float, copies: float = STEP_COPIES) -> int:
    """Bytes of ``copies`` float32 copies of ``count`` parameters x workers."""
    return int(count * ITEMSIZE * copies)


def ready(tree: Any) -> Any:
    """``tree`` (a step's results) once computed; raises the computation's error, such as
    XLA's ``RESOURCE_EXHAUSTED``, where ``jax.device_get`` of it would wait forever (module
    docstring). Call it before reading any of a step's results on the host."""
    return jax.block_until_ready(tree)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure: Python's ``MemoryError`` or XLA's."""
    if isinstance(error, MemoryError):
        return True
    return isinstance(error, jax.errors.JaxRuntimeError) and any(
        mark in str(error) for mark in _OOM_MARKS
    )


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _limit_text(limit: int | None, used: int | None) -> str:
    if limit is None:
        return "no address-space limit: the machine's memory"
    held = f", {_gb(used)} in use" if used is not None else ""
    return f"address-space limit ulimit -v {limit // 1024} KiB = {_gb(limit)}{held}"


def _need_text(count: float | None, workers: int | None, copies: float) -> str:
    if not count:
        return ""
    if workers:
        who = f"{workers} workers x {count / workers:.0f} parameters"
    else:
        who = f"{count:.3g} parameters x workers"
    return (f"; {who} need about {_gb(estimate_bytes(count, copies))} "
            f"({copies:g} float32 copies of {_gb(estimate_bytes(count, 1))})")  # fmt: skip


def oom_message(error: BaseException, count: float | None = None,
                workers: int | None = None) -> str | None:  # fmt: skip
    """One line for an out-of-memory ``error`` (None when ``error`` is not one), naming
    the allocation that failed, the address-space limit and what the run needs.

    Args:
      error: what training raised (`is_out_of_memory`).
      count: parameters of one worker's model times the workers of this process, if known.
      workers: the number of workers, if known (for the wording).
    """
    if not is_out_of_memory(error):
        return None
    text = str(error).strip()
    size = re.search(r"allocating (\d+) bytes", text)
    if size:
        what = f"XLA could not allocate {_gb(int(size.group(1)))}"
    else:
        what = text.splitlines()[0] if text else type(error).__name__
    return (f"out of memory: {what} ({_limit_text(address_space_limit(), address_space_used())})"
            f"{_need_text(count, workers, STEP_COPIES)}: "
            "run fewer workers (--workers) or raise the limit")  # fmt: skip
