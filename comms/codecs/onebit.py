"""Error-compensated 1-bit all-reduce (the compressed all-reduce of 1-bit Adam/LAMB).

Every worker ``i`` holds ``x_i`` (float32[n]); all get the same ``y``, a two-stage 1-bit
estimate of ``(1/P) sum_i x_i`` whose errors are fed back into the next call. With
``n_pad`` the smallest multiple of ``P lcm(P, 8)`` that is ``>= n``, the buffer splits into
``P`` chunks of ``c = n_pad / P`` elements (a whole number of bytes each). Per worker::

    v   = pad(x) + e                      s = sqrt(sum(v * v) / n_pad)
    e  <- v - s sign(v)                   (worker error, n_pad elements)
    phase 1: all-to-all the packed sign chunks; worker r gets chunk r of everyone, and
             every worker's s
    m   = (1/P) sum_j s_j sign_j[chunk r] + e_r
    s_r = sqrt(mean(m * m))               e_r <- m - s_r sign(m)   (server error, c)
    phase 2: all-gather the packed sign(m) chunks and the s_r
    y   = concat_r s_r sign(m_r), un-padded to n        (identical on every worker)

with ``sign(v) = +1`` for ``v >= 0`` and ``-1`` otherwise. Signs travel as bits
(:func:`shoal.kernels.sign_pack`, 8 per byte). Each scale travels as its 4 float32
bytes appended to the packed chunk it belongs to, so a call is one all-to-all and one
all-gather of uint8 rows ``[c / 8 + 4]``: byte for byte what the separate exchanges of
bits and scales move (see `OneBit`), in half the latency.

References:
    H. Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
    Convergence Speed", ICML 2021, section 4 (compressed all-reduce, Figure 2).
    C. Li et al., "1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training
    with LAMB's Convergence Speed", HiPC 2022 (arXiv:2104.06069), Algorithm 1.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from shoal.comms.codecs.base import Compressor
from shoal.kernels.sign import sign_pack, sign_unpack

__all__ = ["OneBit"]

_SCALE_BYTES = 4  # one float32 per row


@dataclasses.dataclass(frozen=True)
class OneBit(Compressor):
    """Scaled signs, 8 per byte, with one float32 RMS scale per encoded buffer.

    ``E(v) = (sign(v), s)`` with ``s = sqrt(mean(v * v))`` over the whole buffer encoded
    (all ``P`` chunks of a worker, or one server chunk) and ``D = s sign``; ``sign(v) =
    +1`` for ``v >= 0``. A row of ``c`` values is ``c / 8 + 4`` bytes: the packed signs,
    then the scale.

    The pattern is the two-phase compressed all-reduce of 1-bit Adam/LAMB (`mean`). The
    buffer is padded to ``n_pad`` (`padded_size`), the smallest multiple of
    ``P lcm(P, 8)`` that is ``>= n``, so each of the ``P`` chunks holds a multiple of 8
    elements (whole bytes of signs) and of ``P``; worker ``r`` reduces chunk ``r``::

        v   = pad(x) + e            s = sqrt(mean(v * v))     e <- v - s sign(v)
        m_r = (1/P) sum_j s_j sign(v_j)[chunk r] + e_r           (all-to-all)
        s_r = sqrt(mean(m_r * m_r))                         e_r <- m_r - s_r sign(m_r)
        y   = concat_r s_r sign(m_r), un-padded to n                 (all-gather)

    ``e`` is the worker error (float32[n_pad]) and ``e_r`` the server error of the chunk
    the worker reduces (float32[n_pad / P]), the ``memory`` of `mean`, zero from `init`
    and fed back into the next call (``error_feedback=False``: no memory, ``e = e_r =
    0``).

    Bytes per call and worker (`wire_bytes`), with ``c = n_pad / P`` and ``b = c / 8``
    sign bytes per chunk: all-to-all of the ``n_pad / 8`` packed bytes ``(P-1) b``,
    all-gather of the worker scale ``4 (P-1)``, all-gather of the packed server chunk
    ``(P-1) b`` and of its scale ``4 (P-1)``::

        sent = received = 2 (P-1) (b + 4)

    against ``2 (P-1) / P 4 n`` for a float32 ring all-reduce, about ``32 n / n_pad``
    times more. Counted by the rules of `shoal.comms.wire`.

    Args:
      error_feedback: keep the worker and server errors (1-bit Adam does).
      impl: sign kernel implementation, as for :func:`shoal.kernels.sign_pack`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective, OneBit
      >>> codec = OneBit()
      >>> codec.padded_size(100, size=4)  # a multiple of 4 * lcm(4, 8) = 32
      128
      >>> [e.shape for e in codec.init(10, size=2)]  # worker error, server error
      [(16,), (8,)]
      >>> codec.wire_bytes(1000, size=4)  # n_pad = 1024, b = 32
      (216, 216)
      >>> coll = AxisCollective("workers", 2)
      >>> f = lambda x: codec.mean(x, codec.init(16, 2), collective=coll)[0]
      >>> x = jnp.array([[1.0, -1.0] * 8, [3.0, -3.0] * 8])  # one row per worker
      >>> print(jax.jit(jax.vmap(f, axis_name="workers"))(x)[:, :4])
      [[ 2. -2.  2. -2.]
       [ 2. -2.  2. -2.]]

    References:
      H. Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with
      Adam's Convergence Speed", ICML 2021, section 4 (compressed all-reduce).
      C. Li et al., "1-bit LAMB: Communication Efficient Large-Scale Large-Batch
      Training with LAMB's Convergence Speed", HiPC 2022 (arXiv:2104.06069).
    """

    impl: str | None = None

    def chunk_unit(self, size: int) -> int:
        # whole bytes of signs, and a multiple of P (1-bit LAMB's layer scales need it)
        return math.lcm(size, 8)

    def row_bytes(self, c: int) -> int:
        return c // 8 + _SCALE_BYTES

    def encode(self, v: jax.Array) -> jax.Array:
        rows, c = v.shape
        bits, scale = sign_pack(v.reshape(rows * c), impl=self.impl)
        raw = lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint8)
        return jnp.concatenate(
            [bits.reshape(rows, c // 8), jnp.broadcast_to(raw, (rows, _SCALE_BYTES))], axis=1
        )

    def decode(self, rows: jax.Array, c: int) -> jax.Array:
        scale = lax.bitcast_convert_type(rows[:, c // 8 :], jnp.float32)  # [r, 1]
        return sign_unpack(rows[:, : c // 8], scale, c, impl=self.impl)
