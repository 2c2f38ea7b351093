"""Herring's balanced fusion buffers (BFB): a layout of all gradients in fixed-size buffers,
each split into equal shards, one per server.

Thangakrishnan et al., "Herring: Rethinking the Parameter Server at Scale for the Cloud"
(SC 2020), section III. Parameters are laid out back to back in the order their gradients
are produced in the backward pass (worker 0's order, broadcast to everyone, so no
negotiation is needed: `shoal.comms.gradient_order`) into buffers of exactly
``buffer_bytes`` (the last may be smaller); a parameter may span two buffers. Buffer ``b``
is cut into ``S`` equal shards and shard ``s`` of every buffer belongs to server ``s``:
every server receives the same bytes per buffer, whatever the sizes of the variables. The
classic baseline, `atomic_placement`, puts each variable whole on one server.

Everything here is static (shapes and dtypes only): plans are built at trace time and are
hashable, so they can close over jitted code.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from shoal.checks import check_int
from shoal.dtypes import promote_types

# Automatic buffer size: about this many buffers per iteration (the paper's 86684 KB buffer
# is about 1/8 of BERT-large's 680 MB fp16 gradient), but no shard below MIN_SHARD_BYTES,
# where per-message latency would dominate.
BUFFERS_PER_STEP = 8
MIN_SHARD_BYTES = 64 * 1024


class Segment(NamedTuple):
    """Elements ``[start, stop)`` of leaf ``leaf`` (flattened, in ``jax.tree.leaves``
    order) sit at ``offset`` in their buffer."""

    leaf: int
    start: int
    stop: int
    offset: int


def _shapes(params_or_shapes: Any):
    leaves, treedef = jax.tree.flatten(params_or_shapes)
    shapes = tuple(tuple(int(d) for d in jnp.shape(x)) for x in leaves)
    dtypes = tuple(np.dtype(x.dtype) for x in leaves)
    return treedef, shapes, dtypes


def _check_order(order: Sequence[int] | None, n: int) -> tuple[int, ...]:
    if order is None:
        return tuple(range(n))
    try:
        order = tuple(int(i) for i in order)
    except (TypeError, ValueError) as e:
        raise ValueError(f"order must be a sequence of leaf indices, got {order!r}") from e
    if sorted(order) != list(range(n)):
        raise ValueError(
            f"order must be a permutation of the {n} leaf indices 0..{n - 1}, got {order}"
        )
    return order


def _buffer_dtype(dtypes: tuple[np.dtype, ...]) -> np.dtype:
    if not dtypes:
        return np.dtype(np.float32)
    kinds = {jnp.issubdtype(d, jnp.inexact) for d in dtypes}
    if len(kinds) > 1:
        raise TypeError(
            "cannot fuse integer and floating leaves into one buffer: "
            f"dtypes {sorted({str(d) for d in dtypes})}"
        )
    # The promoted type holds every leaf exactly (e.g. bfloat16 + float16 -> float32).
    return promote_types(*dtypes)


def auto_buffer_bytes(total_bytes: int, num_shards: int, itemsize: int = 4) -> int:
    """Herring computes the buffer size from the model and cluster sizes; ours is
    ``max(total / 8, num_shards * 64 KiB)``, at most the model, rounded up to a whole
    number of elements per shard (so only the last buffer is padded)."""
    grain = num_shards * itemsize
    want = max(math.ceil(total_bytes / BUFFERS_PER_STEP), num_shards * MIN_SHARD_BYTES)
    want = min(want, max(total_bytes, 1))
    return max(grain, math.ceil(want / grain) * grain)


@dataclasses.dataclass(frozen=True)
class FusionPlan:
    """The balanced-fusion-buffer layout of one pytree, as built by `plan_fusion`.

    Buffer ``b`` holds ``buffer_sizes[b]`` elements of ``dtype``; `fuse` returns it as a
    ``[num_shards, shard_sizes[b]]`` array, zero-padded at the tail when
    ``num_shards * shard_sizes[b] > buffer_sizes[b]`` (the last buffer, or every buffer
    when ``buffer_bytes`` is not a multiple of ``num_shards`` elements); `unfuse`
    inverts it. Frozen and hashable, so jitted code can close over it.

    Args:
      treedef: the pytree structure.
      shapes: the shape of each leaf (``jax.tree.leaves`` order).
      dtypes: the dtype of each leaf.
      order: production order of the leaves (leaf indices, first produced first).
      dtype: the buffer dtype, the promotion of ``dtypes``.
      num_shards: shards per buffer, one per server.
      buffer_elements: elements of a full buffer.
      buffer_sizes: elements of each buffer (the last may hold fewer).
      shard_sizes: elements of one shard of each buffer, ``ceil(size / num_shards)``.
      segments: per buffer, the leaf pieces it holds as ``Segment(leaf, start, stop,
        offset)``: elements ``[start, stop)`` of the flattened leaf sit at ``offset``.

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.comms import plan_fusion
      >>> params = {"a": jnp.ones(10), "b": jnp.ones(2), "c": jnp.ones(3)}
      >>> plan = plan_fusion(params, buffer_bytes=32, num_shards=2)
      >>> buffers = plan.fuse(params)  # leaf "a" spans both buffers
      >>> print(buffers[1])  # 7 elements and one of padding
      [[1. 1. 1. 1.]
       [1. 1. 1. 0.]]
      >>> plan.unfuse(buffers)["c"].shape
      (3,)
    """

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    order: tuple[int, ...]
    dtype: np.dtype
    num_shards: int
    buffer_elements: int
    buffer_sizes: tuple[int, ...]
    shard_sizes: tuple[int, ...]
    segments: tuple[tuple[Segment, ...], ...]

    @property
    def num_buffers(self) -> int:
        return len(self.buffer_sizes)

    @property
    def shard_bytes(self) -> tuple[int, ...]:
        """Bytes of one shard of each buffer (every shard of a buffer has this size)."""
        return tuple(k * self.dtype.itemsize for k in self.shard_sizes)

    @property
    def buffer_bytes(self) -> tuple[int, ...]:
        """Bytes of each buffer as sent, padding included (``num_shards * shard_bytes``)."""
        return tuple(self.num_shards * b for b in self.shard_bytes)

    @property
    def padding(self) -> int:
        """Elements of zero padding over all buffers."""
        return sum(self.num_shards * k for k in self.shard_sizes) - sum(self.buffer_sizes)

    def buffer_leaves(self, b: int) -> tuple[int, ...]:
        """Leaf indices with elements in buffer ``b``, in layout order."""
        return tuple(s.leaf for s in self.segments[b])

    def fuse(self, tree: Any) -> tuple[jax.Array, ...]:
        """The buffers of ``tree``, each ``[num_shards, shard_sizes[b]]``. Buffer ``b``
        depends only on the leaves in it, so it can be reduced as soon as they exist."""
        leaves = self._leaves(tree)
        flat = [jnp.ravel(x) for x in leaves]
        out = []
        for b, segs in enumerate(self.segments):
            parts = [flat[s.leaf][s.start : s.stop].astype(self.dtype) for s in segs]
            pad = self.num_shards * self.shard_sizes[b] - self.buffer_sizes[b]
            if pad:
                parts.append(jnp.zeros((pad,), self.dtype))
            out.append(jnp.concatenate(parts).reshape(self.num_shards, self.shard_sizes[b]))
        return tuple(out)

    def unfuse(self, buffers: Sequence[jax.Array]) -> Any:
        """The pytree laid out in ``buffers`` (inverse of `fuse`; padding is dropped, leaves
        get back their shapes and dtypes)."""
        if len(buffers) != self.num_buffers:
            raise ValueError(f"unfuse needs {self.num_buffers} buffers, got {len(buffers)}")
        pieces: list[list[tuple[int, jax.Array]]] = [[] for _ in self.shapes]
        for b, segs in enumerate(self.segments):
            want = (self.num_shards, self.shard_sizes[b])
            if tuple(buffers[b].shape) != want:
                raise ValueError(f"buffer {b} must have shape {want}, got {buffers[b].shape}")
            flat = jnp.ravel(buffers[b])
            for s in segs:
                pieces[s.leaf].append((s.start, flat[s.offset : s.offset + s.stop - s.start]))
        leaves = []
        for shape, dtype, parts in zip(self.shapes, self.dtypes, pieces):
            if not parts:  # an empty leaf
                leaves.append(jnp.zeros(shape, dtype))
                continue
            parts = [p for _, p in sorted(parts, key=lambda t: t[0])]
            flat = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
            leaves.append(flat.astype(dtype).reshape(shape))
        return jax.tree.unflatten(self.treedef, leaves)

    def _leaves(self, tree: Any) -> list[jax.Array]:
        leaves, treedef = jax.tree.flatten(tree)
        if treedef != self.treedef:
            raise ValueError(f"tree structure {treedef} does not match the plan's {self.treedef}")
        for i, (x, shape) in enumerate(zip(leaves, self.shapes)):
            if tuple(jnp.shape(x)) != shape:
                raise ValueError(f"leaf {i} has shape {jnp.shape(x)}, the plan expects {shape}")
        return leaves


def plan_fusion(
    params_or_shapes: Any,
    *,
    buffer_bytes: int | None = None,
    num_shards: int,
    order: Sequence[int] | None = None,
) -> FusionPlan:
    """Lay a pytree out in balanced fusion buffers, each cut into ``num_shards`` equal shards.

    Leaves are placed back to back in production ``order`` into buffers of
    ``buffer_bytes`` bytes (a leaf may span two buffers); buffer ``b`` is cut into ``S``
    equal shards and shard ``s`` of every buffer goes to server ``s``, so every server
    receives the same bytes per buffer whatever the sizes of the variables. All leaves
    are cast to one buffer dtype, the promotion of their dtypes (exact for floating
    leaves of mixed widths); integer and floating leaves cannot be mixed.

    Args:
      params_or_shapes: the gradient pytree or its shapes.
      buffer_bytes: bytes per buffer; the last buffer holds the rest. A size that is not a
        whole number of elements is rounded down to one. None: `auto_buffer_bytes`.
      num_shards: shards per buffer, one per server (``S``).
      order: production order, ``order[0]`` the index (in ``jax.tree.leaves``) of the
        first gradient the backward pass produces; see `gradient_order`. None: leaf order.
        All workers must pass the same order (`broadcast_order` makes it so).

    Returns:
      a `FusionPlan`, static and hashable; ``plan.fuse(tree)`` gives the buffers as
      ``[num_shards, shard_sizes[b]]`` arrays and ``plan.unfuse(buffers)`` the tree.

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.comms import plan_fusion
      >>> params = {"a": jnp.zeros(10), "b": jnp.zeros(2), "c": jnp.zeros(3)}
      >>> plan = plan_fusion(params, buffer_bytes=32, num_shards=2)
      >>> plan.buffer_sizes, plan.shard_bytes  # every server gets 16 bytes per buffer
      ((8, 7), (16, 16))
      >>> plan.buffer_leaves(0), plan.buffer_leaves(1)  # leaf 0 ("a") spans both
      ((0,), (0, 1, 2))

    References:
      A. Thangakrishnan et al., "Herring: Rethinking the Parameter Server at Scale for
      the Cloud", SC 2020, section III (balanced fusion buffers).
    """
    num_shards = check_int("num_shards", num_shards, 1)
    treedef, shapes, dtypes = _shapes(params_or_shapes)
    order = _check_order(order, len(shapes))
    dtype = _buffer_dtype(dtypes)
    sizes = [math.prod(s) for s in shapes]
    total = sum(sizes)
    if buffer_bytes is None:
        buffer_bytes = auto_buffer_bytes(total * dtype.itemsize, num_shards, dtype.itemsize)
    buffer_bytes = check_int("buffer_bytes", buffer_bytes, why=" or None")
    if buffer_bytes < dtype.itemsize:
        raise ValueError(
            f"buffer_bytes={buffer_bytes} is smaller than one element ({dtype.itemsize} bytes "
            f"of {dtype})"
        )
    per_buffer = buffer_bytes // dtype.itemsize

    segments: list[list[Segment]] = []
    fill = per_buffer  # elements already in the open buffer; start by opening one
    for leaf in order:
        start = 0
        while start < sizes[leaf]:
            if fill == per_buffer:
                segments.append([])
                fill = 0
            take = min(sizes[leaf] - start, per_buffer - fill)
            segments[-1].append(Segment(leaf, start, start + take, fill))
            start += take
            fill += take
    buffer_sizes = tuple(sum(s.stop - s.start for s in segs) for segs in segments)
    return FusionPlan(
        treedef=treedef,
        shapes=shapes,
        dtypes=dtypes,
        order=order,
        dtype=dtype,
        num_shards=num_shards,
        buffer_elements=per_buffer,
        buffer_sizes=buffer_sizes,
        shard_sizes=tuple(-(-n // num_shards) for n in buffer_sizes),
        segments=tuple(tuple(s) for s in segments),
    )


class AtomicPlacement(NamedTuple):
    """Classic parameter-server sharding, each leaf whole on one server (`atomic_placement`).

    Args:
      server: per leaf (``jax.tree.leaves`` order), the server that holds it.
      leaf_bytes: per leaf, its bytes.
      server_bytes: per server, the bytes of the leaves it holds (one worker's copy).

    Example:
      >>> from shoal.comms import AtomicPlacement
      >>> placement = AtomicPlacement(server=(0, 1, 0), leaf_bytes=(40, 8, 12),
      ...                             server_bytes=(52, 8))
      >>> max(placement.server_bytes) / min(placement.server_bytes)  # load imbalance
      6.5
    """

    server: tuple[int, ...]
    leaf_bytes: tuple[int, ...]
    server_bytes: tuple[int, ...]


def atomic_placement(
    params_or_shapes: Any, *, num_servers: int, order: Sequence[int] | None = None
) -> AtomicPlacement:
    """Place each variable whole on one server, round-robin: the baseline Herring replaces.

    Variable ``order[k]`` goes to server ``k mod num_servers``; a server's load is the
    sum of its variables' bytes, so uneven variable sizes give uneven loads.

    Args:
      params_or_shapes: the gradient pytree or its shapes (`jax.ShapeDtypeStruct`).
      num_servers: int ``>= 1``, the number of servers.
      order: production order of the leaves (leaf indices, first produced first);
        None: leaf order.

    Returns:
      an `AtomicPlacement` ``(server, leaf_bytes, server_bytes)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.comms import atomic_placement
      >>> params = {"a": jnp.zeros(10), "b": jnp.zeros(2), "c": jnp.zeros(3)}
      >>> atomic_placement(params, num_servers=2)
      AtomicPlacement(server=(0, 1, 0), leaf_bytes=(40, 8, 12), server_bytes=(52, 8))

    References:
      A. Thangakrishnan et al., "Herring: Rethinking the Parameter Server at Scale for
      the Cloud", SC 2020, section III.
    """
    num_servers = check_int("num_servers", num_servers, 1)
    _, shapes, dtypes = _shapes(params_or_shapes)
    order = _check_order(order, len(shapes))
    leaf_bytes = tuple(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))
    server = [0] * len(shapes)
    for k, leaf in enumerate(order):
        server[leaf] = k % num_servers
    loads = [0] * num_servers
    for leaf, s in enumerate(server):
        loads[s] += leaf_bytes[leaf]
    return AtomicPlacement(tuple(server), leaf_bytes, tuple(loads))
