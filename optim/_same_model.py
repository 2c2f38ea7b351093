"""Same initial model: one check that every worker starts from worker 0's parameters.

Model averaging (DiLoCo, MuLoCo, Streaming DiLoCo, BMUF, BMUF-GTC, SMA, peer averaging)
assumes that every worker starts from the same model; nothing in the arithmetic notices
when they do not (DiLoCo's global models then differ per worker for ever), so
`same_model_check` compares them, bit for bit, at ``init``.

Per leaf, a 32-bit checksum of its bits, with ``w_i`` the ``i``-th uint32 word of the
leaf (an element of 4 bytes, one of 1 or 2 bytes widened, two words for 8 bytes)::

    h = sum_i mix(w_i XOR (i * 0x9E3779B9))    (mod 2^32)

``mix`` is MurmurHash3's 32-bit finaliser, a bijection of uint32, so each term is a
bijection of ``w_i``: a change of one word (one ulp, ``-0.0`` for ``0.0``, a NaN payload)
always changes ``h``, and the word's position enters, so two swapped elements do too.
Several changed words collide with a chance of about ``2^-32``.

Two all-reduces, both exact in integers: worker 0's checksums (a sum of worker 0's and
every other worker's zeros, ``4 L`` bytes for ``L`` leaves), then the first differing
``(worker, leaf)`` (a minimum, 4 bytes), so that every worker gets the same verdict and
every process of an MPI job raises alike (`check_same_model`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shoal.comms.collective import Collective
from shoal.comms.shards import worker_max
from shoal.comms.wire import WireCount, all_reduce_bytes
from shoal.optim._validation import check_collective

_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: spreads consecutive positions over the words
_NONE = np.iinfo(np.int32).max  # the minimum's identity: no differing (worker, leaf)


class SameModelCheck(NamedTuple):
    """What `same_model_check` found, the same on every worker.

    Attributes:
      worker: int32, the first worker whose parameters differ from worker 0's (-1: none).
      leaf: int32, that worker's first differing leaf, in ``jax.tree.leaves`` order (-1:
        none).
      wire: the bytes of the check's two all-reduces (`shoal.comms.WireCount`).
    """

    worker: jax.Array
    leaf: jax.Array
    wire: WireCount


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's fmix32: a bijection of uint32 that spreads every bit over all."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as a flat uint32 array (bijectively, element by element)."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], axis=-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).reshape(-1)
    width = x.dtype.itemsize
    if width in (1, 2):
        unsigned = jnp.uint8 if width == 1 else jnp.uint16
        return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)
    # 4 bytes: one word per element; 8 bytes: two (bitcast adds a trailing axis of 2).
    return lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)


def leaf_checksum(x: jax.Array) -> jax.Array:
    """The uint32 checksum ``h`` of one array's bits (see the module docstring).

    Args:
      x: an array of any dtype and shape.

    Returns:
      a uint32 scalar; 0 for an empty array.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from shoal.optim._same_model import leaf_checksum
      >>> a = jnp.ones(3)
      >>> b = a.at[1].set(np.nextafter(np.float32(1), np.float32(2)))  # one ulp more
      >>> bool(leaf_checksum(a) == leaf_checksum(b))
      False
    """
    words = _words(x)
    index = jnp.arange(words.size, dtype=jnp.uint32) * jnp.uint32(_GOLDEN)
    return jnp.sum(_mix(words ^ index), dtype=jnp.uint32)


def _tiers(collective: Collective | Sequence[Collective]) -> tuple[Collective, ...]:
    tiers = tuple(collective) if isinstance(collective, (list, tuple)) else (collective,)
    if not tiers:
        raise ValueError("collective must be a Collective or a non-empty sequence of them")
    for c in tiers:
        check_collective(c)
    return tiers


def same_model_check(params: Any, collective: Collective | Sequence[Collective]) -> SameModelCheck:
    """Whether every worker's ``params`` are worker 0's, bit for bit, and if not, where not.

    Each worker checksums every leaf (`leaf_checksum`); worker 0's checksums reach all
    workers in one all-reduce, and the first differing ``(worker, leaf)`` in a second
    (see the module docstring), so the result is the same on every worker. A worker that
    spans several devices (``shard_map`` over a mesh whose other axes shard its leaves)
    compares each shard with worker 0's same shard, and differs where any shard does.
    Call it once, at ``init``, on the parameters every worker starts from; a host then
    raises with `check_same_model`. Traceable under ``vmap``, ``shard_map`` and
    ``jit`` (MPI).

    Args:
      params: this worker's parameters, a pytree of arrays.
      collective: the workers (`shoal.comms.Collective`), or the ``(intra, inter)`` pair
        of `shoal.comms.two_tier`: worker ``inter.rank() * intra.size + intra.rank()``
        (with more tiers, the first varies fastest).

    Returns:
      a `SameModelCheck`: the first differing worker and its first differing leaf (-1
      and -1 when every worker holds worker 0's parameters), and the bytes sent:
      ``2 (P - 1) / P (4 L + 4)`` each way per tier of ``P`` workers, ``L`` leaves.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim.helpers import same_model_check
      >>> coll = AxisCollective("workers", 4)
      >>> params = {"b": jnp.zeros((4, 2)), "w": jnp.ones((4, 3))}  # [worker, ...]
      >>> params["w"] = params["w"].at[2, 1].add(1e-7)  # worker 2 differs, in "w"
      >>> check = jax.vmap(lambda p: same_model_check(p, coll), axis_name="workers")(params)
      >>> print(check.worker, check.leaf)
      [2 2 2 2] [1 1 1 1]

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
      Models", arXiv:2311.08105 (2023), Algorithm 1: every replica starts from the same
      ``theta^(0)``. Appleby, MurmurHash3 (SMHasher, 2011): the 32-bit finaliser ``mix``.
    """
    tiers = _tiers(collective)
    leaves = jax.tree.leaves(params)
    wire = WireCount.zero()
    if not leaves:
        none = jnp.full((), -1, jnp.int32)
        return SameModelCheck(none, none, wire)
    if math.prod(c.size for c in tiers) * len(leaves) >= _NONE:
        raise ValueError(
            f"params: {len(leaves)} leaves on {math.prod(c.size for c in tiers)} workers "
            f"are too many for an int32 (worker, leaf) key; ravel some leaves together"
        )
    sums = jnp.stack([leaf_checksum(x) for x in leaves])
    root = jnp.ones((), bool)
    for c in tiers:
        root = root & (c.rank() == 0)
    # Worker 0's checksums on every worker: a sum of them and the others' zeros (exact).
    theirs = jnp.where(root, sums, jnp.zeros_like(sums))
    for c in tiers:
        theirs = c.all_reduce(theirs, "sum")
    # A leaf differs for a worker where any of its own devices' shards differs.
    differs = worker_max(sums != theirs, tiers)
    leaf = jnp.argmax(differs).astype(jnp.int32)  # the first True (0 when none)
    rank, stride = jnp.zeros((), jnp.int32), 1
    for c in tiers:
        rank, stride = rank + c.rank() * stride, stride * c.size
    key = jnp.where(jnp.any(differs), rank * len(leaves) + leaf, _NONE)
    for c in tiers:
        key = c.all_reduce(key, "min")
        wire = wire + WireCount.of(*all_reduce_bytes(4 * len(leaves), c.size))
        wire = wire + WireCount.of(*all_reduce_bytes(4, c.size))
    found = key != _NONE
    worker = jnp.where(found, key // len(leaves), -1).astype(jnp.int32)
    leaf = jnp.where(found, key % len(leaves), -1).astype(jnp.int32)
    return SameModelCheck(worker, leaf, wire)


def check_same_model(check: SameModelCheck, params: Any) -> None:
    """Raise `ValueError` naming the worker and leaf that `same_model_check` found.

    Host side, after the check: every worker's (and process's) result is the same, so
    every process raises alike.

    Args:
      check: `same_model_check`'s result, of one worker or stacked over several.
      params: parameters of the same structure (one worker's or stacked), for the name
        of the leaf.

    Returns:
      None, when every worker holds worker 0's parameters.

    Raises:
      ValueError: "worker 2 starts from a different model than worker 0: first differing
        leaf ['dense']['kernel']".

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.optim.helpers import SameModelCheck, check_same_model
      >>> from shoal.comms import WireCount
      >>> found = SameModelCheck(jnp.int32(2), jnp.int32(1), WireCount.zero())
      >>> try:
      ...     check_same_model(found, {"b": jnp.zeros(2), "w": jnp.zeros(3)})
      ... except ValueError as e:
      ...     print(e)
      worker 2 starts from a different model than worker 0: first differing leaf ['w']

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
      Models", arXiv:2311.08105 (2023), Algorithm 1.
    """
    worker = np.asarray(check.worker).reshape(-1)
    leaf = np.asarray(check.leaf).reshape(-1)
    if worker.size == 0 or worker[0] < 0:
        return
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    raise ValueError(
        f"worker {int(worker[0])} starts from a different model than worker 0: first "
        f"differing leaf {paths[int(leaf[0])]}"
    )
