"""Stage 1, the environment: devices, memory, jax/jaxlib and CUDA versions, and the
packages shoal imports (their versions, or what is missing and must be carried)."""

from __future__ import annotations

import importlib
import importlib.util
import platform
import subprocess
import sys
from importlib import metadata

# What shoal and this script import, by distribution name -> module. mpi4jax is optional
# (the MPI collective): its absence is expected on the GPU machine.
NEEDED = {
    "jax": "jax",
    "jaxlib": "jaxlib",
    "numpy": "numpy",
    "ml_dtypes": "ml_dtypes",
    "optax": "optax",
    "flax": "flax",
    "orbax-checkpoint": "orbax.checkpoint",
    "tqdm": "tqdm",
    "matplotlib": "matplotlib",
    "pytest": "pytest",
}
OPTIONAL = {"mpi4jax": "mpi4jax", "mpi4py": "mpi4py"}
# The command that fetches a missing wheel here, for the device's Python 3.12 (the device
# tool's README): it then travels in .whl/ with the repository.
CARRY = (
    "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 "
    "--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 "
    "-d .whl {name}=={version}"
)

COLUMNS = [("item", "item"), ("value", "value")]


def versions(table: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """{distribution: version} of what imports, and the names that do not."""
    found, missing = {}, []
    for dist, module in table.items():
        try:
            importlib.import_module(module)
            found[dist] = metadata.version(dist)
        except Exception as err:  # an import that fails for any reason is a missing package
            missing.append(f"{dist} ({type(err).__name__}: {err})")
    return found, missing


def missing_packages_quick() -> list[str]:
    """The distributions of `NEEDED` whose module is not installed, found without
    importing them (the parent's preflight, before any stage starts)."""
    missing = []
    for dist, module in NEEDED.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent of a dotted name is missing
            found = False
        if not found:
            missing.append(dist)
    return missing


def nvidia_smi() -> str:
    query = "name,driver_version,memory.total,clocks.max.sm,clocks.max.mem"
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"not run ({type(err).__name__})"
    return done.stdout.strip() or done.stderr.strip()


def run(record, ctx) -> bool:
    import jax

    dev = jax.devices()[0]
    record.set(device=ctx.device_name())
    record.row(item="python", value=f"{platform.python_version()} ({sys.executable})")
    record.row(item="machine", value=f"{platform.machine()}, {ctx.cpu_count()} CPU cores")
    record.row(item="backend", value=jax.default_backend())
    record.row(
        item="devices", value=", ".join(f"{d.device_kind} ({d.platform})" for d in jax.devices())
    )
    cc = getattr(dev, "compute_capability", None)
    if cc is not None:
        record.row(item="compute capability", value=str(cc))
    stats = dev.memory_stats() or {}
    if "bytes_limit" in stats:
        record.row(item="device memory for JAX", value=f"{stats['bytes_limit'] / 2**30:.1f} GiB")
    record.row(item="nvidia-smi", value=nvidia_smi() if ctx.gpu else "no GPU (rehearsal)")
    found, missing = versions(NEEDED)
    record.row(item="packages", value=", ".join(f"{k} {v}" for k, v in found.items()))
    optional, absent = versions(OPTIONAL)
    record.row(
        item="optional packages",
        value=", ".join(
            [
                *(f"{k} {v}" for k, v in optional.items()),
                *(f"{a.split(' ')[0]} absent" for a in absent),
            ]
        ),
    )
    info = jax.print_environment_info(return_string=True)
    cuda = [line.strip() for line in info.splitlines() if "cuda" in line.lower()]
    if cuda:
        record.row(item="CUDA (jax)", value="; ".join(cuda[:6]))
    for m in missing:
        wheel = CARRY.format(name=m.split(" ")[0], version="VERSION")
        record.note(f"missing: {m}; carry its wheel: {wheel}")
    if not (ctx.gpu or ctx.rehearse):
        record.note("no GPU: JAX sees only the CPU (--rehearse runs the stages there, tiny)")
    return not missing and (ctx.gpu or ctx.rehearse)
