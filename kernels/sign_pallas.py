"""Pallas (Triton-style, GPU) implementation of the sign pack/unpack kernels.

Same bit layout and bit-exact results as :mod:`shoal.kernels.sign_reference`: element
``8 k + j`` is bit ``j`` of byte ``k``, set iff ``not v >= 0``. The values are viewed as
rows of 8 (one byte each), so a program handles a power-of-two block of ``ROWS`` rows:

* ``_pack_kernel``: load ``[ROWS, 8]`` values, shift each row's negative flags by the
  lane index and sum along the row (the bits are disjoint) into ``ROWS`` bytes;
* ``_unpack_kernel``: one program per (buffer, block of ``ROWS`` bytes) writes
  ``[ROWS, 8]`` values ``+-scale`` of that buffer.

The scale (an RMS, a global reduction) is computed in XLA by the caller.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from shoal.kernels.sign_reference import negative_bits

__all__ = ["ROWS", "sign_pack_pallas", "sign_unpack_pallas"]

ROWS = 512  # bytes per program (4096 values): a power of two, as Triton requires
_COMPILER_PARAMS = plgpu.CompilerParams(num_warps=4, num_stages=1)


def _valid_rows(rows: int, block_axis: int) -> jax.Array:
    # rows - start never overflows int32, unlike start + lane for the last block.
    return jnp.arange(ROWS, dtype=jnp.int32) < rows - pl.program_id(block_axis) * ROWS


def _pack_kernel(x_ref, out_ref, *, rows):
    valid = _valid_rows(rows, 0)
    x = plgpu.load(x_ref, mask=valid[:, None], other=0.0)
    lane = lax.broadcasted_iota(jnp.int32, (ROWS, 8), 1)
    neg = jnp.where(negative_bits(x), 1, 0)  # NaN is negative, +-0 are not
    byte = jnp.sum(neg << lane, axis=1)
    plgpu.store(out_ref, byte.astype(jnp.uint8), mask=valid)


@functools.partial(jax.jit, static_argnames=("interpret",))
def sign_pack_pallas(values: jax.Array, *, interpret: bool = False) -> jax.Array:
    """Pallas :func:`shoal.kernels.sign_pack` bits for float32[..., n] (validated)."""
    *lead, n = values.shape
    nbytes = -(-n // 8)
    if nbytes * 8 != n:
        # Zero padding packs to 0 bits (+1), as in the reference.
        values = jnp.pad(values, [(0, 0)] * len(lead) + [(0, nbytes * 8 - n)])
    rows = values.size // 8
    out = pl.pallas_call(
        functools.partial(_pack_kernel, rows=rows),
        grid=(pl.cdiv(rows, ROWS),),
        in_specs=[pl.BlockSpec((ROWS, 8), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((ROWS,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((rows,), jnp.uint8),
        interpret=interpret,
        compiler_params=_COMPILER_PARAMS,
        name="sign_pack",
    )(values.reshape(rows, 8))
    return out.reshape(*lead, nbytes)


def _unpack_kernel(scale_ref, bits_ref, out_ref, *, nbytes):
    valid = _valid_rows(nbytes, 1)
    b = plgpu.load(bits_ref, mask=valid, other=0).astype(jnp.int32)
    lane = lax.broadcasted_iota(jnp.int32, (ROWS, 8), 1)
    neg = (b[:, None] >> lane) & 1
    s = scale_ref[0]
    plgpu.store(out_ref, jnp.where(neg == 1, -s, s), mask=valid[:, None])


@functools.partial(jax.jit, static_argnames=("size", "interpret"))
def sign_unpack_pallas(
    bits: jax.Array, scale: jax.Array, size: int, *, interpret: bool = False
) -> jax.Array:
    """Pallas :func:`shoal.kernels.sign_unpack` for uint8[..., nbytes] (validated)."""
    *lead, nbytes = bits.shape
    bits = bits.reshape(-1, nbytes)
    buffers = bits.shape[0]
    out = pl.pallas_call(
        functools.partial(_unpack_kernel, nbytes=nbytes),
        grid=(buffers, pl.cdiv(nbytes, ROWS)),
        in_specs=[
            pl.BlockSpec((1,), lambda b, i: (b,)),
            pl.BlockSpec((None, ROWS), lambda b, i: (b, i)),
        ],
        out_specs=pl.BlockSpec((None, ROWS, 8), lambda b, i: (b, i, 0)),
        out_shape=jax.ShapeDtypeStruct((buffers, nbytes, 8), jnp.float32),
        interpret=interpret,
        compiler_params=_COMPILER_PARAMS,
        name="sign_unpack",
    )(scale.reshape(buffers).astype(jnp.float32), bits)
    return out.reshape(*lead, nbytes * 8)[..., :size]
