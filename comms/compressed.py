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
bits and scales move (see :func:`compressed_allreduce_bytes`), in half the latency.

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

from shoal.comms.collective import Collective
from shoal.comms.compressor import Compressor, check_error, check_vector, two_phase_mean
from shoal.kernels.sign import sign_pack, sign_unpack

__all__ = [
    "OneBit",
    "compressed_allreduce",
    "compressed_allreduce_bytes",
    "compressed_allreduce_init",
    "compressed_allreduce_padded_size",
]

_SCALE_BYTES = 4  # one float32 per row


@dataclasses.dataclass(frozen=True)
class OneBit(Compressor):
    """Scaled signs, 8 per byte, with one float32 RMS scale per encoded buffer.

    ``E(v) = (sign(v), s)`` with ``s = sqrt(mean(v * v))`` over the whole buffer encoded
    (all ``P`` chunks of a worker, or one server chunk) and ``D = s sign``; ``sign(v) =
    +1`` for ``v >= 0``. A row of ``c`` values is ``c / 8 + 4`` bytes: the packed signs,
    then the scale. The pattern is the two-phase all-reduce (`compressed_allreduce`).

    Args:
      error_feedback: keep the worker and server errors (1-bit Adam does).
      impl: sign kernel implementation, as for :func:`shoal.kernels.sign_pack`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective, OneBit
      >>> coll = AxisCollective("workers", 2)
      >>> codec = OneBit()
      >>> f = lambda x: codec.mean(x, codec.init(16, 2), collective=coll)[0]
      >>> x = jnp.array([[1.0, -1.0] * 8, [3.0, -3.0] * 8])
      >>> print(jax.vmap(f, axis_name="workers")(x)[:, :4])
      [[ 2. -2.  2. -2.]
       [ 2. -2.  2. -2.]]
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


def compressed_allreduce_padded_size(n: int, size: int) -> int:
    """The padded length ``n_pad`` of the buffers of `compressed_allreduce`.

    ``n_pad`` is the smallest multiple of ``size * lcm(size, 8)`` that is ``>= n``, so
    each of the ``size`` chunks holds a multiple of 8 elements (whole bytes of signs)
    and of ``size``.

    Args:
      n: positive int, the number of values reduced.
      size: the number of workers ``P``.

    Returns:
      ``n_pad``, a Python int.

    Example:
      >>> from shoal.comms import compressed_allreduce_padded_size
      >>> compressed_allreduce_padded_size(100, size=4)  # a multiple of 4 * lcm(4, 8) = 32
      128
    """
    return OneBit().padded_size(n, size)


def compressed_allreduce_init(n: int, size: int) -> tuple[jax.Array, jax.Array]:
    """The initial error-feedback buffers of `compressed_allreduce`: zeros.

    Args:
      n: positive int, the number of values reduced.
      size: the number of workers ``P``.

    Returns:
      ``(worker_error, server_error)``: zero float32[n_pad] and float32[n_pad / size],
      with ``n_pad`` from `compressed_allreduce_padded_size`.

    Example:
      >>> from shoal.comms import compressed_allreduce_init
      >>> worker_error, server_error = compressed_allreduce_init(10, size=2)
      >>> worker_error.shape, server_error.shape
      ((16,), (8,))
    """
    return OneBit().init(n, size)


def compressed_allreduce_bytes(n: int, size: int) -> tuple[int, int]:
    """Bytes one call of `compressed_allreduce` sends and receives per worker (static).

    With ``P = size``, ``c = n_pad / P`` and ``b = c / 8`` sign bytes per chunk:
    all-to-all of the ``n_pad / 8`` packed bytes ``(P-1) b``, all-gather of the worker
    scale ``4 (P-1)``, all-gather of the packed server chunk ``(P-1) b`` and of its
    scale ``4 (P-1)``::

        sent = received = 2 (P-1) (b + 4)

    against ``2 (P-1) / P 4 n`` for a float32 ring all-reduce, about ``32 n / n_pad``
    times more. Counted by the rules of `shoal.comms.wire`.

    Args:
      n: positive int, the number of values reduced.
      size: the number of workers ``P``.

    Returns:
      ``(sent, received)``, Python ints.

    Example:
      >>> from shoal.comms import compressed_allreduce_bytes
      >>> compressed_allreduce_bytes(1000, size=4)  # n_pad = 1024, b = 32
      (216, 216)

    References:
      H. Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with
      Adam's Convergence Speed", ICML 2021, section 4.
    """
    return OneBit().wire_bytes(n, size)


def compressed_allreduce(
    x: jax.Array,
    worker_error: jax.Array,
    server_error: jax.Array,
    *,
    collective: Collective,
    impl: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Error-compensated 1-bit mean of ``x`` over the workers, the same on every worker.

    Two stages, each sending signs (8 per byte) and one RMS scale per chunk. ``x`` is
    padded to ``n_pad`` (`compressed_allreduce_padded_size`) and cut into ``P`` chunks;
    worker ``r`` reduces chunk ``r``::

        v   = pad(x) + e            s = sqrt(mean(v * v))     e <- v - s sign(v)
        m_r = (1/P) sum_j s_j sign(v_j)[chunk r] + e_r           (all-to-all)
        s_r = sqrt(mean(m_r * m_r))                         e_r <- m_r - s_r sign(m_r)
        y   = concat_r s_r sign(m_r), un-padded to n                 (all-gather)

    with ``sign(v) = +1`` for ``v >= 0`` and ``-1`` otherwise; ``e`` is the worker
    error and ``e_r`` the server error, fed back into the next call.

    Args:
      x: float32[n], this worker's values.
      worker_error: float32[n_pad], this worker's error feedback (start at zero, see
        :func:`compressed_allreduce_init`).
      server_error: float32[n_pad / P], the error feedback of the chunk this worker
        reduces (its rank's chunk).
      collective: the ``P`` workers (`shoal.comms.Collective`).
      impl: sign kernel implementation, as for :func:`shoal.kernels.sign_pack`.

    Returns:
      ``(y, worker_error, server_error)``: ``y`` float32[n], the same on every worker,
      and the updated errors. Donate the errors under ``jax.jit`` to update them in place.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective, compressed_allreduce
      >>> from shoal.comms import compressed_allreduce_init
      >>> coll = AxisCollective("workers", 2)
      >>> def mean(x):
      ...     worker_error, server_error = compressed_allreduce_init(16, coll.size)
      ...     y, _, _ = compressed_allreduce(x, worker_error, server_error, collective=coll)
      ...     return y
      >>> x = jnp.array([[1.0, -1.0] * 8, [3.0, -3.0] * 8])  # one row per worker
      >>> print(jax.jit(jax.vmap(mean, axis_name="workers"))(x)[:, :4])
      [[ 2. -2.  2. -2.]
       [ 2. -2.  2. -2.]]

    References:
      H. Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with
      Adam's Convergence Speed", ICML 2021, section 4 (compressed all-reduce).
      C. Li et al., "1-bit LAMB: Communication Efficient Large-Scale Large-Batch
      Training with LAMB's Convergence Speed", HiPC 2022 (arXiv:2104.06069).
    """
    x = check_vector(x)
    n, size = x.shape[0], collective.size
    n_pad = compressed_allreduce_padded_size(n, size)
    worker_error = check_error("worker_error", worker_error, n_pad, n, size)
    server_error = check_error("server_error", server_error, n_pad // size, n, size)
    return two_phase_mean(OneBit(impl=impl), x, worker_error, server_error, collective=collective)
