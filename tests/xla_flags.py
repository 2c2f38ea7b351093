"""The XLA flags the tests compile with, for the installed jaxlib.

Tests compile for speed of compilation, most of this suite's time: LLVM at -O0 (XLA's HLO
passes still run; XLA:CPU uses no fast-math, so the float semantics are the same) and, on
jaxlib 0.10, XLA:CPU's older loop emitters instead of its MLIR fusion emitters (half the
compile time of a training step). jaxlib 0.11 removed that flag, and XLA ends the process
on a flag it does not know (``Unknown flag in XLA_FLAGS``, exit status 1, and under pytest
not a line of output), so it is asked for only where it exists.

``tests/conftest.py`` adds these to ``XLA_FLAGS``; the Makefile's notebook runs print them
with ``python tests/xla_flags.py``. Reads the jaxlib version from its metadata, without
importing JAX.
"""

from __future__ import annotations

from importlib import metadata

# The last jaxlib release whose XLA:CPU has --xla_cpu_use_fusion_emitters.
_LAST_WITH_LOOP_EMITTERS = (0, 10)


def jaxlib_version() -> tuple[int, int]:
    major, minor = metadata.version("jaxlib").split(".")[:2]
    return int(major), int(minor)


def flags() -> tuple[str, ...]:
    """The flags, each ``--name=value``."""
    out = ["--xla_backend_optimization_level=0"]
    if jaxlib_version() <= _LAST_WITH_LOOP_EMITTERS:
        out.append("--xla_cpu_use_fusion_emitters=false")
    return tuple(out)


if __name__ == "__main__":
    print(" ".join(flags()))
