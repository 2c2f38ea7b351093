"""Block-scaled low-precision quantization: int8, fp8 e4m3 and fp4 e2m1 with absmax scales.

A buffer of ``n`` float32 values (``n`` a multiple of ``block``) is cut into blocks of
``block`` consecutive values; block ``b`` is sent as one float32 scale and one code per
value:

.. math::

    s_b = \\max_{i \\in b} |v_i| \\cdot \\operatorname{fl}(1 / M), \\qquad
    q_i = \\operatorname{round}(\\operatorname{clip}(v_i / s_b, -M, M)), \\qquad
    \\hat v_i = q_i s_b

(``q_i = 0``, ``s_b = 0`` for an all-zero block), with ``M`` = 127 (int8, integers, ties
to even), 448 (fp8 e4m3fn, the IEEE cast) or 6 (fp4 e2m1, ``{0, 0.5, 1, 1.5, 2, 3, 4,
6}``, ties to the even code). Codes are uint8[..., n * bits / 8]: one byte per int8 /
fp8 value, and for fp4 value ``2 k`` in the low nibble of byte ``k`` and ``2 k + 1`` in
the high nibble, a nibble being ``sign << 3 | e2m1 index``. See
:mod:`shoal.kernels.quant_reference` for the details, including non-finite inputs.

Each function dispatches to a Pallas (Triton) kernel on GPU
(:mod:`shoal.kernels.quant_pallas`) and to the pure-jnp reference elsewhere; both give
bit-identical codes, scales and values (NaN payloads aside). Blocks longer than
``MAX_BLOCK`` (8192) values always use the reference. Both work under ``jax.jit`` and
``jax.vmap``.

References:
    P. Micikevicius et al., "FP8 Formats for Deep Learning", arXiv:2209.05433 (2022).
    Open Compute Project, "OCP Microscaling Formats (MX) Specification" v1.0 (2023),
    FP4 (E2M1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from shoal.kernels import dispatch
from shoal.kernels.quant_pallas import MAX_BLOCK, dequantize_pallas, quantize_pallas
from shoal.kernels.quant_reference import (
    BITS,
    check_block,
    check_format,
    dequantize_reference,
    quantize_reference,
)

__all__ = ["dequantize", "quantize"]


def quantize(
    values: jax.Array, fmt: str, block: int, *, impl: str | None = None
) -> tuple[jax.Array, jax.Array]:
    """Low-precision codes and float32 absmax scales of blocks of ``block`` values.

    For each block ``b`` of ``block`` consecutive values along the last axis::

        scale[b] = max |v_i| * float32(1 / M)              (0 for an all-zero block)
        code[i]  = round(clip(v_i / scale[b], -M, M))      (0 when scale[b] == 0)

    with ``M`` = 127 (``"int8"``: integers, ties to even, two's complement bytes), 448
    (``"fp8"``: float8 e4m3fn bits, round to nearest even) or 6 (``"fp4"``: e2m1, two
    codes per byte, value ``2 k`` in the low nibble of byte ``k``, a nibble being
    ``sign << 3 | index`` into ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``, ties to the even
    index). A NaN or Inf in a block makes its scale non-finite.

    Args:
      values: float32[..., n] with ``n`` a multiple of ``block``; leading dimensions are
        independent buffers.
      fmt: ``"int8"``, ``"fp8"`` or ``"fp4"`` (static).
      block: static positive int, the values per scale; even for ``"fp4"``.
      impl: ``None`` (Pallas on GPU, jnp reference elsewhere), ``"reference"`` or
        ``"pallas"`` (interpreted when the backend is not a GPU). Blocks longer than
        8192 values use the reference whatever ``impl`` says.

    Returns:
      ``(codes, scales)``: uint8[..., n * bits / 8] (bits = 8, or 4 for ``"fp4"``) and
      float32[..., n / block].

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.kernels.quant import quantize
      >>> codes, scales = quantize(jnp.array([6.0, -3.0, 1.25, 0.0]), "fp4", 4)
      >>> print(codes, scales)  # nibbles 7 (6), 8|5 (-3), 2 (1.25 ties to 1), 0
      [215   2] [1.]

    References:
      P. Micikevicius et al., "FP8 Formats for Deep Learning", arXiv:2209.05433 (2022).
      Open Compute Project, "OCP Microscaling Formats (MX) Specification" v1.0 (2023).
    """
    use_pallas = dispatch.use_pallas(impl)
    check_format(fmt)
    block = check_block(block, fmt)
    values = dispatch.typed_array(values, jnp.float32, "values")
    if values.ndim < 1:
        raise ValueError(f"values must have shape [..., n], got {values.shape}")
    if values.shape[-1] % block:
        raise ValueError(
            f"values: the last axis ({values.shape[-1]}) must be a multiple of block={block}"
        )
    return _quantize(values, fmt=fmt, block=block, use_pallas=use_pallas and block <= MAX_BLOCK)


@functools.partial(jax.jit, static_argnames=("fmt", "block", "use_pallas"))
def _quantize(values, *, fmt, block, use_pallas):
    if use_pallas:
        interpret = jax.default_backend() != "gpu"
        return dispatch.batched(
            functools.partial(quantize_pallas, fmt=fmt, block=block, interpret=interpret)
        )(values)
    return quantize_reference(values, fmt, block)


def dequantize(
    codes: jax.Array, scales: jax.Array, fmt: str, block: int, *, impl: str | None = None
) -> jax.Array:
    """float32 values ``code * scale`` decoded from :func:`quantize`'s codes and scales.

    Value ``i`` of block ``b`` is the number its code stands for (an int8 integer, a
    float8 e4m3fn value, or ``+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` for fp4) times
    ``scales[b]``, rounded to float32.

    Args:
      codes: uint8[..., n * bits / 8] in the layout of :func:`quantize`.
      scales: float32[..., n / block] (the leading dimensions of ``codes``), may be
        traced.
      fmt: ``"int8"``, ``"fp8"`` or ``"fp4"`` (static).
      block: static positive int, the values per scale; even for ``"fp4"``.
      impl: as for :func:`quantize`.

    Returns:
      float32[..., n] with ``n = scales.shape[-1] * block``.

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.kernels.quant import dequantize
      >>> print(dequantize(jnp.array([215, 2], jnp.uint8), jnp.array([0.5]), "fp4", 4))
      [ 3.  -1.5  0.5  0. ]

    References:
      Open Compute Project, "OCP Microscaling Formats (MX) Specification" v1.0 (2023).
    """
    use_pallas = dispatch.use_pallas(impl)
    check_format(fmt)
    block = check_block(block, fmt)
    codes = dispatch.typed_array(codes, jnp.uint8, "codes")
    scales = dispatch.typed_array(scales, jnp.float32, "scales")
    if scales.ndim < 1:
        raise ValueError(f"scales must have shape [..., blocks], got {scales.shape}")
    want = (*scales.shape[:-1], scales.shape[-1] * block * BITS[fmt] // 8)
    if codes.shape != want:
        raise ValueError(
            f"codes must have shape {want} for scales of shape {scales.shape}, "
            f"fmt={fmt!r} and block={block}, got {codes.shape}"
        )
    return _dequantize(
        codes, scales, fmt=fmt, block=block, use_pallas=use_pallas and block <= MAX_BLOCK
    )


@functools.partial(jax.jit, static_argnames=("fmt", "block", "use_pallas"))
def _dequantize(codes, scales, *, fmt, block, use_pallas):
    if use_pallas:
        interpret = jax.default_backend() != "gpu"
        return dispatch.batched(
            functools.partial(dequantize_pallas, fmt=fmt, block=block, interpret=interpret)
        )(codes, scales)
    return dequantize_reference(codes, scales, fmt, block)
