"""Pallas (Triton-style, GPU) implementation of block-scaled int8 / fp8 e4m3 / fp4 e2m1
quantization.

Same formats, byte layout and bit-exact results as
:mod:`shoal.kernels.quant_reference`. The values are viewed as one row per block, so a
program handles a power-of-two tile of ``rows`` blocks of ``width`` values (``width`` the
block length rounded up to a power of two, the extra lanes masked):

* ``_quantize_kernel``: load a ``[rows, width]`` tile (``[rows, width / 2, 2]`` for fp4,
  the pairs that share a byte), reduce each row's absmax in registers, and write the
  codes and the scale of every row in one pass; fp4 nibbles are packed in the kernel
  (value ``2 k`` in the low nibble of byte ``k``);
* ``_dequantize_kernel``: decode a tile of codes and multiply by its row's scale.

Bit-exactness does not rest on the backend's own conversions:

* the absmax is a max over the int32 bit patterns of ``|v|`` (ordered like the floats
  for non-negative values, NaN above Inf), because Triton lowers a float max to
  ``maxnum``, which drops NaN where XLA's max propagates it;
* the division ``v / s`` is an IEEE (round to nearest) division: on the GPU an explicit
  ``div.rn.f32``, since Triton's float32 ``/`` is the approximate ``div.full.f32``;
* roundings are done on bits: int8 and fp8 subnormals by adding a power of two whose
  ulp is the rounding step (a float32 addition rounds to nearest, ties to even, and
  nothing multiplies before it, so no fused multiply-add can change it), fp8 normals
  by rounding the float32 bit pattern, fp4 by the reference's midpoint comparisons;
  decoding builds the float32 bit patterns from the code fields;
* non-finite inputs follow the reference: a NaN scale divides by 1 (``NaN > 0`` is
  false), a NaN unit becomes int8 code 0, the fp8 NaN code ``sign | 0x7F``, or an fp4
  nibble ``sign << 3``.

Blocks longer than :data:`MAX_BLOCK` values are left to the reference by the dispatcher
(a tile of one such block would not fit in registers).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from shoal.kernels.quant_reference import _E2M1, BITS, MAX_CODE

__all__ = ["MAX_BLOCK", "TILE", "dequantize_pallas", "quantize_pallas"]

TILE = 4096  # values per program at most (a power of two, as Triton requires)
MAX_BLOCK = 8192  # longest block the kernels take; longer ones use the reference
_COMPILER_PARAMS = plgpu.CompilerParams(num_warps=4, num_stages=1)

_ABS = 0x7FFFFFFF
_QUIET_NAN = 0x7FC00000
_F32_2P23 = 0x4B000000  # bits of 2**23: its ulp is 1 (int8 rounding)
_F32_2P14 = 0x46800000  # bits of 2**14: its ulp is 2**-9, the e4m3 subnormal step
_E4M3_MIN_NORMAL = 2.0**-6


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _layout(fmt: str, block: int, rows: int) -> tuple[int, int, int]:
    """``(width, lanes, tile_rows)``: code lanes per block (pairs for fp4), that rounded
    up to a power of two, and blocks per program."""
    width = block // 2 if BITS[fmt] == 4 else block
    lanes = _pow2(width)
    per_lane = 2 if BITS[fmt] == 4 else 1
    tile_rows = max(1, TILE // (lanes * per_lane))
    return width, lanes, min(tile_rows, _pow2(rows))


def _masks(tile_rows: int, lanes: int, rows: int, width: int):
    """Lanes inside the array: ``(blocks [tile_rows], code lanes [tile_rows, lanes])``."""
    # rows - start never overflows int32, unlike start + lane for the last tile.
    row_ok = jnp.arange(tile_rows, dtype=jnp.int32) < rows - pl.program_id(0) * tile_rows
    lane_ok = jnp.arange(lanes, dtype=jnp.int32) < width
    return row_ok, row_ok[:, None] & lane_ok[None, :]


def _value_mask(code_ok: jax.Array, shape) -> jax.Array:
    """The code-lane mask spread over the tile of values (fp4: both values of a byte)."""
    if len(shape) == 2:
        return code_ok
    return jnp.broadcast_to(code_ok[:, :, None], shape)


def _per_row(x: jax.Array, ndim: int) -> jax.Array:
    return x.reshape(x.shape + (1,) * (ndim - 1))


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.int32)


def _float(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits, jnp.float32)


def _divide(x: jax.Array, y: jax.Array, interpret: bool) -> jax.Array:
    """IEEE float32 ``x / y`` (round to nearest even), as XLA divides."""
    if interpret:
        return x / y
    [q] = plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[x, y],
        constraints="=r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return q


def _round_int8(unit: jax.Array) -> jax.Array:
    """int32 code of ``unit`` in ``[-127, 127]`` or NaN: ties to even, NaN -> 0."""
    a = jnp.abs(unit)
    k = _bits(a + jnp.float32(2.0**23)) - _F32_2P23  # a < 2**23: ulp 1 rounds a
    k = jnp.where(unit < 0, -k, k)
    return jnp.where((_bits(unit) & _ABS) > 0x7F800000, 0, k) & 0xFF


def _round_e4m3(unit: jax.Array) -> jax.Array:
    """int32 float8_e4m3fn bits of ``unit`` in ``[-448, 448]`` or NaN (ties to even)."""
    a = jnp.abs(unit)
    b = _bits(a)
    # Normal: keep 3 of the 23 mantissa bits, rounding the dropped 20 to nearest even;
    # a carry moves into the exponent. Rebias 127 -> 7: subtract 120 << 3.
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal (and 2**-6 itself): the number of 2**-9 steps, rounded by the addition.
    small = _bits(a + jnp.float32(2.0**14)) - _F32_2P14
    magnitude = jnp.where(a >= jnp.float32(_E4M3_MIN_NORMAL), normal, small)
    magnitude = jnp.where((b & _ABS) > 0x7F800000, 0x7F, magnitude)
    return magnitude | jnp.where(_bits(unit) < 0, 0x80, 0)


def _round_e2m1(unit: jax.Array) -> jax.Array:
    """int32 nibble ``sign << 3 | e2m1 index`` of ``unit`` in ``[-6, 6]`` or NaN."""
    a = jnp.abs(unit)
    index = jnp.zeros(a.shape, jnp.int32)
    for j in range(len(_E2M1) - 1):
        mid = jnp.float32((_E2M1[j] + _E2M1[j + 1]) / 2)
        # The midpoint goes to the even index j + 1 (ties to even), as in the reference.
        up = (a >= mid) if (j + 1) % 2 == 0 else (a > mid)
        index = index + jnp.where(up, 1, 0)
    return index | jnp.where(_bits(unit) < 0, 8, 0)


def _quantize_kernel(x_ref, codes_ref, scale_ref, *, fmt, rows, width, interpret):
    shape = x_ref.shape
    row_ok, code_ok = _masks(shape[0], shape[1], rows, width)
    x = plgpu.load(x_ref, mask=_value_mask(code_ok, shape), other=0.0)
    # Max over the bits of |v|: float order for non-negative values, NaN above Inf.
    absmax = jnp.max(_bits(x) & _ABS, axis=tuple(range(1, len(shape))))
    scale = _float(absmax) * jnp.float32(1 / MAX_CODE[fmt])
    divisor = _per_row(jnp.where(scale > 0, scale, jnp.float32(1)), len(shape))
    unit = _divide(x, jnp.broadcast_to(divisor, shape), interpret)
    top, bottom = jnp.float32(MAX_CODE[fmt]), jnp.float32(-MAX_CODE[fmt])
    unit = jnp.where(unit > top, top, jnp.where(unit < bottom, bottom, unit))  # NaN stays
    if fmt == "int8":
        codes = _round_int8(unit)
    elif fmt == "fp8":
        codes = _round_e4m3(unit)
    else:
        nibble = _round_e2m1(unit)
        shift = 4 * lax.broadcasted_iota(jnp.int32, shape, 2)
        codes = jnp.sum(nibble << shift, axis=2)  # disjoint nibbles: the sum is an OR
    plgpu.store(codes_ref, codes.astype(jnp.uint8), mask=code_ok)
    plgpu.store(scale_ref, scale, mask=row_ok)


@functools.partial(jax.jit, static_argnames=("fmt", "block", "interpret"))
def quantize_pallas(
    values: jax.Array, fmt: str, block: int, *, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Pallas :func:`shoal.kernels.quantize` of float32[..., n] (validated arguments,
    ``block <= MAX_BLOCK``)."""
    *lead, n = values.shape
    nblocks = n // block
    rows = math.prod(lead) * nblocks
    code_bytes = n * BITS[fmt] // 8
    if rows == 0:
        return jnp.zeros((*lead, code_bytes), jnp.uint8), jnp.zeros((*lead, nblocks), jnp.float32)
    width, lanes, tile_rows = _layout(fmt, block, rows)
    if fmt == "fp4":
        x = values.reshape(rows, width, 2)
        x_spec = pl.BlockSpec((tile_rows, lanes, 2), lambda i: (i, 0, 0))
    else:
        x = values.reshape(rows, width)
        x_spec = pl.BlockSpec((tile_rows, lanes), lambda i: (i, 0))
    codes, scales = pl.pallas_call(
        functools.partial(_quantize_kernel, fmt=fmt, rows=rows, width=width, interpret=interpret),
        grid=(pl.cdiv(rows, tile_rows),),
        in_specs=[x_spec],
        out_specs=[
            pl.BlockSpec((tile_rows, lanes), lambda i: (i, 0)),
            pl.BlockSpec((tile_rows,), lambda i: (i,)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((rows, width), jnp.uint8),
            jax.ShapeDtypeStruct((rows,), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=_COMPILER_PARAMS,
        name=f"quantize_{fmt}",
    )(x)
    return codes.reshape(*lead, code_bytes), scales.reshape(*lead, nblocks)


def _decode_int8(c: jax.Array) -> jax.Array:
    return jnp.where(c >= 128, c - 256, c).astype(jnp.float32)


def _decode_e4m3(c: jax.Array) -> jax.Array:
    exponent = (c >> 3) & 15
    mantissa = c & 7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    small = _bits(mantissa.astype(jnp.float32) * jnp.float32(2.0**-9))  # exact
    magnitude = jnp.where(exponent == 0, small, normal)
    magnitude = jnp.where((c & 0x7F) == 0x7F, _QUIET_NAN, magnitude)
    return _float(magnitude | ((c >> 7) << 31))


def _decode_e2m1(nibble: jax.Array) -> jax.Array:
    index = nibble & 7
    # Index 2 e + m (e >= 1) is (1 + m / 2) 2**(e - 1); 1 is 0.5 and 0 is 0.
    normal = (((index >> 1) + 126) << 23) | ((index & 1) << 22)
    magnitude = jnp.where(index >= 2, normal, jnp.where(index == 1, 0x3F000000, 0))
    return _float(magnitude | ((nibble >> 3) << 31))  # nibble 8 is -0.0, as -0.0 * s


def _dequantize_kernel(scale_ref, codes_ref, out_ref, *, fmt, rows, width):
    shape = out_ref.shape
    row_ok, code_ok = _masks(shape[0], shape[1], rows, width)
    c = plgpu.load(codes_ref, mask=code_ok, other=0).astype(jnp.int32)
    scale = plgpu.load(scale_ref, mask=row_ok, other=0.0)
    if fmt == "int8":
        q = _decode_int8(c)
    elif fmt == "fp8":
        q = _decode_e4m3(c)
    else:
        shift = 4 * lax.broadcasted_iota(jnp.int32, shape, 2)
        q = _decode_e2m1((c[:, :, None] >> shift) & 15)
    plgpu.store(out_ref, q * _per_row(scale, len(shape)), mask=_value_mask(code_ok, shape))


@functools.partial(jax.jit, static_argnames=("fmt", "block", "interpret"))
def dequantize_pallas(
    codes: jax.Array, scales: jax.Array, fmt: str, block: int, *, interpret: bool = False
) -> jax.Array:
    """Pallas :func:`shoal.kernels.dequantize` (validated arguments, ``block <=
    MAX_BLOCK``)."""
    *lead, nblocks = scales.shape
    n = nblocks * block
    rows = math.prod(lead) * nblocks
    if rows == 0:
        return jnp.zeros((*lead, n), jnp.float32)
    width, lanes, tile_rows = _layout(fmt, block, rows)
    if fmt == "fp4":
        out_spec = pl.BlockSpec((tile_rows, lanes, 2), lambda i: (i, 0, 0))
        out_shape = (rows, width, 2)
    else:
        out_spec = pl.BlockSpec((tile_rows, lanes), lambda i: (i, 0))
        out_shape = (rows, width)
    out = pl.pallas_call(
        functools.partial(_dequantize_kernel, fmt=fmt, rows=rows, width=width),
        grid=(pl.cdiv(rows, tile_rows),),
        in_specs=[
            pl.BlockSpec((tile_rows,), lambda i: (i,)),
            pl.BlockSpec((tile_rows, lanes), lambda i: (i, 0)),
        ],
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        interpret=interpret,
        compiler_params=_COMPILER_PARAMS,
        name=f"dequantize_{fmt}",
    )(scales.reshape(rows).astype(jnp.float32), codes.reshape(rows, width))
    return out.reshape(*lead, n)
