"""The kernels' GPU lowering checked on a machine without one, and the kernel tests run
on one (``benchmarks/gpu_check.py`` runs them on the device).

From jax 0.11, Pallas' Triton lowering asks which GPU it compiles for and fails on a
machine without one ("No supported GPU devices found, please specify an abstract GPU
device"); an abstract H100 (compute capability 9.0, the GPU this project is lent) answers
it. jax 0.10 lowers without asking and takes the abstract mesh as well.
"""

from __future__ import annotations

import jax

H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")


def lower_for_cuda(fn, *args):
    """``jax.jit(fn)`` traced on ``args`` and lowered for CUDA on an H100, GPU or not (the
    abstract device must be in place while tracing, not only while lowering)."""
    # Auto axes: an Explicit one (the default) would also turn on sharding in types.
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.sharding.AbstractMesh((1,), ("gpu",), axis_types=auto, abstract_device=H100)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"
