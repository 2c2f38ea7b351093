"""A worker that spans several devices: one axis of a mesh is the workers, the others
shard each worker's parameters (FSDP, tensor parallel), as in ``Mesh(devices,
("workers", "fsdp"))``.

Inside ``jax.shard_map`` (with its default ``check_vma=True``) every device holds its
shard of its worker's leaves, and shoal's collectives pair the devices that hold the same
shard of different workers: an element-wise algorithm (S-SGD, BMUF, SMA, peer averaging)
is then exactly the one-device-per-worker algorithm. What is a property of a worker's
whole gradient (a non-finite flag, a norm, a maximum) must also be reduced over the
worker's own devices; the helpers here do that. Which axes those are is read from the
value's type: the mesh axes it varies over, except the collectives' worker axes. A leaf
replicated over ``"fsdp"`` does not vary over it and is counted once. Under ``vmap``, MPI
or one device per worker nothing varies over such an axis and every helper is the
identity.

Traffic among a worker's own devices (a flag, a norm: a few bytes) is not in the wire
counts, which count the bytes between workers.

Example::

    sq_w, sq_b = worker_sums([jnp.sum(w * w), jnp.sum(b * b)], collective)  # whole leaves
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax

from shoal.vma import axes_of


def _worker_axis_names(collectives: Any) -> set[str]:
    if not isinstance(collectives, (list, tuple)):
        collectives = (collectives,)
    return {c.axis_name for c in collectives if hasattr(c, "axis_name")}


def worker_axes(x: Any, collectives: Any) -> tuple[str, ...]:
    """The mesh axes that shard ``x`` within a worker: those ``x`` varies over, other than
    the workers' axes (of ``collectives``, one or a sequence)."""
    return tuple(sorted(axes_of(x) - _worker_axis_names(collectives)))


def worker_sums(xs: Sequence[Any], collectives: Any) -> list[Any]:
    """Each scalar in ``xs`` (e.g. one squared norm per leaf) summed over the devices of
    its worker that hold different shards: one collective per distinct set of shard
    axes, not one per scalar."""
    out = list(xs)
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, x in enumerate(xs):
        groups.setdefault(worker_axes(x, collectives), []).append(i)
    for axes, idx in groups.items():
        if axes:
            summed = lax.psum(jnp.stack([xs[i] for i in idx]), axes)
            for j, i in enumerate(idx):
                out[i] = summed[j]
    return out


def worker_max(x: Any, collectives: Any) -> Any:
    """``x`` maximised over the devices of its worker that hold different shards (a
    flag: true if any shard's is)."""
    axes = worker_axes(x, collectives)
    if not axes:
        return x
    if x.dtype == bool:
        return lax.pmax(x.astype("int32"), axes).astype(bool)
    return lax.pmax(x, axes)


def worker_size(x: Any, collectives: Any) -> int:
    """Elements of the whole leaf of which ``x`` is this device's shard (static)."""
    axes = worker_axes(x, collectives)
    return math.prod(x.shape) * math.prod(int(lax.psum(1, a)) for a in axes)


def check_sharded_alike(name: str, leaves: Sequence[Any], collectives: Any) -> None:
    """Refuse a fused buffer whose leaves are sharded differently within a worker: a leaf
    replicated over a worker's devices would get a different update on each."""
    kinds = {worker_axes(x, collectives) for x in leaves}
    if len(kinds) > 1:
        raise ValueError(
            f"{name} fuses all leaves into one buffer, so within a worker every leaf must "
            f"be sharded over the same mesh axes; got leaves sharded over "
            f"{sorted(kinds)}. Shard every leaf alike (or exchange the replicated ones "
            f"with allreduce_gradients)"
        )
