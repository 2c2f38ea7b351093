"""Pure-jnp reference of the GTC pack/unpack kernels (runs on every backend).

Gradient threshold compression (Strom 2015; Ladkat et al., section 2.1) sends
``q_i = sign(v_i) tau`` for the elements with ``|v_i| > tau`` as one 32-bit word each
(bits 0-30 the flat index, bit 31 set for ``-tau``) and keeps ``r = v - q``. See
:func:`shoal.kernels.gtc_pack` for the full contract (capacity, cyclic offset).

Written for XLA:CPU, where the obvious encoders are slow: a ``jnp.nonzero``-style
compaction is a full-size cumsum plus a full-size scatter, and every full-size
temporary costs page faults. This pipeline reads ``values`` once and otherwise works on
arrays 64x smaller or of size ``capacity``:

1. one fused pass packs mask and sign bits per group of 64 elements into uint16[G, 8]
   (reducing over a middle axis, which XLA:CPU vectorises);
2. per-group counts (popcount) and their scan: the index-order rank of each group's
   first qualifying element;
3. the cyclic ``offset``/``capacity`` rule becomes two windows of sent ranks; each output
   slot gets its rank, the group holding that rank (group start slots scattered into
   slot space, then a scan over the slots), and the bit of that rank inside the group
   (an 8x8 bit transpose into index order, then a 6-step select). This runs over the
   fewest of ``capacity, capacity / 2, ... capacity / 16`` slots that hold the count
   (`slot_sizes`; the unpack likewise), so a step costs what it sends, not its capacity;
4. the residual is ``values`` with ``-+tau`` scatter-added at the sent indices only: in
   place when the caller donates ``values``, and bit-identical everywhere else.

Everything is exact integer arithmetic except the float32 ``v -+ tau`` of sent elements.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from shoal import vma

__all__ = ["gtc_pack_parts_reference", "gtc_pack_reference", "gtc_unpack_reference"]

GROUP = 64  # elements per group: an 8x8 bit matrix
SIGN_BIT = -(2**31)  # bit 31 of a word, as an int32
INDEX_MASK = 2**31 - 1  # bits 0-30 of a word
SLOT_HALVINGS = 4  # a decode runs over capacity, capacity / 2, ... / 2**4 slots
MIN_SLOTS = 1024  # no decode branch over fewer slots than this (but for a smaller capacity)


def _qualifies(v: jax.Array, tau: jax.Array) -> jax.Array:
    # A strict comparison: |v| == tau stays, NaN compares false, +-Inf qualifies.
    return jnp.abs(v) > tau


def _pack_groups(values: jax.Array, tau: jax.Array) -> jax.Array:
    """uint16[G, 8]: for group g, column l, bit j (mask) and bit 8 + j (sign) describe
    element 64 g + 8 j + l.

    Reducing over the middle axis j keeps the minor axis contiguous, which XLA:CPU
    vectorises: this pass runs at the speed of a plain read of ``values``.
    """
    n = values.shape[0]
    full = n // GROUP

    def pack(x, valid=None):
        m = _qualifies(x, tau)
        if valid is not None:
            m = m & valid
        m = m.astype(jnp.uint16)
        bits = m | ((x < 0).astype(jnp.uint16) & m) << 8
        j = jnp.arange(8, dtype=jnp.uint16)[:, None]
        return lax.reduce(bits << j, jnp.uint16(0), lax.bitwise_or, (1,))

    parts = []
    if full:
        parts.append(pack(values[: full * GROUP].reshape(full, 8, 8)))
    tail = n - full * GROUP
    if tail:
        # Padding is masked out explicitly, so that no tau can ever select it.
        x = jnp.pad(values[full * GROUP :], (0, GROUP - tail)).reshape(1, 8, 8)
        valid = (jnp.arange(GROUP) < tail).reshape(1, 8, 8)
        parts.append(pack(x, valid))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _mask_words(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(lo, hi) uint32: the mask bytes of columns 0-3 and 4-7 of uint16[..., 8] rows."""
    r = rows.astype(jnp.uint32) & 0xFF
    lo = r[..., 0] | r[..., 1] << 8 | r[..., 2] << 16 | r[..., 3] << 24
    hi = r[..., 4] | r[..., 5] << 8 | r[..., 6] << 16 | r[..., 7] << 24
    return lo, hi


def _transpose8x8(lo: jax.Array, hi: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Reorder a group's 64 mask bits so that bit e (lo: 0-31, hi: 32-63) is element e.

    The classic three-step 8x8 bit-matrix transpose (Warren, Hacker's Delight, 7-3) on
    a 64-bit word held as two uint32 halves.
    """
    u = jnp.uint32
    t = (lo ^ (lo >> 7)) & u(0x00AA00AA)
    lo = lo ^ t ^ (t << 7)
    t = (hi ^ (hi >> 7)) & u(0x00AA00AA)
    hi = hi ^ t ^ (t << 7)
    t = (lo ^ (lo >> 14)) & u(0x0000CCCC)
    lo = lo ^ t ^ (t << 14)
    t = (hi ^ (hi >> 14)) & u(0x0000CCCC)
    hi = hi ^ t ^ (t << 14)
    t = (lo ^ (hi << 4)) & u(0xF0F0F0F0)
    return lo ^ t, hi ^ (t >> 4)


def _popcount(x: jax.Array) -> jax.Array:
    return lax.population_count(x).astype(jnp.int32)


def _select_bit(lo: jax.Array, hi: jax.Array, k: jax.Array) -> jax.Array:
    """Position (0-63) of the k-th (0-based) set bit of the 64-bit word (lo, hi)."""
    c = _popcount(lo)
    in_hi = k >= c
    x = jnp.where(in_hi, hi, lo)
    k = jnp.where(in_hi, k - c, k)
    pos = jnp.where(in_hi, 32, 0)
    for width in (16, 8, 4, 2, 1):
        low = _popcount(x & jnp.uint32((1 << width) - 1))
        up = k >= low
        k = jnp.where(up, k - low, k)
        x = jnp.where(up, x >> width, x)
        pos = jnp.where(up, pos + width, pos)
    return pos


def _inclusive_cumsum(x: jax.Array) -> jax.Array:
    # jnp.cumsum lowers to a reduce-window chain on CPU; the work-efficient tree scan is
    # several times faster there and exact in int32.
    return lax.associative_scan(jnp.add, x)


def sent_window(total: jax.Array, before: jax.Array, capacity: int):
    """``(s0, shift)`` such that the sent ranks are ``[0, s0) U [shift + s0, shift + capacity)``.

    Ranks are 0-based in index order among the ``total`` qualifying elements, ``before``
    of which precede ``offset``. Everything is sent if it fits; otherwise ``capacity``
    ranks from ``before`` on, wrapping around to rank 0.
    """
    after = total - before
    fits = total <= capacity
    wraps = after < capacity
    s0 = jnp.where(fits, capacity, jnp.where(wraps, capacity - after, 0))
    shift = jnp.where(fits, 0, jnp.where(wraps, total - capacity, before))
    return s0, shift


def _rows_of_parts(parts: list, tau: jax.Array) -> jax.Array:
    """`_pack_groups` of the concatenation of the 1-D ``parts``, without concatenating them.

    Each part's whole groups are packed straight from its slice (the slice fuses into the
    pack's read); a group that straddles parts, at most one per boundary, is assembled
    from the fewer than 64 elements around it. Only the packed rows (1/16 of the bytes)
    are concatenated.
    """
    rows, pending = [], []  # pending: the start of a group begun by earlier parts
    for x in parts:
        pos = 0
        have = sum(p.shape[0] for p in pending)
        if have:
            need = GROUP - have
            if x.shape[0] < need:
                pending.append(x)
                continue
            pending.append(x[:need])
            rows.append(_pack_groups(jnp.concatenate(pending), tau))
            pending, pos = [], need
        whole = (x.shape[0] - pos) // GROUP * GROUP
        if whole:
            rows.append(_pack_groups(x[pos : pos + whole], tau))
        if pos + whole < x.shape[0]:
            pending = [x[pos + whole :]]
    if pending:  # the last group, padded (and masked) by `_pack_groups`
        rows.append(_pack_groups(jnp.concatenate(pending), tau))
    return rows[0] if len(rows) == 1 else jnp.concatenate(rows)


def _locate(values, tau, offset, capacity):
    """Everything up to the bit select, for one 1-D ``values``."""
    return _locate_rows(_pack_groups(values, tau), offset, capacity)


def _locate_rows(rows, offset, capacity):
    """`_locate` from the packed rows."""
    # A reduce (not a chain of adds), so that XLA materialises it instead of re-evaluating
    # it inside every level of the scan below.
    cnt = jnp.sum(_popcount(rows & 0xFF), axis=1, dtype=jnp.int32)
    incl = _inclusive_cumsum(cnt)
    start = incl - cnt  # index-order rank of each group's first qualifying element
    total = incl[-1]

    # Qualifying elements before `offset`.
    g_off = offset // GROUP
    t_lo, t_hi = _transpose8x8(*_mask_words(rows[g_off]))
    r = (offset % GROUP).astype(jnp.uint32)
    below = (jnp.uint32(1) << (r % 32)) - 1  # shifts by >= 32 are backend-defined
    before = start[g_off] + jnp.where(
        r >= 32, _popcount(t_lo) + _popcount(t_hi & below), _popcount(t_lo & below)
    )
    s0, shift = sent_window(total, before, capacity)
    count = jnp.minimum(total, capacity)
    # Slot of each group's first sent element (non-decreasing over the groups).
    first_slot = jnp.minimum(start, s0) + jnp.clip(start - shift - s0, 0, capacity - s0)
    return rows, start, first_slot, s0, shift, count


def slot_sizes(capacity: int) -> list[int]:
    """The static numbers of slots a decode runs over, smallest first: ``capacity`` and its
    halvings down to ``capacity / 2**SLOT_HALVINGS`` (those of at least `MIN_SLOTS`)."""
    sizes = {capacity}
    for j in range(1, SLOT_HALVINGS + 1):
        if -(-capacity // 2**j) >= MIN_SLOTS:
            sizes.add(-(-capacity // 2**j))
    return sorted(sizes)


def slot_branch(count: jax.Array, sizes: list[int]) -> jax.Array:
    """The branch that decodes ``count`` (its largest entry): 0 when every count is 0,
    else ``1 + j`` for the smallest ``sizes[j]`` that holds it. One scalar, so that the
    branch stays a branch under the natively batched pack and unpack."""
    most = jnp.max(count)
    smaller = sum((most > s).astype(jnp.int32) for s in sizes[:-1])
    return jnp.where(most > 0, 1 + smaller, 0)


def _slot_groups(rows, start, first_slot, *, slots):
    """For each of the first ``slots`` slots: its group's packed row, the rank of the
    group's first qualifying element, and the group."""
    # The group holding slot s is the number of groups g >= 1 whose first slot is <= s.
    marks = jnp.zeros(slots, jnp.int32).at[first_slot[1:]].add(1, mode="drop")
    group = _inclusive_cumsum(marks)
    return rows[group], start[group], group


def _decode(rows, start_g, group, s0, shift, count):
    """The word sent in each slot (0 for slots >= count)."""
    slot = jnp.arange(group.shape[-1], dtype=jnp.int32)
    rank = jnp.where(slot >= s0, slot + shift, slot)
    lo, hi = _transpose8x8(*_mask_words(rows))
    pos = _select_bit(lo, hi, rank - start_g)  # element 8 j + l of the group
    j, col = pos >> 3, pos & 7
    column = rows[..., 0]
    for c in range(1, 8):
        column = jnp.where(col == c, rows[..., c], column)
    negative = (column >> (8 + j).astype(jnp.uint16)) & 1 == 1
    # One output only: XLA:CPU would re-evaluate the whole chain for each extra output.
    return jnp.where(slot < count, (group * GROUP + pos) | jnp.where(negative, SIGN_BIT, 0), 0)


def _words(located, capacity: int, batched: bool) -> jax.Array:
    """The ``capacity`` words of each buffer (``located``: `_locate_rows`'s, batched over a
    leading axis or not).

    Every step of the decode works per slot, yet only ``count`` of the ``capacity`` slots
    carry a word (at most about a fifth at `sim_scale`'s reference model). So it runs
    in a branch over the fewest slots of `slot_sizes` that hold every buffer's count, and
    the words are padded with zeros to ``capacity``.
    """
    count = located[-1]
    sizes = slot_sizes(capacity)

    def decoder(slots):
        def run(rows, start, first_slot, s0, shift, count):
            groups = functools.partial(_slot_groups, slots=slots)
            located = (jax.vmap(groups) if batched else groups)(rows, start, first_slot)
            # The decode proper in a branch of its own (taken whenever this one is): XLA
            # materialises its operands, where fused into the bit-select chain it would
            # re-evaluate the gathers per use (about 7x slower).
            words = vma.cond(
                jnp.max(count) > 0,
                jax.vmap(_decode) if batched else _decode,
                lambda *a: jnp.zeros((*count.shape, slots), jnp.int32),
                *located,
                s0,
                shift,
                count,
            )
            return jnp.pad(words, [(0, 0)] * (words.ndim - 1) + [(0, capacity - slots)])

        return run

    zeros = lambda *a: jnp.zeros((*count.shape, capacity), jnp.int32)
    branches = [zeros] + [decoder(s) for s in sizes]
    return vma.switch(slot_branch(count, sizes), branches, *located)


def _residual(values, tau, words, count):
    """``values`` with the sent words' ``-+tau`` added; other elements never written."""
    index = jnp.where(jnp.arange(words.shape[0]) < count, words & INDEX_MASK, values.shape[0])
    # v + (-tau) is bit-identical to v - tau.
    update = jnp.where(words < 0, tau, -tau)
    return values.at[index].add(update, mode="drop", indices_are_sorted=True)


def gtc_pack_reference(
    values: jax.Array, tau: jax.Array, capacity: int, offset: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """jnp reference of :func:`shoal.kernels.gtc_pack` (arguments already validated).

    Batched natively: ``values`` may be ``[..., n]`` with ``tau`` and ``offset``
    broadcastable to its leading dimensions (the vmap rule of ``gtc_pack`` uses this).
    """
    *lead, n = values.shape
    locate = functools.partial(_locate, capacity=capacity)
    if not lead:
        located = locate(values, tau, offset)
        count = located[-1]
        words = _words(located, capacity, batched=False)
        return words, count, _residual(values, tau, words, count)

    batch = math.prod(lead)
    values = values.reshape(batch, n)
    tau = jnp.broadcast_to(tau, lead).reshape(batch)
    offset = jnp.broadcast_to(offset, lead).reshape(batch)
    located = jax.vmap(locate)(values, tau, offset)
    count = located[-1]
    words = _words(located, capacity, batched=True)
    remainder = jax.vmap(_residual)(values, tau, words, count)
    return (
        words.reshape(*lead, capacity),
        count.reshape(lead),
        remainder.reshape(*lead, n),
    )


def _sent_bounds(words, count, s0):
    """Flat-index bounds ``(a, b, c)``: the sent elements are exactly the qualifying ones
    with ``index < a`` or ``b <= index < c``.

    The words are in increasing index order and their ranks are ``[0, s0)`` then a run
    from ``shift + s0`` (`sent_window`): the qualifying elements up to the last word of
    the first run, and those from the first to the last word of the second run.
    """
    idx = words & INDEX_MASK
    last = words.shape[-1] - 1
    first = jnp.minimum(s0, count)  # words in the first run
    a = jnp.where(first > 0, idx[jnp.clip(first - 1, 0, last)] + 1, 0)
    two = count > s0
    b = jnp.where(two, idx[jnp.clip(s0, 0, last)], 0)
    c = jnp.where(two, idx[jnp.clip(count - 1, 0, last)] + 1, 0)
    return a, b, c


def _flat_index(shape: tuple) -> jax.Array:
    """int32 array of ``shape``: each element's index in the row-major raveling."""
    index, stride = jnp.zeros(shape, jnp.int32), 1
    for d in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.int32, shape, d) * stride
        stride *= shape[d]
    return index


def _part_residual(x, start, shape, tau, bounds):
    """The remainder of one part (flat indices ``start...`` of its own ``shape``, behind
    any leading batch dimensions; ``tau`` and ``bounds`` broadcast against ``x``),
    element-wise and in the part's own layout: no scatter and no reshape, so it fuses
    with the pass that computes ``x`` and updates a donated buffer in place.
    ``v + (-tau)`` is bit-identical to the flat pack's scatter-add."""
    a, b, c = bounds
    index = start + _flat_index(shape)
    sent = _qualifies(x, tau) & ((index < a) | ((index >= b) & (index < c)))
    return jnp.where(sent, x + jnp.where(x < 0, tau, -tau), x)


def gtc_pack_parts_reference(
    parts: list,
    tau: jax.Array,
    capacity: int,
    offset: jax.Array,
    shapes: list | None = None,
    residuals: list | None = None,
) -> tuple[jax.Array, jax.Array, list]:
    """jnp reference of :func:`shoal.kernels.gtc_pack_parts` (arguments already validated).

    ``shapes``: the parts' own shapes (default: their shapes), raveled in row-major order;
    dimensions in front of them are batch dimensions, the same for every part, batched
    natively like `gtc_pack_reference`. ``residuals``: as for ``gtc_pack_parts``.
    """
    if residuals is not None:
        # Two sums: the remainder's operands pass an optimization barrier (free: no data
        # moves), so that XLA cannot merge them and fuses each sum into its own pass,
        # where a single one would be written out in full for both.
        packed = [g + r for g, r in zip(parts, residuals)]
        kept = [g + r for g, r in zip(*lax.optimization_barrier((parts, residuals)))]
    else:
        packed = kept = parts
    shapes = [tuple(x.shape) for x in parts] if shapes is None else [tuple(s) for s in shapes]
    lead = parts[0].shape[: parts[0].ndim - len(shapes[0])]
    sizes = [math.prod(s) for s in shapes]
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + size)

    def locate(xs, tau, offset):
        flat = [x.reshape(size) for x, size in zip(xs, sizes)]
        return _locate_rows(_rows_of_parts(flat, tau), offset, capacity)

    def remainders(xs, tau, words, count, s0):
        # Batched by broadcasting, not by vmap: a reshape of the batch dimensions around
        # the pass would keep XLA from writing it in place of the donated residual.
        bounds = (jax.vmap(_sent_bounds) if lead else _sent_bounds)(words, count, s0)
        out = []
        for x, shape, start in zip(xs, shapes, starts):
            expand = lambda v, shape=shape: jnp.reshape(v, (*lead, *[1] * len(shape)))
            out.append(_part_residual(x, start, shape, expand(tau), tuple(map(expand, bounds))))
        return out

    if not lead:
        located = locate(packed, tau, offset)
        count, s0 = located[-1], located[3]
        words = _words(located, capacity, batched=False)
        return words, count, remainders(kept, tau, words, count, s0)

    batch = math.prod(lead)
    stack = lambda xs: [x.reshape(batch, *shape) for x, shape in zip(xs, shapes)]
    tau = jnp.broadcast_to(tau, lead).reshape(batch)
    offset = jnp.broadcast_to(offset, lead).reshape(batch)
    located = jax.vmap(locate)(stack(packed), tau, offset)
    count, s0 = located[-1], located[3]
    words = _words(located, capacity, batched=True)
    return (
        words.reshape(*lead, capacity),
        count.reshape(lead),
        remainders(kept, tau.reshape(lead), words, count, s0),
    )


def gtc_unpack_reference(
    words: jax.Array, count: jax.Array, tau: jax.Array, size: int, batch_dims: int = 0
) -> jax.Array:
    """jnp reference of :func:`shoal.kernels.gtc_unpack` (arguments already validated).

    The first ``batch_dims`` dimensions of ``words``, ``count`` and ``tau`` are batch
    dimensions, each decoded on its own (``[*batch, size]``); the rest are summed.
    """
    lead = words.shape[:batch_dims]
    batch, capacity = math.prod(lead), words.shape[-1]
    words = words.reshape(batch, -1, capacity)
    count = count.reshape(batch, -1)
    tau = jnp.broadcast_to(tau, lead).reshape(batch, 1)
    sizes = slot_sizes(capacity)

    def scatter(slots):
        def run(words, count):
            words = words[..., :slots]
            valid = jnp.arange(slots, dtype=jnp.int32) < count[..., None]
            index = jnp.where(valid, words & INDEX_MASK, size)  # size: dropped
            # Each batch entry decodes into its own row (a 2-D index: a flat one would
            # overflow int32 beyond 2**31 elements over the batch).
            row = lax.broadcasted_iota(jnp.int32, words.shape, 0)
            # Net count of +tau minus -tau per element, accumulated exactly (integers in
            # float32), then scaled once: the result does not depend on the order of the
            # buffers.
            sign = jnp.where(words < 0, -1.0, 1.0)
            net = jnp.zeros((batch, size), jnp.float32)
            return net.at[row, index].add(sign, mode="drop")

        return run

    # As the pack's decode: over the fewest slots that hold every buffer's count.
    zeros = lambda *a: jnp.zeros((batch, size), jnp.float32)
    branches = [zeros] + [scatter(s) for s in sizes]
    net = vma.switch(slot_branch(count, sizes), branches, words, count)
    return (net * tau).reshape(*lead, size)
