"""Pure-jnp reference of block-scaled low-precision quantization (runs on every backend).

A buffer of ``n`` float32 values (``n`` a multiple of ``block``) is cut into blocks of
``block`` consecutive values; each block ``b`` gets one float32 absmax scale and each
value one code of the format ``fmt``:

.. math::

    s_b = \\max_{i \\in b} |v_i| / M, \\qquad
    q_i = \\operatorname{round}(v_i / s_b), \\qquad \\hat v_i = q_i s_b

(``q_i = 0`` and ``s_b = 0`` for an all-zero block), with ``M`` the largest code of the
format and ``round`` its rounding to nearest, after clipping ``v_i / s_b`` to ``[-M, M]``.
``s_b`` is computed as ``max |v_i|`` times the float32 ``1 / M`` (what XLA makes of a
division by a constant anyway), so NumPy oracles can match it bit for bit:

========  =====  ====================================================================
``fmt``   ``M``  codes and rounding
========  =====  ====================================================================
int8      127    integers in ``[-127, 127]`` (two's complement int8), ties to even
fp8       448    float8 e4m3fn (the e4m3 of Micikevicius et al.), the IEEE cast:
                 round to nearest, ties to even
fp4       6      e2m1 (OCP MX): ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` and their negatives,
                 round to nearest, ties to the even code (the one whose last mantissa
                 bit is 0: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
                 3.5 -> 4, 5 -> 4), as IEEE roundTiesToEven on that grid
========  =====  ====================================================================

Byte layout of the codes (uint8[..., n * bits / 8]): int8 and fp8 one byte per value,
the bits of the int8 / float8_e4m3fn value. fp4 two values per byte: value ``2 k`` in the
low nibble of byte ``k``, value ``2 k + 1`` in the high nibble; a nibble is
``sign << 3 | e2m1 magnitude index`` (index into the grid above, which is the e2m1 bit
pattern). So fp4 blocks must have an even length. Non-finite inputs make their block's
scale, and so its decoded values, non-finite.

`shoal.kernels.quant_pallas` is the Pallas kernel of the same formats (a ``[rows, block]``
tile per program, the absmax reduced in registers, codes and scale written in one pass),
bit-exact with this reference; `shoal.kernels.quantize` picks it on GPU.

References:
    P. Micikevicius et al., "FP8 Formats for Deep Learning", arXiv:2209.05433 (2022).
    Open Compute Project, "OCP Microscaling Formats (MX) Specification" v1.0 (2023),
    FP4 (E2M1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from shoal.checks import check_int

__all__ = [
    "BITS",
    "FORMATS",
    "MAX_CODE",
    "check_block",
    "check_format",
    "dequantize_reference",
    "quantize_reference",
]

FORMATS = ("int8", "fp8", "fp4")
BITS = {"int8": 8, "fp8": 8, "fp4": 4}
MAX_CODE = {"int8": 127.0, "fp8": 448.0, "fp4": 6.0}

# The e2m1 magnitudes, indexed by their 3-bit pattern.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def check_format(fmt) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    return fmt


def check_block(block, fmt: str) -> int:
    """A positive int; even for fp4 (a block is whole bytes of codes)."""
    block = check_int("block", block, 1)
    if BITS[fmt] == 4 and block % 2:
        raise ValueError(f"block must be even for fmt='fp4' (two codes per byte), got {block}")
    return block


def _e2m1_index(a: jax.Array) -> jax.Array:
    """uint8 index of the e2m1 magnitude nearest to ``a >= 0`` (``a <= 6``), ties to even.

    Between grid points ``j`` and ``j + 1`` the midpoint rounds up iff ``j + 1`` is even.
    """
    index = jnp.zeros(a.shape, jnp.uint8)
    for j in range(len(_E2M1) - 1):
        mid = jnp.float32((_E2M1[j] + _E2M1[j + 1]) / 2)  # exact in float32
        up = (a > mid) | ((a == mid) & ((j + 1) % 2 == 0))
        index = index + up.astype(jnp.uint8)
    return index


def quantize_reference(values: jax.Array, fmt: str, block: int) -> tuple[jax.Array, jax.Array]:
    """Codes and absmax scales of float32[..., n] (``n`` a multiple of ``block``).

    Returns:
      ``(codes, scales)``: uint8[..., n * bits / 8] in the layout of this module and
      float32[..., n / block].
    """
    check_format(fmt)
    block = check_block(block, fmt)
    *lead, n = values.shape
    if n % block:
        raise ValueError(f"the last axis ({n}) must be a multiple of block={block}")
    v = values.astype(jnp.float32).reshape(*lead, n // block, block)
    # The absmax as a max over the int32 bits of |v| (ordered like the floats for
    # non-negative values, NaN above Inf), as the Pallas kernel takes it: XLA:CPU's float
    # max reduction drops a NaN at some shapes (every NaN of float32[2, 37, 128] with
    # jax 0.10, found by benchmarks/gpu_check.py), and the NaN must make its block's
    # scale NaN. Times the float32 reciprocal, not divided by M: XLA turns a division by
    # a constant into that product anyway, so this is the rounding every backend gives.
    magnitude = lax.bitcast_convert_type(v, jnp.int32) & jnp.int32(0x7FFFFFFF)
    absmax = lax.bitcast_convert_type(jnp.max(magnitude, axis=-1), jnp.float32)
    scale = absmax * jnp.float32(1 / MAX_CODE[fmt])
    # An all-zero block keeps scale 0 and codes 0 (divide by 1 instead of 0).
    unit = v / jnp.where(scale > 0, scale, jnp.float32(1))[..., None]
    top = jnp.float32(MAX_CODE[fmt])
    # |unit| <= M up to one rounding of the division; the clip keeps M the largest code.
    unit = jnp.clip(unit, -top, top)
    if fmt == "int8":
        codes = lax.bitcast_convert_type(jnp.round(unit).astype(jnp.int8), jnp.uint8)
    elif fmt == "fp8":
        codes = lax.bitcast_convert_type(unit.astype(jnp.float8_e4m3fn), jnp.uint8)
    else:
        nibble = _e2m1_index(jnp.abs(unit)) | (jnp.signbit(unit).astype(jnp.uint8) << 3)
        pairs = nibble.reshape(*lead, n // 2, 2)
        codes = pairs[..., 0] | (pairs[..., 1] << 4)
    return codes.reshape(*lead, -1), scale


def dequantize_reference(codes: jax.Array, scales: jax.Array, fmt: str, block: int) -> jax.Array:
    """float32[..., n]: ``code value * scale`` of each value (``n = scales.shape[-1] * block``)."""
    check_format(fmt)
    block = check_block(block, fmt)
    *lead, nblocks = scales.shape
    n = nblocks * block
    if codes.shape != (*lead, n * BITS[fmt] // 8) or codes.dtype != jnp.uint8:
        raise ValueError(
            f"codes must be uint8{[*lead, n * BITS[fmt] // 8]} for scales of shape "
            f"{scales.shape}, got {codes.dtype}{list(codes.shape)}"
        )
    if fmt == "int8":
        q = lax.bitcast_convert_type(codes, jnp.int8).astype(jnp.float32)
    elif fmt == "fp8":
        q = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)
    else:
        nibble = jnp.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*lead, n)
        magnitude = jnp.asarray(_E2M1, jnp.float32)[nibble & 7]
        q = jnp.where((nibble & 8) != 0, -magnitude, magnitude)
    q = q.reshape(*lead, nblocks, block)
    return (q * scales.astype(jnp.float32)[..., None]).reshape(*lead, n)
