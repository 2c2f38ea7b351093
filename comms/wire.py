"""Wire accounting: the bytes a worker puts on and takes off the wire.

Shapes are static, so the bytes of every collective call are Python ints known at
trace time. Every communicating transformation keeps a `WireMeter` in its state: the
bytes of its most recent update (``step``) and of all its updates since ``init``
(``total``), both exact to 64 bits (`ByteCount`). `wire_bytes` sums the meters of a
whole optimizer state; `WireMeter.record` is the one place where totals grow.

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

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from shoal.comms import presence
from shoal.trees import find_instances

_WORD = 1 << 32


class ByteCount(NamedTuple):
    """A count of bytes, exact up to ``2**63 - 1``: ``hi * 2**32 + lo`` in two uint32 words.

    ::

        count = hi * 2**32 + lo,    0 <= lo < 2**32

    jax runs in 32-bit mode by default, where int64 silently becomes int32, and int32 ends
    at ``2**31 - 1`` bytes, less than one ring all-reduce of a 300M-parameter float32 model
    among 64 workers; so the count is split in two words and ``+`` carries from ``lo``
    into ``hi``. The words may have leading axes (workers
    under ``vmap``, steps under ``scan``); they broadcast like any array.

    On the host, ``int(count)`` (one count) and ``count.numpy()`` or ``np.asarray(count)``
    (any shape, int64) give the exact value. Indexing indexes the counts, not the words:
    ``count[3]`` is worker 3's count (the words are ``count.hi``, ``count.lo``).

    Args:
      hi: uint32 array, the high word (multiples of ``2**32``).
      lo: uint32 array of the same shape, the low word.

    Example:
      >>> from shoal.comms import ByteCount
      >>> count = ByteCount.of(2**32 - 1) + ByteCount.of(5)  # the carry reaches hi
      >>> int(count.hi), int(count.lo), int(count)
      (1, 4, 4294967300)
    """

    hi: jax.Array
    lo: jax.Array

    @classmethod
    def zero(cls) -> ByteCount:
        return cls(jnp.zeros((), jnp.uint32), jnp.zeros((), jnp.uint32))

    @classmethod
    def of(cls, n: int | ByteCount) -> ByteCount:
        """``n`` bytes, a static Python int (byte counts are known at trace time), or a
        `ByteCount` as it is (a traced count: under churn, `shoal.comms.presence`)."""
        if isinstance(n, ByteCount):
            return n
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"a byte count is a static Python int, got {type(n).__name__}")
        n = int(n)
        if not 0 <= n < 1 << 63:
            raise ValueError(f"a byte count is in [0, 2**63), got {n}")
        return cls(jnp.asarray(np.uint32(n >> 32)), jnp.asarray(np.uint32(n % _WORD)))

    def __getitem__(self, index) -> ByteCount:  # counts, not the tuple's words
        return ByteCount(self.hi[index], self.lo[index])

    def __add__(self, other):  # with carry, not tuple concatenation
        lo = self.lo + other.lo  # uint32: wraps modulo 2**32
        carry = (lo < self.lo).astype(jnp.uint32)
        return ByteCount(self.hi + other.hi + carry, lo)

    def numpy(self) -> np.ndarray:
        """The exact counts as a NumPy int64 array (on the host; any leading axes)."""
        hi = np.asarray(self.hi).astype(np.int64)
        lo = np.asarray(self.lo).astype(np.int64)
        return np.asarray((hi << 32) | lo)

    def __array__(self, dtype=None, copy=None):
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    def __int__(self) -> int:
        return int(self.numpy())

    def __repr__(self) -> str:
        concrete = all(isinstance(w, (np.ndarray, np.integer, int)) for w in self) or all(
            isinstance(w, jax.Array) and not isinstance(w, jax.core.Tracer) for w in self
        )
        if not concrete:  # traced, or shapes only (eval_shape)
            return f"ByteCount(hi={self.hi!r}, lo={self.lo!r})"
        return repr(self.numpy().tolist())  # the exact value(s): 612, [612, 612]


class WireCount(NamedTuple):
    """Bytes this worker sent and received over some span (one update, or since ``init``).

    ``+`` adds two counts field by field (not tuple concatenation).

    Args:
      sent: `ByteCount`, bytes this worker put on the wire.
      received: `ByteCount`, bytes this worker took off the wire.

    Example:
      >>> from shoal.comms import WireCount
      >>> count = WireCount.of(sent=100, received=60) + WireCount.of(sent=20, received=20)
      >>> int(count.sent), int(count.received)
      (120, 80)
    """

    sent: ByteCount
    received: ByteCount

    @classmethod
    def zero(cls) -> WireCount:
        return cls(ByteCount.zero(), ByteCount.zero())

    @classmethod
    def of(cls, sent: int | ByteCount, received: int | ByteCount) -> WireCount:
        """From static Python ints (the bytes of the collective calls of one update), or
        `ByteCount` s (traced, under churn)."""
        return cls(ByteCount.of(sent), ByteCount.of(received))

    def __add__(self, other):  # elementwise, not tuple concatenation
        return WireCount(self.sent + other.sent, self.received + other.received)


class WireMeter(NamedTuple):
    """The wire counter in a transformation's state: last update's bytes and the running total.

    ``record(count)`` after an update sets ``step = count`` and ``total += count``;
    ``idle()`` records an update that moved nothing; ``add(count)`` adds to both.

    Args:
      step: `WireCount` of the most recent update.
      total: `WireCount` of all updates since ``init``.

    Example:
      >>> from shoal.comms import WireCount, WireMeter
      >>> meter = WireMeter.zero().record(WireCount.of(8, 8)).record(WireCount.of(4, 2))
      >>> int(meter.step.sent), int(meter.total.sent), int(meter.total.received)
      (4, 12, 10)
    """

    step: WireCount
    total: WireCount

    @classmethod
    def zero(cls) -> WireMeter:
        """A fresh meter (``init``): nothing moved yet."""
        return cls(WireCount.zero(), WireCount.zero())

    def record(self, count: WireCount) -> WireMeter:
        """After an update that moved ``count``: ``step = count``, ``total += count``."""
        return WireMeter(count, self.total + count)

    def add(self, count: WireCount) -> WireMeter:
        """The same update also moved ``count`` (e.g. a wrapper's flag): both grow."""
        return WireMeter(self.step + count, self.total + count)

    def idle(self) -> WireMeter:
        """After an update that moved nothing (a skipped step): the total is kept."""
        return self.record(WireCount.zero())

    def __add__(self, other):  # a tuple's + would concatenate: say what to use instead
        raise TypeError("WireMeter: use .record(count) or .add(count) with a WireCount")


def _meters(tree: Any) -> list[WireMeter]:
    return find_instances(tree, WireMeter)


def wire_bytes(opt_state: Any, which: Literal["total", "step"]) -> WireCount:
    """Bytes this worker sent and received, summed over every `WireMeter` in an optimizer state.

    Traceable (``jit``, ``vmap``: under ``vmap`` over workers the result has a leading
    worker axis). On the host, ``int(count.sent)`` or ``np.asarray(count.sent)`` (int64)
    are exact.

    Args:
      opt_state: an optimizer state, any nesting of optax states.
      which: ``"total"``, since ``init``, all updates together (what a run moved), or
        ``"step"``, the most recent update only.

    Returns:
      a `WireCount` ``(sent, received)``; zero when ``opt_state`` holds no meter.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective, wire_bytes
      >>> from shoal.optim import allreduce_gradients
      >>> tx = allreduce_gradients(collective=AxisCollective("workers", 2))
      >>> def bytes_sent(g):
      ...     state = tx.init(g)
      ...     for _ in range(3):
      ...         _, state = tx.update(g, state)
      ...     return wire_bytes(state, "total").sent
      >>> sent = jax.vmap(bytes_sent, axis_name="workers")(jnp.ones((2, 1000)))
      >>> sent.numpy()  # 3 ring all-reduces of 4000 bytes: 3 * 2 (P-1)/P * 4000
      array([12000, 12000])
    """
    if which not in ("total", "step"):
        raise ValueError(f"which must be 'total' or 'step', got {which!r}")
    count = WireCount.zero()
    for m in _meters(opt_state):
        count = count + getattr(m, which)
    return count


def tree_nbytes(tree: Any) -> int:
    """Total bytes of the array leaves of ``tree`` (static shapes and dtypes).

    Args:
      tree: a pytree of arrays or `jax.ShapeDtypeStruct` leaves.

    Returns:
      a Python int, ``sum(leaf.size * leaf.dtype.itemsize)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.comms import tree_nbytes
      >>> tree_nbytes({"w": jnp.zeros((3, 4)), "b": jnp.zeros(4, jnp.bfloat16)})
      56
    """
    return int(
        sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
    )


def all_reduce_bytes(nbytes: int, size: int) -> tuple[Any, Any]:
    """Bytes one worker sends and receives in a ring all-reduce of ``nbytes`` among
    ``size`` workers, ``2 (size - 1) / size`` of them each way: static ints, or under
    churn (`shoal.comms.presence`) traced `ByteCount` s for the workers present."""
    among = presence.current()
    if among is not None:
        _check_among(among, size)
        b = ByteCount(*among.per_count(lambda p: 2 * (p - 1) * nbytes // p))
        return b, b
    b = 2 * (size - 1) * nbytes // size
    return b, b


def all_gather_bytes(nbytes: int, size: int) -> tuple[int, int]:
    presence.refuse("an all-gather")
    b = (size - 1) * nbytes
    return b, b


def all_to_all_bytes(nbytes: int, size: int) -> tuple[int, int]:
    presence.refuse("an all-to-all")
    b = (size - 1) * nbytes // size
    return b, b


def _check_among(among: presence.Presence, size: int) -> None:
    if size != among.size:
        raise presence.ChurnError(
            f"churn covers one collective of all {among.size} workers; a collective of "
            f"{size} (a group of a two-tier algorithm) cannot tell who is present"
        )
