"""Low-precision all-reduce: block-scaled int8, fp8 (e4m3) or fp4 (e2m1) exchanges.

Every worker ``i`` holds ``x_i`` (float32[n]); all get the same ``y``, a two-stage
quantized estimate of ``(1/P) sum_i x_i``. With ``n_pad`` the smallest multiple of
``P block`` that is ``>= n``, the buffer splits into ``P`` chunks of ``c = n_pad / P``
elements, each ``c / block`` whole blocks. ``Q`` quantizes each block of ``block`` values
with its own float32 absmax scale (:mod:`shoal.kernels.quant_reference`)::

    s_b = max_{i in b} |v_i| / M     q_i = round(v_i / s_b)     D(q) = q s_b
    (M = 127 int8, 448 fp8 e4m3, 6 fp4 e2m1)

Per worker, with optional error feedback (``e = 0`` and no update when not given)::

    v   = pad(x) + e                  e <- v - D(Q(v))          (worker error, n_pad)
    phase 1: all-to-all the codes of each chunk with the scales of its blocks; worker r
             gets chunk r of everyone
    m   = (1/P) sum_j D(Q(v_j))[chunk r] + e_r                  (sum in source order j)
    e_r <- m - D(Q(m))                                          (server error, c)
    phase 2: all-gather the codes and scales of Q(m)
    y   = concat_r D(Q(m_r)), un-padded to n                    (identical on every worker)

Codes travel at 8 (int8, fp8) or 4 (fp4) bits per value; each block's scale travels as
its 4 float32 bytes appended to the chunk it belongs to, so a call is one all-to-all and
one all-gather of uint8 rows of ``c bits / 8 + 4 c / block`` bytes
(see :func:`quantized_allreduce_bytes`). Zero padding stays exactly zero: it is never
sent as anything but zero codes and never leaks into ``y`` or the errors.

References:
    A. Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
    Distributed Free Lunch", arXiv:2501.18512 (2025): 4-bit outer-gradient exchanges.
    P. Micikevicius et al., "FP8 Formats for Deep Learning", arXiv:2209.05433 (2022).
    Open Compute Project, "OCP Microscaling Formats (MX) Specification" v1.0 (2023).
    H. Tang et al., "1-bit Adam", ICML 2021, section 4: the two-phase compressed
    all-reduce with worker and server error feedback.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from shoal.checks import check_int
from shoal.comms.collective import Collective
from shoal.comms.compressor import Compressor, check_error, check_vector, two_phase_mean
from shoal.kernels.quant import dequantize, quantize
from shoal.kernels.quant_reference import BITS, check_block, check_format

__all__ = [
    "Quantized",
    "quantized_allreduce",
    "quantized_allreduce_bytes",
    "quantized_allreduce_init",
    "quantized_allreduce_padded_size",
]

DEFAULT_BLOCK = 128
_SCALE_BYTES = 4  # one float32 per block


@dataclasses.dataclass(frozen=True)
class Quantized(Compressor):
    """Block-scaled int8, fp8 (e4m3) or fp4 (e2m1) codes, exchanged in two phases.

    ``E`` quantizes each block of ``block`` values with its float32 absmax scale
    (:mod:`shoal.kernels.quant_reference`); a row of ``c`` values is ``c bits / 8 +
    4 c / block`` bytes: the codes, then the scales. The pattern is the two-phase
    all-reduce (`quantized_allreduce`).

    Args:
      fmt: ``"int8"``, ``"fp8"`` or ``"fp4"``.
      block: positive int, the values per scale (even for ``"fp4"``); default 128.
      error_feedback: keep the worker and server errors (default True).
      impl: quantization kernel, as for :func:`shoal.kernels.quantize` (None: Pallas on
        GPU, the jnp reference elsewhere).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective, Quantized
      >>> coll = AxisCollective("workers", 2)
      >>> codec = Quantized("fp4", block=2, error_feedback=False)
      >>> f = lambda x: codec.mean(x, collective=coll)[0]
      >>> x = jnp.array([[1.0, -2.0, 3.0, 0.5], [3.0, 2.0, -1.0, 0.5]])
      >>> print(jax.vmap(f, axis_name="workers")(x))
      [[2.  0.  1.  0.5]
       [2.  0.  1.  0.5]]
    """

    fmt: str = "fp4"
    block: int = DEFAULT_BLOCK
    impl: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "block", check_block(self.block, check_format(self.fmt)))

    def chunk_unit(self, size: int) -> int:
        return self.block

    def row_bytes(self, c: int) -> int:
        return c * BITS[self.fmt] // 8 + _SCALE_BYTES * (c // self.block)

    def encode(self, v: jax.Array) -> jax.Array:
        rows = v.shape[0]
        codes, scales = quantize(v.reshape(-1), self.fmt, self.block, impl=self.impl)
        raw = lax.bitcast_convert_type(scales.reshape(rows, -1), jnp.uint8)  # [r, blocks, 4]
        return jnp.concatenate([codes.reshape(rows, -1), raw.reshape(rows, -1)], axis=-1)

    def decode(self, rows: jax.Array, c: int) -> jax.Array:
        code_bytes = c * BITS[self.fmt] // 8
        raw = rows[:, code_bytes:].reshape(rows.shape[0], -1, _SCALE_BYTES)
        scales = lax.bitcast_convert_type(raw, jnp.float32)
        return dequantize(rows[:, :code_bytes], scales, self.fmt, self.block, impl=self.impl)


def quantized_allreduce_padded_size(n: int, size: int, block: int = DEFAULT_BLOCK) -> int:
    """The padded length ``n_pad`` of the buffers of `quantized_allreduce`.

    ``n_pad`` is the smallest multiple of ``size * block`` that is ``>= n``, so each of
    the ``size`` chunks holds whole blocks (and, with an even fp4 block, whole bytes).

    Args:
      n: positive int, the number of values reduced.
      size: the number of workers ``P``.
      block: positive int, the values per scale.

    Returns:
      ``n_pad``, a Python int.

    Example:
      >>> from shoal.comms.quantized import quantized_allreduce_padded_size
      >>> quantized_allreduce_padded_size(1000, size=4, block=128)  # a multiple of 512
      1024
    """
    block = check_int("block", block, 1)
    return Quantized("int8", block, error_feedback=False).padded_size(n, size)


def quantized_allreduce_init(
    n: int, size: int, fmt: str, block: int = DEFAULT_BLOCK
) -> tuple[jax.Array, jax.Array]:
    """The initial error-feedback buffers of `quantized_allreduce`: zeros.

    Args:
      n: positive int, the number of values reduced.
      size: the number of workers ``P``.
      fmt: ``"int8"``, ``"fp8"`` or ``"fp4"`` (checked; the shapes do not depend on it).
      block: positive int, the values per scale (even for ``"fp4"``).

    Returns:
      ``(worker_error, server_error)``: zero float32[n_pad] and float32[n_pad / size],
      with ``n_pad`` from `quantized_allreduce_padded_size`.

    Example:
      >>> from shoal.comms.quantized import quantized_allreduce_init
      >>> worker_error, server_error = quantized_allreduce_init(10, size=2, fmt="fp4", block=8)
      >>> worker_error.shape, server_error.shape
      ((16,), (8,))
    """
    return Quantized(fmt, block).init(n, size)


def quantized_allreduce_bytes(
    n: int, size: int, fmt: str, block: int = DEFAULT_BLOCK
) -> tuple[int, int]:
    """Bytes one call of `quantized_allreduce` sends and receives per worker (static).

    With ``P = size``, ``c = n_pad / P`` values per chunk, ``w`` bits per code (8 for
    int8 and fp8, 4 for fp4) and one 4-byte scale per block, a chunk is
    ``R = c w / 8 + 4 c / block`` bytes. Phase 1 is an all-to-all of the ``P R`` bytes
    of codes and scales, ``(P-1) R``; phase 2 an all-gather of one chunk, ``(P-1) R``::

        sent = received = 2 (P-1) (c w / 8 + 4 c / block)

    against ``2 (P-1) / P 4 n`` for a float32 ring all-reduce: about
    ``32 / (w + 32 / block)`` times fewer bytes when ``n_pad`` is close to ``n``.
    Counted by the rules of `shoal.comms.wire`. Error feedback moves nothing more.

    Args:
      n: positive int, the number of values reduced.
      size: the number of workers ``P``.
      fmt: ``"int8"``, ``"fp8"`` or ``"fp4"``.
      block: positive int, the values per scale (even for ``"fp4"``).

    Returns:
      ``(sent, received)``, Python ints.

    Example:
      >>> from shoal.comms.quantized import quantized_allreduce_bytes
      >>> quantized_allreduce_bytes(1024, size=4, fmt="fp4", block=128)  # c = 256: R = 136
      (816, 816)

    References:
      A. Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
      Distributed Free Lunch", arXiv:2501.18512 (2025).
    """
    return Quantized(fmt, block).wire_bytes(n, size)


def quantized_allreduce(
    x: jax.Array,
    *,
    collective: Collective,
    fmt: str,
    block: int = DEFAULT_BLOCK,
    worker_error: jax.Array | None = None,
    server_error: jax.Array | None = None,
):
    """Mean of ``x`` over the workers, exchanged as block-scaled int8, fp8 or fp4 codes.

    ``Q`` quantizes each block of ``block`` values with the float32 scale
    ``s = max|v| / M`` (``M`` = 127 int8, 448 fp8 e4m3, 6 fp4 e2m1; computed as
    ``max|v|`` times the float32 ``1 / M``) and codes ``q = round(v / s)`` (to nearest,
    ties to even, clipped to ``[-M, M]``; ``s = q = 0`` for an all-zero block);
    ``D(q) = q s``. With ``n_pad`` the smallest
    multiple of ``P block`` that is ``>= n``, worker ``r`` reduces chunk ``r`` of
    ``c = n_pad / P`` values::

        v   = pad(x) + e                 e   <- v - D(Q(v))      (if worker_error given)
        m   = (1/P) sum_j D(Q(v_j))[chunk r] + e_r                (sum in source order)
        e_r <- m - D(Q(m))                                        (if server_error given)
        y   = concat_r D(Q(m_r))[:n]

    one all-to-all (codes and scales of every chunk) and one all-gather (of ``Q(m_r)``).
    Without error feedback its term is 0 and no error is kept. With both errors from
    zeros, after ``T`` calls the outputs telescope to the true means::

        sum_t y_t = sum_t (1/P) sum_i x_i,t - (1/P) sum_i e_i(T) - e(T)

    so the running sum is off by no more than the final errors, each at most half a
    quantization step of its block.

    Args:
      x: float32[n], this worker's values.
      collective: the ``P`` workers (`shoal.comms.Collective`).
      fmt: ``"int8"``, ``"fp8"`` (e4m3fn) or ``"fp4"`` (e2m1, two codes per byte).
      block: positive int, the values per scale (even for ``"fp4"``); default 128.
      worker_error: ``None`` (no worker error feedback) or float32[n_pad], this worker's
        error (start at zero, see `quantized_allreduce_init`).
      server_error: ``None`` (no server error feedback) or float32[n_pad / P], the error
        of the chunk this worker reduces (its rank's chunk).

    Returns:
      ``y``, float32[n], the same on every worker, when neither error is given; else
      ``(y, worker_error, server_error)`` with the updated errors (``None`` for the one
      not given). Donate the errors under ``jax.jit`` to update them in place.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective
      >>> from shoal.comms.quantized import quantized_allreduce
      >>> coll = AxisCollective("workers", 2)
      >>> x = jnp.array([[1.0, -2.0, 3.0, 0.5], [3.0, 2.0, -1.0, 0.5]])  # mean 2, 0, 1, .5
      >>> f = lambda x: quantized_allreduce(x, collective=coll, fmt="fp4", block=2)
      >>> jax.vmap(f, axis_name="workers")(x)
      Array([[2. , 0. , 1. , 0.5],
             [2. , 0. , 1. , 0.5]], dtype=float32)

    References:
      A. Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
      Distributed Free Lunch", arXiv:2501.18512 (2025).
      P. Micikevicius et al., "FP8 Formats for Deep Learning", arXiv:2209.05433 (2022).
      Open Compute Project, "OCP Microscaling Formats (MX) Specification" v1.0 (2023).
      H. Tang et al., "1-bit Adam", ICML 2021, section 4.
    """
    codec = Quantized(fmt, block)
    x = check_vector(x)
    n, size = x.shape[0], collective.size
    n_pad = codec.padded_size(n, size)
    if worker_error is not None:
        worker_error = check_error("worker_error", worker_error, n_pad, n, size)
    if server_error is not None:
        server_error = check_error("server_error", server_error, n_pad // size, n, size)
    y, worker_error, server_error = two_phase_mean(
        codec, x, worker_error, server_error, collective=collective
    )
    if worker_error is None and server_error is None:
        return y
    return y, worker_error, server_error
