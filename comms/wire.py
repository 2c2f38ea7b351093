"""Wire accounting: the bytes a worker puts on and takes off the wire.

Shapes are static, so the bytes of every collective call are Python ints known at
trace time. Every communicating transformation keeps a `WireCount` for its most
recent update in its state; `wire_bytes` sums them over a whole optimizer state.

Counting rules (what the algorithm moves, not what an MPI library does inside),
for ``P`` workers and a payload of ``n`` bytes:

=================  =============================  =============================
collective         sent per worker                received per worker
=================  =============================  =============================
all-reduce (ring)  ``2 (P-1) n / P``              ``2 (P-1) n / P``
all-gather         ``(P-1) n`` (n = own part)     ``(P-1) n``
all-to-all         ``(P-1) n / P`` (n = buffer)   ``(P-1) n / P``
broadcast          root: ``(P-1) n``; others 0    root: 0; others ``n``
ppermute           ``n`` if a source              ``n`` if a destination
=================  =============================  =============================

Fractions round down to whole bytes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class WireCount(NamedTuple):
    """Bytes sent and received by this worker in the most recent update (int32 scalars)."""

    sent: jax.Array
    received: jax.Array

    @classmethod
    def zero(cls) -> WireCount:
        return cls(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))

    @classmethod
    def of(cls, sent, received) -> WireCount:
        return cls(jnp.asarray(sent, jnp.int32), jnp.asarray(received, jnp.int32))

    def __add__(self, other):  # elementwise, not tuple concatenation
        return WireCount(self.sent + other.sent, self.received + other.received)


def wire_bytes(opt_state: Any) -> WireCount:
    """Sum of every `WireCount` inside ``opt_state`` (any nesting of optax states).

    Under ``vmap`` over workers the result has a leading worker axis.
    """
    counts = [
        c
        for c in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, WireCount))
        if isinstance(c, WireCount)
    ]
    total = WireCount.zero()
    for c in counts:
        total = total + c
    return total


def tree_nbytes(tree: Any) -> int:
    """Total bytes of the array leaves of ``tree`` (static shapes and dtypes)."""
    return int(
        sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
    )


def all_reduce_bytes(nbytes: int, size: int) -> tuple[int, int]:
    b = 2 * (size - 1) * nbytes // size
    return b, b


def all_gather_bytes(nbytes: int, size: int) -> tuple[int, int]:
    b = (size - 1) * nbytes
    return b, b


def all_to_all_bytes(nbytes: int, size: int) -> tuple[int, int]:
    b = (size - 1) * nbytes // size
    return b, b
