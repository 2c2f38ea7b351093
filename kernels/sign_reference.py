"""Pure-jnp reference of the sign pack/unpack kernels (runs on every backend).

Bit layout (shared with :mod:`shoal.kernels.sign_pallas` and every worker): element
``8 k + j`` of the last axis is bit ``j`` (least significant first) of byte ``k``; the
bit is 1 iff ``sign(v) = -1``, that is iff ``not v >= 0`` (so ``+-0.0`` map to ``+1`` and
NaN to ``-1``). Padding bits of a last partial byte are 0. This is
``numpy.packbits(v < 0 or isnan(v), bitorder="little")``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from shoal import vma
from shoal.kernels.dispatch import batched

__all__ = ["rms", "sign_pack_reference", "sign_unpack_reference"]


# Below this RMS the float32 squares of the values approach the subnormal range.
_TINY = 2.0**-60


def _rms(values: jax.Array) -> jax.Array:
    """``sqrt(sum(v * v) / n)`` over the last axis: the scale both implementations share.

    It is a global reduction, so it stays in XLA for either implementation (the kernels
    then agree bit for bit). ``v * v`` overflows float32 when ``|v|`` exceeds ~1.8e19 and
    underflows below ~1e-19; only then (the plain result is inf, or below 2^-60) is the
    RMS taken again of ``v / max|v|`` and scaled back, so ordinary values cost one pass
    and keep these exact bits. Under ``vmap`` it runs once on the stacked rows
    (`shoal.kernels.dispatch.batched`), so the decision to rescale is one for the whole
    batch, a real branch: a per-row decision would be batched, and the rescaling (three
    more passes) would run on every call. Rows that need none keep the plain value either
    way.
    """
    n = jnp.float32(values.shape[-1])
    plain = jnp.sqrt(jnp.sum(values * values, axis=-1) / n)

    def rescaled():
        top = jnp.max(jnp.abs(values), axis=-1)
        # An Inf input makes inf the right answer; a zero row stays 0.
        redo = jnp.isfinite(top) & (top > 0)
        unit = values / jnp.where(redo, top, 1.0)[..., None]
        again = top * jnp.sqrt(jnp.sum(unit * unit, axis=-1) / n)
        return jnp.where(redo & (jnp.isinf(plain) | (plain < _TINY)), again, plain)

    suspect = jnp.isinf(plain) | (plain < _TINY)  # False for NaN
    return vma.cond(jnp.any(suspect), rescaled, lambda: plain)


rms = batched(_rms)


def negative_bits(values: jax.Array) -> jax.Array:
    """``not v >= 0`` (the issue defines sign(v) = +1 iff v >= 0), decided on the bits:
    XLA:CPU compares subnormals as zero, which would make a negative subnormal "+"."""
    bits = lax.bitcast_convert_type(values, jnp.int32)
    magnitude = bits & 0x7FFFFFFF
    return ((bits < 0) & (magnitude != 0)) | (magnitude > 0x7F800000)  # v < 0, or NaN


def sign_pack_reference(values: jax.Array) -> jax.Array:
    """uint8[..., ceil(n / 8)]: the sign bits of float32[..., n] (arguments validated)."""
    *lead, n = values.shape
    nbytes = -(-n // 8)
    neg = negative_bits(values).astype(jnp.uint8)
    if nbytes * 8 != n:
        neg = jnp.pad(neg, [(0, 0)] * len(lead) + [(0, nbytes * 8 - n)])
    neg = neg.reshape(*lead, nbytes, 8)
    weights = jnp.arange(8, dtype=jnp.uint8)
    # Bits are disjoint, so OR-reducing the shifted bits is the byte.
    return lax.reduce(neg << weights, jnp.uint8(0), lax.bitwise_or, (neg.ndim - 1,))


def sign_unpack_reference(bits: jax.Array, scale: jax.Array, size: int) -> jax.Array:
    """float32[..., size]: ``scale * sign`` decoded from uint8[..., nbytes] (validated)."""
    *lead, nbytes = bits.shape
    neg = (bits[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
    s = scale.astype(jnp.float32)[..., None, None]
    out = jnp.where(neg == 1, -s, s).reshape(*lead, nbytes * 8)
    return out[..., :size]
