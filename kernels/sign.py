"""Sign pack/unpack: 1-bit compression with one scale per buffer (1-bit Adam/LAMB).

A buffer ``v`` of ``n`` float32 values is sent as its signs, 8 per byte, and one scale,
the root mean square:

.. math::

    s = \\sqrt{\\tfrac{1}{n} \\textstyle\\sum_i v_i^2}, \\qquad
    \\operatorname{sign}(v_i) = \\begin{cases} +1 & v_i \\ge 0 \\\\ -1 &
    \\text{otherwise} \\end{cases}, \\qquad \\hat v = s \\operatorname{sign}(v).

Bit layout: element ``8 k + j`` is bit ``j`` (least significant first) of byte ``k``;
the bit is 1 iff ``sign(v) = -1`` (``not v >= 0``: ``+-0.0`` give +1, NaN gives -1).
Padding bits of a last partial byte are 0. Equivalently
``numpy.packbits(~(v >= 0), bitorder="little")``.

Each function dispatches to a Pallas (Triton) kernel on GPU and to a pure-jnp reference
elsewhere; both give bit-identical results. The scale is computed in XLA for both.

References:
    F. Seide, H. Fu, J. Droppo, G. Li, D. Yu, "1-Bit Stochastic Gradient Descent and its
    Application to Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014.
    H. Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
    Convergence Speed", ICML 2021.
    C. Li et al., "1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training
    with LAMB's Convergence Speed", HiPC 2022 (arXiv:2104.06069).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

from shoal.kernels import dispatch
from shoal.kernels.sign_pallas import sign_pack_pallas, sign_unpack_pallas
from shoal.kernels.sign_reference import rms, sign_pack_reference, sign_unpack_reference

__all__ = ["sign_pack", "sign_unpack"]


def sign_pack(values: jax.Array, *, impl: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Signs of ``values`` packed 8 per byte, and the RMS scale of each buffer.

    For a buffer ``v`` of ``n`` values::

        scale = sqrt(sum(v * v) / n)
        bit j of byte k = 1  iff  not v[8 k + j] >= 0   (least significant bit first)

    so ``+-0.0`` read as +1 and NaN as -1; padding bits of a last partial byte are 0
    (``numpy.packbits(~(v >= 0), bitorder="little")``).

    Args:
      values: float32[..., n] with ``n >= 1``; leading dimensions are independent buffers.
      impl: ``None`` (Pallas on GPU, jnp reference elsewhere), ``"reference"`` or
        ``"pallas"`` (interpreted when the backend is not a GPU).

    Returns:
      ``(bits, scale)``: uint8[..., ceil(n / 8)] in that bit layout, and float32[...]
      ``sqrt(sum(v * v) / n)`` over the last axis.

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.kernels import sign_pack
      >>> bits, scale = sign_pack(jnp.array([2.0, -2.0, 2.0, 2.0, -2.0]))
      >>> print(bits, scale)  # elements 1 and 4 are negative: 0b10010
      [18] 2.0

    References:
      F. Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
      Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014.
      H. Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with
      Adam's Convergence Speed", ICML 2021.
    """
    use_pallas = dispatch.use_pallas(impl)
    values = dispatch.typed_array(values, jnp.float32, "values")
    if values.ndim < 1 or values.shape[-1] < 1:
        raise ValueError(f"values must have shape [..., n >= 1], got {values.shape}")
    return _pack(values, use_pallas=use_pallas)


@functools.partial(jax.jit, static_argnames=("use_pallas",))
def _pack(values, *, use_pallas):
    if use_pallas:
        bits = dispatch.batched(_pallas_pack)(values)
    else:
        bits = sign_pack_reference(values)
    return bits, rms(values)


def _pallas_pack(values):
    return sign_pack_pallas(values, interpret=jax.default_backend() != "gpu")


def sign_unpack(
    bits: jax.Array, scale: jax.Array | float, size: int, *, impl: str | None = None
) -> jax.Array:
    """``scale * sign`` decoded from packed sign bits, the inverse of `sign_pack`.

    Element ``8 k + j`` is ``-scale`` if bit ``j`` (least significant first) of byte
    ``k`` is set, else ``+scale``.

    Args:
      bits: uint8[..., nbytes] as produced by :func:`sign_pack`.
      scale: float32 with shape ``bits.shape[:-1]`` (a scalar for one buffer), may be
        traced.
      size: static int, the number of values per buffer: ``8 (nbytes - 1) < size <=
        8 nbytes``.
      impl: as for :func:`sign_pack`.

    Returns:
      float32[..., size], each element exactly ``+scale`` or ``-scale``.

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.kernels import sign_unpack
      >>> print(sign_unpack(jnp.array([0b10010], jnp.uint8), 2.0, size=5))
      [ 2. -2.  2.  2. -2.]

    References:
      H. Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with
      Adam's Convergence Speed", ICML 2021.
    """
    use_pallas = dispatch.use_pallas(impl)
    bits = dispatch.typed_array(bits, jnp.uint8, "bits")
    if bits.ndim < 1 or bits.shape[-1] < 1:
        raise ValueError(f"bits must have shape [..., nbytes >= 1], got {bits.shape}")
    scale = jnp.asarray(scale)
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise TypeError(f"scale must be floating point, got dtype {scale.dtype}")
    if scale.shape != bits.shape[:-1]:
        raise ValueError(
            f"scale must have shape {bits.shape[:-1]} (the leading dimensions of bits), "
            f"got {scale.shape}"
        )
    if isinstance(size, bool):
        raise TypeError(f"size must be a static Python int, got {size!r}")
    try:
        size = operator.index(size)
    except TypeError:
        raise TypeError(f"size must be a static Python int, got {type(size).__name__}") from None
    nbytes = bits.shape[-1]
    if not 8 * (nbytes - 1) < size <= 8 * nbytes:
        raise ValueError(f"size must be in [{8 * nbytes - 7}, {8 * nbytes}], got {size}")
    return _unpack(bits, scale.astype(jnp.float32), size=size, use_pallas=use_pallas)


@functools.partial(jax.jit, static_argnames=("size", "use_pallas"))
def _unpack(bits, scale, *, size, use_pallas):
    if use_pallas:
        return dispatch.batched(functools.partial(_pallas_unpack, size=size))(bits, scale)
    return sign_unpack_reference(bits, scale, size)


def _pallas_unpack(bits, scale, *, size):
    return sign_unpack_pallas(bits, scale, size, interpret=jax.default_backend() != "gpu")
