"""`AxisCollective`: collectives over a named JAX axis (simulated workers or a device mesh).

Inside ``jax.vmap(f, axis_name=name)`` the N workers live in one process and the
collectives are exact array operations; inside ``shard_map`` over a mesh axis they
are XLA collectives across devices (and processes, with ``jax.distributed``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from shoal.comms.collective import (
    check_all_to_all,
    check_op,
    check_perm,
    check_root,
    check_size,
)

_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


@dataclasses.dataclass(frozen=True)
class AxisCollective:
    """Collectives over the named axis ``axis_name`` whose size must be ``size``.

    Example::

        coll = AxisCollective("workers", 4)
        step = jax.vmap(lambda g: coll.all_reduce(g), axis_name="workers")
    """

    axis_name: str
    size: int

    def __post_init__(self):
        if not isinstance(self.axis_name, str) or not self.axis_name:
            raise ValueError(f"axis_name must be a non-empty str, got {self.axis_name!r}")
        check_size(self.size)

    def _check_axis(self) -> None:
        # Called at trace time: a vmap over the wrong number of workers would otherwise
        # silently give a wrong mean or a wrong rank range.
        try:
            actual = lax.psum(1, self.axis_name)
        except NameError as e:
            raise ValueError(
                f"AxisCollective({self.axis_name!r}) used outside a vmap/shard_map "
                f"with axis_name={self.axis_name!r}"
            ) from e
        if int(actual) != self.size:
            raise ValueError(
                f"AxisCollective({self.axis_name!r}, size={self.size}) is used under an "
                f"axis of size {int(actual)}"
            )

    def rank(self) -> jax.Array:
        self._check_axis()
        return lax.axis_index(self.axis_name).astype(jnp.int32)

    def all_reduce(self, tree: Any, op: str = "mean") -> Any:
        check_op(op)
        self._check_axis()
        if op == "mean":
            return jax.tree.map(self._pmean, tree)
        fn = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}[op]
        return jax.tree.map(lambda x: fn(x, self.axis_name), tree)

    def _pmean(self, x):
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            raise TypeError(f"all_reduce(op='mean') needs a floating leaf, got dtype {x.dtype}")
        return lax.pmean(x, self.axis_name)

    def all_gather(self, x: jax.Array) -> jax.Array:
        self._check_axis()
        return lax.all_gather(x, self.axis_name)

    def all_to_all(self, x: jax.Array) -> jax.Array:
        check_all_to_all(x, self.size)
        self._check_axis()
        return lax.all_to_all(x, self.axis_name, split_axis=0, concat_axis=0)

    def broadcast(self, tree: Any, root: int = 0) -> Any:
        check_root(root, self.size)
        self._check_axis()
        is_root = lax.axis_index(self.axis_name) == root

        def one(x):
            x = jnp.asarray(x)
            # Sum root's bits with zeros in an unsigned type: exact for every dtype,
            # including -0.0 and NaN payloads, which a float psum would not keep.
            width = x.dtype.itemsize
            bits = (
                x.astype(jnp.uint8)
                if x.dtype == jnp.bool_
                else lax.bitcast_convert_type(x, _UINT_OF_WIDTH[width])
            )
            bits = lax.psum(jnp.where(is_root, bits, jnp.zeros_like(bits)), self.axis_name)
            if x.dtype == jnp.bool_:
                return bits.astype(jnp.bool_)
            return lax.bitcast_convert_type(bits, x.dtype)

        return jax.tree.map(one, tree)

    def ppermute(self, x: jax.Array, perm: Sequence[tuple[int, int]]) -> jax.Array:
        pairs = check_perm(perm, self.size)
        self._check_axis()
        # vmap's ppermute needs a full permutation: route the idle workers among
        # themselves, then zero what the workers outside ``perm``'s destinations got.
        free_src = sorted(set(range(self.size)) - {s for s, _ in pairs})
        free_dst = sorted(set(range(self.size)) - {d for _, d in pairs})
        full = pairs + tuple(zip(free_src, free_dst))
        y = lax.ppermute(x, self.axis_name, full)
        if not free_dst:
            return y
        is_dest = jnp.isin(
            lax.axis_index(self.axis_name), jnp.asarray([d for _, d in pairs] or [-1])
        )
        return jnp.where(is_dest, y, jnp.zeros_like(y))

    def split(
        self, group_size: int, *, intra_axis: str = "member", inter_axis: str = "group"
    ) -> tuple[AxisCollective, AxisCollective]:
        """Two-tier collectives for nested axes ``vmap(vmap(f, intra_axis), inter_axis)``.

        Worker ``w`` of this collective is member ``w % group_size`` of group
        ``w // group_size`` (groups of consecutive workers). Reshape per-worker
        arrays from ``[size, ...]`` to ``[size // group_size, group_size, ...]``.
        """
        from shoal.comms.groups import check_group_size

        groups = check_group_size(self.size, group_size)
        return AxisCollective(intra_axis, group_size), AxisCollective(inter_axis, groups)
