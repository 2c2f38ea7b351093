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
(see `Quantized`). Zero padding stays exactly zero: it is never
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

from shoal.comms.codecs.base import Compressor
from shoal.kernels.quant import dequantize, quantize
from shoal.kernels.quant_reference import BITS, check_block, check_format

__all__ = ["Quantized"]

DEFAULT_BLOCK = 128
_SCALE_BYTES = 4  # one float32 per block


@dataclasses.dataclass(frozen=True)
class Quantized(Compressor):
    """Block-scaled int8, fp8 (e4m3) or fp4 (e2m1) codes, exchanged in two phases.

    ``Q`` quantizes each block of ``block`` values with the float32 scale
    ``s = max|v| / M`` (``M`` = 127 int8, 448 fp8 e4m3, 6 fp4 e2m1; computed as
    ``max|v|`` times the float32 ``1 / M``) and codes ``q = round(v / s)`` (to nearest,
    ties to even, clipped to ``[-M, M]``; ``s = q = 0`` for an all-zero block);
    ``D(q) = q s`` (:mod:`shoal.kernels.quant_reference`). A row of ``c`` values is
    ``c bits / 8 + 4 c / block`` bytes: the codes, then the scales.

    The pattern is the two-phase all-reduce (`mean`). With ``n_pad`` (`padded_size`) the
    smallest multiple of ``P block`` that is ``>= n`` (each of the ``P`` chunks whole
    blocks and, with an even fp4 block, whole bytes), worker ``r`` reduces chunk ``r`` of
    ``c = n_pad / P`` values::

        v   = pad(x) + e                 e   <- v - D(Q(v))      (worker error)
        m   = (1/P) sum_j D(Q(v_j))[chunk r] + e_r                (sum in source order)
        e_r <- m - D(Q(m))                                        (server error)
        y   = concat_r D(Q(m_r))[:n]

    one all-to-all (codes and scales of every chunk) and one all-gather (of ``Q(m_r)``).
    The errors ``(worker_error float32[n_pad], server_error float32[n_pad / P])`` are
    the ``memory`` of `mean`, zero from `init`; with ``error_feedback=False`` their terms
    are 0 and no error is kept. With both errors from zeros, after ``T`` calls the
    outputs telescope to the true means::

        sum_t y_t = sum_t (1/P) sum_i x_i,t - (1/P) sum_i e_i(T) - e(T)

    so the running sum is off by no more than the final errors, each at most half a
    quantization step of its block.

    Bytes per call and worker (`wire_bytes`), with ``w`` bits per code (8 for int8 and
    fp8, 4 for fp4) and a chunk of ``R = c w / 8 + 4 c / block`` bytes: phase 1 is an
    all-to-all of the ``P R`` bytes of codes and scales, ``(P-1) R``; phase 2 an
    all-gather of one chunk, ``(P-1) R``::

        sent = received = 2 (P-1) (c w / 8 + 4 c / block)

    against ``2 (P-1) / P 4 n`` for a float32 ring all-reduce: about
    ``32 / (w + 32 / block)`` times fewer bytes when ``n_pad`` is close to ``n``.
    Counted by the rules of `shoal.comms.wire`. Error feedback moves nothing more.

    Args:
      fmt: ``"int8"``, ``"fp8"`` (e4m3fn) or ``"fp4"`` (e2m1, two codes per byte).
      block: positive int, the values per scale (even for ``"fp4"``); default 128.
      error_feedback: keep the worker and server errors (default True).
      impl: quantization kernel, as for :func:`shoal.kernels.quantize` (None: Pallas on
        GPU, the jnp reference elsewhere).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective, Quantized
      >>> Quantized("int8", block=128).padded_size(1000, size=4)  # a multiple of 512
      1024
      >>> [e.shape for e in Quantized("fp4", block=8).init(10, size=2)]
      [(16,), (8,)]
      >>> Quantized("fp4", block=128).wire_bytes(1024, size=4)  # c = 256: R = 136
      (816, 816)
      >>> coll = AxisCollective("workers", 2)
      >>> codec = Quantized("fp4", block=2, error_feedback=False)
      >>> f = lambda x: codec.mean(x, collective=coll)[0]
      >>> x = jnp.array([[1.0, -2.0, 3.0, 0.5], [3.0, 2.0, -1.0, 0.5]])  # mean 2, 0, 1, .5
      >>> print(jax.vmap(f, axis_name="workers")(x))
      [[2.  0.  1.  0.5]
       [2.  0.  1.  0.5]]

    References:
      A. Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
      Distributed Free Lunch", arXiv:2501.18512 (2025).
      P. Micikevicius et al., "FP8 Formats for Deep Learning", arXiv:2209.05433 (2022).
      Open Compute Project, "OCP Microscaling Formats (MX) Specification" v1.0 (2023).
      H. Tang et al., "1-bit Adam", ICML 2021, section 4.
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
