"""Top-k sparsification with error feedback, exchanged as fixed-size all-gathered payloads.

The buffer is cut into chunks of ``L`` values (the whole buffer when no chunk size is
given); from each chunk the ``k = ceil(fraction L)`` values of largest magnitude are sent
as (value, index) pairs and the rest stays in the error buffer::

    v = pad(x) + e              S = top-k |v| per chunk          e <- v - D(E(v))
    y = (1/P) sum_j D(E(v_j))                                    (one all-gather)

``D`` scatters the values back to their indices (zero elsewhere). With ``error_decay =
beta < 1`` the kept error decays before it joins the next input, ``v = pad(x) + beta e``:
SparseLoCo's accumulator ``A <- beta A + Delta``, whose sent part is subtracted.

With ``value_bits = b`` the sent values are further quantized, per chunk, to a sign and
one of ``2^(b-1)`` magnitudes spaced evenly up to the chunk's largest sent magnitude ``s``::

    |v| -> s (j + 1) / 2^(b-1),   j = round(|v| 2^(b-1) / s) - 1 clipped to [0, 2^(b-1) - 1]

so ``b = 2`` sends ``+-s/2`` or ``+-s``, and the quantization error joins the error buffer
too. (SparseLoCo's 2-bit quantizer sets its range from the values' statistics; this one
from their maximum, which keeps the largest value exact.)

Payload per chunk: the values (float32, or ``b``-bit codes packed ``8 / b`` per byte, and
one float32 scale), then the indices within the chunk (uint16 when ``L <= 65536``, else
uint32). Every worker sends the same number of bytes, so one fixed-size all-gather
carries them.

References:
    A. Sarfi, B. Therien, J. Lidin, E. Belilovsky, "Communication Efficient LLM
    Pre-training with SparseLoCo", arXiv:2508.15706 (2025).
    S. Stich, J.-B. Cordonnier, M. Jaggi, "Sparsified SGD with Memory", NeurIPS 2018.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from shoal.checks import check_int, check_real
from shoal.comms.codecs.base import Compressor

__all__ = ["VALUE_BITS", "TopK"]

VALUE_BITS = (2, 4, 8)
_U16_MAX_CHUNK = 1 << 16


@dataclasses.dataclass(frozen=True)
class TopK(Compressor):
    """Top-k sparsification per chunk with error feedback; an all-gather of the payloads.

    Args:
      fraction: the share of each chunk sent, in (0, 1]; ``k = ceil(fraction L)``. The
        one positional argument, as ``Quantized``'s format: ``TopK(0.01)``.
      chunk_size: ``L``, the values per chunk, or None for the whole buffer.
      value_bits: None (float32 values) or 2, 4 or 8 (a sign and ``2^(b-1)`` magnitudes).
      error_feedback: keep what is not sent (default True).
      error_decay: ``beta`` in (0, 1], the factor on the kept error before it joins the
        next call's input (1: plain error feedback; SparseLoCo's 0.95). Keyword-only.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective, TopK
      >>> coll = AxisCollective("workers", 2)
      >>> codec = TopK(0.5, chunk_size=2)  # one value of each pair
      >>> codec.wire_bytes(4, size=2)  # per chunk a float32 value and a uint16 index
      (12, 12)
      >>> f = lambda x: codec.mean(x, codec.init(4, 2), collective=coll)
      >>> y, (error,) = jax.vmap(f, axis_name="workers")(jnp.array([[1.0, -3.0, 2.0, 0.5],
      ...                                                        [1.0, 1.0, 4.0, 0.0]]))
      >>> print(y[0])
      [ 0.5 -1.5  3.   0. ]
      >>> print(error)
      [[1.  0.  0.  0.5]
       [0.  1.  0.  0. ]]
    """

    pattern: ClassVar[str] = "all_gather"
    fraction: float
    _: dataclasses.KW_ONLY
    chunk_size: int | None = None
    value_bits: int | None = None
    error_decay: float = 1.0

    def __post_init__(self):
        b = check_real("error_decay", self.error_decay, 0, 1, open_low=True)
        if b != 1 and not self.error_feedback:
            raise ValueError(f"error_decay = {b!r} needs error_feedback=True (no error to decay)")
        object.__setattr__(self, "error_decay", b)
        check_real("fraction", self.fraction, 0, 1, open_low=True)
        if self.chunk_size is not None:
            c = check_int("chunk_size", self.chunk_size, 1, why=" or None")
            object.__setattr__(self, "chunk_size", c)
        if self.value_bits is not None and self.value_bits not in VALUE_BITS:
            raise ValueError(
                f"value_bits must be None or one of {VALUE_BITS}, got {self.value_bits!r}"
            )

    # -- layout ---------------------------------------------------------------------
    def _chunk(self, c: int) -> int:
        return c if self.chunk_size is None else self.chunk_size

    def k(self, chunk: int) -> int:
        """Values sent per chunk of ``chunk`` values: ``ceil(fraction chunk)`` (>= 1)."""
        return max(1, math.ceil(round(self.fraction * chunk, 9)))

    def chunk_unit(self, size: int) -> int:
        return 1 if self.chunk_size is None else self.chunk_size

    def _code_bytes(self, chunks: int, k: int) -> int:
        if self.value_bits is None:
            return 4 * chunks * k
        return -(-chunks * k * self.value_bits // 8) + 4 * chunks  # codes, then scales

    def _index_bytes(self, chunk: int) -> int:
        return 2 if chunk <= _U16_MAX_CHUNK else 4

    def row_bytes(self, c: int) -> int:
        chunk = self._chunk(c)
        chunks, k = c // chunk, self.k(chunk)
        return self._code_bytes(chunks, k) + chunks * k * self._index_bytes(chunk)

    # -- codec ----------------------------------------------------------------------
    def encode(self, v: jax.Array) -> jax.Array:
        rows, c = v.shape
        chunk = self._chunk(c)
        k = self.k(chunk)
        blocks = v.reshape(rows, c // chunk, chunk)
        _, idx = lax.top_k(jnp.abs(blocks), k)  # ties: the lower index first
        values = jnp.take_along_axis(blocks, idx, axis=-1)
        index_type = jnp.uint16 if self._index_bytes(chunk) == 2 else jnp.uint32
        raw_idx = _as_bytes(idx.astype(index_type), rows)
        if self.value_bits is None:
            return jnp.concatenate([_as_bytes(values, rows), raw_idx], axis=-1)
        codes, scales = self._quantize(values)
        packed = _pack(codes.reshape(rows, -1), self.value_bits)
        return jnp.concatenate([packed, _as_bytes(scales, rows), raw_idx], axis=-1)

    def decode(self, payload: jax.Array, c: int) -> jax.Array:
        rows = payload.shape[0]
        chunk = self._chunk(c)
        chunks, k = c // chunk, self.k(chunk)
        code_bytes = self._code_bytes(chunks, k)
        index_type = jnp.uint16 if self._index_bytes(chunk) == 2 else jnp.uint32
        idx = _from_bytes(payload[:, code_bytes:], index_type).reshape(rows, chunks, k)
        if self.value_bits is None:
            values = _from_bytes(payload[:, :code_bytes], jnp.float32).reshape(rows, chunks, k)
        else:
            packed_bytes = code_bytes - 4 * chunks
            codes = _unpack(payload[:, :packed_bytes], self.value_bits, chunks * k)
            scales = _from_bytes(payload[:, packed_bytes:code_bytes], jnp.float32)
            values = self._dequantize(codes.reshape(rows, chunks, k), scales[..., None])
        dense = jnp.zeros((rows, chunks, chunk), jnp.float32)
        dense = jnp.put_along_axis(dense, idx.astype(jnp.int32), values, axis=-1, inplace=False)
        return dense.reshape(rows, c)

    def feedback(self, error: jax.Array) -> jax.Array:
        # 1.0 adds the error as it is: bitwise plain error feedback, no multiply.
        return error if self.error_decay == 1.0 else jnp.float32(self.error_decay) * error

    # -- the optional value quantizer -------------------------------------------------
    def _levels(self) -> int:
        return 1 << (self.value_bits - 1)

    def _quantize(self, values: jax.Array) -> tuple[jax.Array, jax.Array]:
        """values [..., k] -> (codes uint8 [..., k]: sign << (b-1) | j, scales [...])."""
        levels = self._levels()
        scale = jnp.max(jnp.abs(values), axis=-1)
        safe = jnp.where(scale > 0, scale, 1.0)[..., None]
        j = jnp.clip(jnp.round(jnp.abs(values) * levels / safe) - 1, 0, levels - 1)
        sign = (values < 0).astype(jnp.uint8)
        return (sign << (self.value_bits - 1)) | j.astype(jnp.uint8), scale

    def _dequantize(self, codes: jax.Array, scale: jax.Array) -> jax.Array:
        levels = self._levels()
        j = (codes & (levels - 1)).astype(jnp.float32)
        magnitude = scale * (j + 1) / jnp.float32(levels)
        return jnp.where(codes >> (self.value_bits - 1) == 1, -magnitude, magnitude)


def _as_bytes(x: jax.Array, rows: int) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint8).reshape(rows, -1)


def _from_bytes(raw: jax.Array, dtype) -> jax.Array:
    width = jnp.dtype(dtype).itemsize
    return lax.bitcast_convert_type(raw.reshape(*raw.shape[:-1], -1, width), dtype)


def _pack(codes: jax.Array, bits: int) -> jax.Array:
    """uint8 codes [r, m] of ``bits`` each -> uint8 [r, ceil(m bits / 8)], low bits first."""
    per = 8 // bits
    rows, m = codes.shape
    codes = jnp.pad(codes, ((0, 0), (0, -m % per))).reshape(rows, -1, per)
    shifts = jnp.arange(per, dtype=jnp.uint8) * bits
    return jnp.sum(codes << shifts, axis=-1, dtype=jnp.uint8)  # the bit fields do not overlap


def _unpack(packed: jax.Array, bits: int, m: int) -> jax.Array:
    per = 8 // bits
    shifts = jnp.arange(per, dtype=jnp.uint8) * bits
    codes = (packed[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0], -1)[:, :m]
