"""Pallas (Triton-style, GPU) implementation of the GTC pack/unpack kernels.

Same contract and bit-exact results as :mod:`shoal.kernels.gtc_reference`; see
:func:`shoal.kernels.gtc_pack`. The selection has a global data dependence (the first
``capacity`` qualifying elements in cyclic order from ``offset``), so pack is split:

1. ``_count_kernel`` (one program per block of ``BLOCK`` elements): the number of
   qualifying elements, ``|v| > tau``, in the block and in the block before ``offset``;
2. XLA: the exclusive scan over the ``n / BLOCK`` block counts and the two sent rank
   windows (a few scalars);
3. ``_emit_kernel``: the in-block scan gives every qualifying element its index-order
   rank, hence whether it is sent and its output slot; the kernel writes the residual
   block (in place when ``values`` is donated) and scatters the sent words.

Unpack atomically adds +-1 per word into a float32 net count (exact integers, so the
order of the adds does not matter) and ``_scale_kernel`` multiplies by ``tau`` once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from shoal.kernels.gtc_reference import INDEX_MASK, SIGN_BIT, sent_window

__all__ = ["gtc_pack_pallas", "gtc_unpack_pallas"]

BLOCK = 1024  # elements per program: a power of two, as Triton requires
_COMPILER_PARAMS = plgpu.CompilerParams(num_warps=4, num_stages=1)
_SCALAR = pl.BlockSpec((1,), lambda *_: (0,))
_PAIR = pl.BlockSpec((2,), lambda *_: (0,))
_WHOLE = pl.BlockSpec(memory_space=pl.ANY)  # raw ref, indexed with computed offsets
_BLOCKED = pl.BlockSpec((BLOCK,), lambda i: (i,))
_PER_BLOCK = pl.BlockSpec((1,), lambda i: (i,))


def _load_block(x_ref, n):
    """The block's values (0 past n) and the mask of lanes inside the array."""
    # n - start never overflows int32, unlike start + lane for the last block.
    valid = jnp.arange(BLOCK, dtype=jnp.int32) < n - pl.program_id(0) * BLOCK
    return plgpu.load(x_ref, mask=valid, other=0.0), valid


def _count_kernel(tau_ref, offset_ref, x_ref, count_ref, before_ref, *, n):
    x, valid = _load_block(x_ref, n)
    q = (jnp.abs(x) > tau_ref[0]) & valid
    index = pl.program_id(0) * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)
    count_ref[0] = jnp.sum(q.astype(jnp.int32))
    before_ref[0] = jnp.sum((q & (index < offset_ref[0])).astype(jnp.int32))


def _emit_kernel(
    tau_ref, window_ref, start_ref, x_ref, _words_in, rem_ref, words_ref, *, n, capacity
):
    x, valid = _load_block(x_ref, n)
    tau = tau_ref[0]
    q = (jnp.abs(x) > tau) & valid
    lane = jnp.arange(BLOCK, dtype=jnp.int32)
    index = pl.program_id(0) * BLOCK + lane
    # Index-order rank among all qualifying elements of the array.
    rank = start_ref[0] + jnp.cumsum(q.astype(jnp.int32)) - 1
    s0, shift = window_ref[0], window_ref[1]
    low = rank < s0
    sent = q & (low | ((rank >= shift + s0) & (rank - shift < capacity)))
    negative = x < 0
    # v + (-tau) is bit-identical to v - tau (and to the reference's scatter-add).
    rem = jnp.where(sent, x + jnp.where(negative, tau, -tau), x)
    plgpu.store(rem_ref, rem, mask=valid)
    word = index | jnp.where(negative, SIGN_BIT, 0)
    # Lanes not sent aim at distinct scratch slots past `capacity`, so that even an
    # emulated masked store (interpret mode: read, select, write back) never collides.
    slot = jnp.where(sent, jnp.where(low, rank, rank - shift), capacity + lane)
    plgpu.store(words_ref.at[slot], word, mask=sent)


@functools.partial(jax.jit, static_argnames=("capacity", "interpret"))
def gtc_pack_pallas(values, tau, capacity, offset, *, interpret=False):
    """Pallas :func:`shoal.kernels.gtc_pack` (arguments already validated)."""
    n = values.shape[0]
    grid = (pl.cdiv(n, BLOCK),)
    tau1 = jnp.reshape(tau, (1,)).astype(jnp.float32)
    counts, befores = pl.pallas_call(
        functools.partial(_count_kernel, n=n),
        grid=grid,
        in_specs=[_SCALAR, _SCALAR, _BLOCKED],
        out_specs=[_PER_BLOCK, _PER_BLOCK],
        out_shape=[jax.ShapeDtypeStruct(grid, jnp.int32)] * 2,
        interpret=interpret,
        compiler_params=_COMPILER_PARAMS,
        name="gtc_count",
    )(tau1, jnp.reshape(offset, (1,)).astype(jnp.int32), values)

    incl = jnp.cumsum(counts)
    total = incl[-1]
    s0, shift = sent_window(total, jnp.sum(befores), capacity)
    window = jnp.stack([s0, shift]).astype(jnp.int32)

    remainder, words = pl.pallas_call(
        functools.partial(_emit_kernel, n=n, capacity=capacity),
        grid=grid,
        in_specs=[_SCALAR, _PAIR, _PER_BLOCK, _BLOCKED, _WHOLE],
        out_specs=[_BLOCKED, _WHOLE],
        out_shape=[
            jax.ShapeDtypeStruct((n,), jnp.float32),
            jax.ShapeDtypeStruct((capacity + BLOCK,), jnp.int32),
        ],
        input_output_aliases={3: 0, 4: 1},
        interpret=interpret,
        compiler_params=_COMPILER_PARAMS,
        name="gtc_emit",
    )(tau1, window, incl - counts, values, jnp.zeros(capacity + BLOCK, jnp.int32))
    return words[:capacity], jnp.minimum(total, capacity), remainder


def _unpack_kernel(count_ref, words_ref, _net_in, net_ref, *, capacity, size, interpret):
    lane = jnp.arange(BLOCK, dtype=jnp.int32)
    slot = pl.program_id(1) * BLOCK + lane
    inside = slot < capacity
    w = plgpu.load(words_ref, mask=inside[None, :], other=0)[0]
    index = w & INDEX_MASK
    valid = inside & (slot < count_ref[0]) & (index < size)
    # Invalid lanes add 0 to distinct scratch slots past `size`: interpret mode cannot
    # mask atomics, and on the GPU the mask keeps them from touching memory at all.
    target = jnp.where(valid, index, size + lane)
    delta = jnp.where(valid, jnp.where(w < 0, -1.0, 1.0), 0.0).astype(jnp.float32)
    plgpu.atomic_add(net_ref, (target,), delta, mask=None if interpret else valid)


def _scale_kernel(tau_ref, net_ref, out_ref, *, size):
    net, valid = _load_block(net_ref, size)
    plgpu.store(out_ref, net * tau_ref[0], mask=valid)


@functools.partial(jax.jit, static_argnames=("size", "interpret"))
def gtc_unpack_pallas(words, count, tau, size, *, interpret=False):
    """Pallas :func:`shoal.kernels.gtc_unpack` (arguments already validated)."""
    capacity = words.shape[-1]
    words = words.reshape(-1, capacity)
    count = count.reshape(-1).astype(jnp.int32)
    buffers = words.shape[0]
    tau1 = jnp.reshape(tau, (1,)).astype(jnp.float32)
    if buffers == 0:
        return jnp.zeros(size, jnp.float32)
    net = pl.pallas_call(
        functools.partial(_unpack_kernel, capacity=capacity, size=size, interpret=interpret),
        grid=(buffers, pl.cdiv(capacity, BLOCK)),
        in_specs=[
            pl.BlockSpec((1,), lambda p, i: (p,)),
            pl.BlockSpec((1, BLOCK), lambda p, i: (p, i)),
            _WHOLE,
        ],
        out_specs=_WHOLE,
        out_shape=jax.ShapeDtypeStruct((size + BLOCK,), jnp.float32),
        input_output_aliases={2: 0},
        interpret=interpret,
        compiler_params=_COMPILER_PARAMS,
        name="gtc_unpack",
    )(count, words, jnp.zeros(size + BLOCK, jnp.float32))
    return pl.pallas_call(
        functools.partial(_scale_kernel, size=size),
        grid=(pl.cdiv(size, BLOCK),),
        in_specs=[_SCALAR, _BLOCKED],
        out_specs=_BLOCKED,
        out_shape=jax.ShapeDtypeStruct((size,), jnp.float32),
        interpret=interpret,
        compiler_params=_COMPILER_PARAMS,
        name="gtc_scale",
    )(tau1, net)
