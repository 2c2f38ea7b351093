"""GTC pack/unpack: gradient threshold compression as fixed-capacity 32-bit words.

Strom's threshold compression (GTC; Ladkat et al., section 2.1) sends, for every element
whose magnitude exceeds a threshold ``tau``, only ``+tau`` or ``-tau``, packed with the
element's flat index into one 32-bit word, and keeps the rest as a residual:

.. math::

    q_i = \\begin{cases} \\operatorname{sign}(v_i)\\,\\tau & |v_i| > \\tau
          \\text{ and } i \\text{ is sent} \\\\ 0 & \\text{otherwise} \\end{cases}
    \\qquad r = v - q,
    \\qquad w_i = i \\;|\\; [v_i < 0] \\ll 31 .

Shapes are static, so at most ``capacity`` words are sent per call; when more elements
qualify, the first ``capacity`` of them in cyclic index order from ``offset`` are sent,
and the others stay in the residual for a later step (a rotating ``offset`` keeps any
index range from starving).

Each function dispatches to a Pallas (Triton) kernel on GPU and to a pure-jnp reference
elsewhere; both give bit-identical results. Both work under ``jax.jit`` and ``jax.vmap``
(simulated workers; the reference pack and unpack then run natively batched). The
reference decodes and unpacks over the fewest of ``capacity, capacity / 2, ...
capacity / 16`` slots that hold the largest count, so its cost follows what is sent.

References:
    N. Strom, "Scalable distributed DNN training using commodity GPU cloud computing",
    Interspeech 2015.
    P. Ladkat, O. Rybakov, R. Arava, S. H. K. Parthasarathi, I-F. Chen, N. Strom,
    "Two Tiered Distributed Training Algorithm for Acoustic Modeling", section 2.1.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from shoal.kernels import dispatch
from shoal.kernels.gtc_pallas import gtc_pack_pallas, gtc_unpack_pallas
from shoal.kernels.gtc_reference import (
    gtc_pack_parts_reference,
    gtc_pack_reference,
    gtc_unpack_reference,
)

__all__ = ["gtc_pack", "gtc_pack_parts", "gtc_unpack"]

_MAX_SIZE = 2**31 - 1  # indices live in bits 0-30 of a word


def _static_int(value, name: str, low: int, high: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a static Python int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a static Python int, got {type(value).__name__}") from None
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _scalar(x, name: str, integer: bool) -> jax.Array:
    """``x`` as an int32 (integer) or float32 scalar, after checking its type and rank."""
    dtype = jnp.result_type(x)
    real = jnp.issubdtype(dtype, jnp.integer) or (
        not integer and jnp.issubdtype(dtype, jnp.floating)
    )
    if not real or dtype == jnp.bool_:
        raise TypeError(
            f"{name} must be {'an integer' if integer else 'a real'} scalar, got dtype {dtype}"
        )
    if jnp.ndim(x) != 0:
        raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(x)}")
    return jnp.asarray(x, jnp.int32 if integer else jnp.float32)


def _pack_arguments(n: int, capacity, tau, offset) -> tuple[int, jax.Array, jax.Array]:
    """``capacity``, ``tau`` and ``offset`` of a pack of ``n`` values, checked (each error
    names its parameter); ``offset`` taken modulo ``n``."""
    capacity = _static_int(capacity, "capacity", 1, n)
    tau = _scalar(tau, "tau", integer=False)
    if _is_concrete(tau) and not float(tau) > 0:
        raise ValueError(f"tau must be positive, got {float(tau)}")
    offset = _scalar(offset, "offset", integer=True)
    if _is_concrete(offset) and not 0 <= int(offset) < n:
        raise ValueError(f"offset must be in [0, {n - 1}], got {int(offset)}")
    return capacity, tau, offset % n


def gtc_pack(
    values: jax.Array,
    tau: jax.Array | float,
    capacity: int,
    offset: jax.Array | int = 0,
    *,
    impl: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Threshold-compress ``values`` into at most ``capacity`` signed-index words.

    An element qualifies iff ``|v| > tau`` (strict: ``|v| == tau`` is kept; NaN never
    qualifies; +-Inf does). Walking the indices cyclically from ``offset``
    (``offset, ..., n-1, 0, ..., offset-1``), the first ``capacity`` qualifying elements
    are sent, all of them if fewer qualify.

    Args:
      values: float32[n], 1-D, ``n <= 2**31 - 1``. Donate it under ``jax.jit`` when it
        is dead afterwards: the residual then updates it in place (the usual case for
        an error-feedback buffer).
      tau: positive float32 scalar, may be traced. It should be a normal float32
        (``>= 2**-103``) so that no subnormal arises: XLA:CPU flushes subnormals to 0.
      capacity: static int in ``[1, n]``, the number of words.
      offset: int32 scalar in ``[0, n)``, may be traced (then it is taken modulo ``n``).
      impl: ``None`` (Pallas on GPU, jnp reference elsewhere), ``"reference"`` or
        ``"pallas"`` (interpreted when the backend is not a GPU).

    Returns:
      ``(words, count, remainder)``: ``words`` int32[capacity] holds the sent elements in
      increasing index order, ``word = index | (1 << 31 if v < 0)`` (negative words
      carry ``-tau``), then zeros; ``count`` int32 is the number sent; ``remainder``
      float32[n] is ``v - tau`` / ``v + tau`` at the sent positives / negatives and
      bit-identical to ``values`` (NaN and -0.0 included) everywhere else.

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.kernels import gtc_pack
      >>> values = jnp.array([0.5, -2.0, 0.1, 3.0, -0.2, -1.5])
      >>> words, count, remainder = gtc_pack(values, 1.0, capacity=4)
      >>> print(words & 0x7FFFFFFF, words < 0, count)  # indices 1, 3, 5; 1 and 5 negative
      [1 3 5 0] [ True False  True False] 3
      >>> print(remainder)
      [ 0.5 -1.   0.1  2.  -0.2 -0.5]

    References:
      N. Strom, "Scalable distributed DNN training using commodity GPU cloud
      computing", Interspeech 2015.
      P. Ladkat et al., "Two Tiered Distributed Training Algorithm for Acoustic
      Modeling", section 2.1.
    """
    use_pallas = dispatch.use_pallas(impl)
    values = dispatch.typed_array(values, jnp.float32, "values")
    if values.ndim != 1:
        raise ValueError(f"values must be 1-D, got shape {values.shape}")
    n = values.shape[0]
    if n > _MAX_SIZE:
        raise ValueError(f"values must have at most 2**31 - 1 elements, got {n}")
    capacity, tau, offset = _pack_arguments(n, capacity, tau, offset)
    return _pack(values, tau, offset, capacity=capacity, use_pallas=use_pallas)


@functools.partial(jax.jit, static_argnames=("capacity", "use_pallas"))
def _pack(values, tau, offset, *, capacity, use_pallas):
    if use_pallas:
        interpret = jax.default_backend() != "gpu"
        return gtc_pack_pallas(values, tau, capacity, offset, interpret=interpret)
    return _batchable_reference(capacity)(values, tau, offset)


@functools.cache
def _batchable_reference(capacity: int):
    """The reference pack with a vmap rule that batches it natively.

    Plain vmap would turn its decode branch into a select of both branches, and XLA:CPU
    then re-evaluates the decode per use (several times slower). The rule instead calls
    the reference on the stacked arrays; nested vmaps stack further leading dimensions.
    """
    return dispatch.batched(
        lambda values, tau, offset: gtc_pack_reference(values, tau, capacity, offset)
    )


def gtc_pack_parts(
    parts: Sequence[jax.Array],
    tau: jax.Array | float,
    capacity: int,
    offset: jax.Array | int = 0,
    *,
    residuals: Sequence[jax.Array] | None = None,
    impl: str | None = None,
) -> tuple[jax.Array, jax.Array, list[jax.Array]]:
    """:func:`gtc_pack` of the concatenation of the raveled ``parts``, without forming it.

    The words index the concatenation of ``jnp.ravel(part)`` in order and are exactly
    :func:`gtc_pack`'s; the remainder comes back as one array per part, in its shape.
    This is the form for an error-feedback buffer kept leaf by leaf: on the jnp reference
    no buffer of the whole model is written, and each part's remainder is one
    element-wise pass that updates a donated part in place. The Pallas kernel packs the
    concatenation.

    Args:
      parts: a non-empty sequence of float32 arrays of any shapes, ``n`` elements in all,
        ``1 <= n <= 2**31 - 1``.
      tau, capacity, offset, impl: as for :func:`gtc_pack`, over the ``n`` elements.
      residuals: optional float32 arrays shaped like ``parts``: then the values packed
        are ``parts[k] + residuals[k]``, added where they are read (error feedback,
        ``g + r``, without writing the sum out first).

    Returns:
      ``(words, count, remainders)``: ``words`` and ``count`` as :func:`gtc_pack`'s, and
      ``remainders`` a list of float32 arrays shaped like ``parts``.

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.kernels import gtc_pack_parts
      >>> parts = [jnp.array([0.5, -2.0, 0.1]), jnp.array([[3.0, -0.2, -1.5]])]
      >>> words, count, remainders = gtc_pack_parts(parts, 1.0, capacity=4)
      >>> print(words & 0x7FFFFFFF, count)  # indices into the concatenation
      [1 3 5 0] 3
      >>> print(remainders[1])
      [[ 2.  -0.2 -0.5]]

    References:
      N. Strom, "Scalable distributed DNN training using commodity GPU cloud
      computing", Interspeech 2015.
    """
    use_pallas = dispatch.use_pallas(impl)
    if isinstance(parts, jax.Array) or not isinstance(parts, (list, tuple)) or not parts:
        raise TypeError(f"parts must be a non-empty list of arrays, got {type(parts).__name__}")
    parts = [dispatch.typed_array(x, jnp.float32, f"parts[{i}]") for i, x in enumerate(parts)]
    if residuals is not None:
        if not isinstance(residuals, (list, tuple)) or len(residuals) != len(parts):
            raise TypeError(f"residuals must be a list of {len(parts)} arrays, like parts")
        residuals = [
            dispatch.typed_array(r, jnp.float32, f"residuals[{i}]") for i, r in enumerate(residuals)
        ]
        for i, (x, r) in enumerate(zip(parts, residuals)):
            if r.shape != x.shape:
                raise ValueError(
                    f"residuals[{i}] must have the shape of parts[{i}], {x.shape}, got {r.shape}"
                )
    n = sum(x.size for x in parts)
    if not 1 <= n <= _MAX_SIZE:
        raise ValueError(f"parts must hold between 1 and 2**31 - 1 elements in all, got {n}")
    capacity, tau, offset = _pack_arguments(n, capacity, tau, offset)
    residuals = None if residuals is None else tuple(residuals)
    return _pack_parts(
        tuple(parts), residuals, tau, offset, capacity=capacity, use_pallas=use_pallas
    )


@functools.partial(jax.jit, static_argnames=("capacity", "use_pallas"))
def _pack_parts(parts, residuals, tau, offset, *, capacity, use_pallas):
    if use_pallas:
        if residuals is not None:
            parts = tuple(x + r for x, r in zip(parts, residuals))
        flat = jnp.concatenate([jnp.ravel(x) for x in parts])
        words, count, remainder = _pack(flat, tau, offset, capacity=capacity, use_pallas=True)
        bounds = [0]
        for x in parts:
            bounds.append(bounds[-1] + x.size)
        pieces = [remainder[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
        return words, count, [p.reshape(x.shape) for p, x in zip(pieces, parts)]
    shapes = tuple(x.shape for x in parts)
    pack = _batchable_parts_reference(capacity, shapes)
    words, count, remainders = pack(parts, residuals, tau, offset)
    return words, count, list(remainders)


@functools.cache
def _batchable_parts_reference(capacity: int, shapes: tuple):
    """`gtc_pack_parts_reference`, batched natively like `_batchable_reference`;
    ``shapes``: the parts' own shapes, in front of which vmap stacks its dimensions."""

    def pack(parts, residuals, tau, offset):
        words, count, remainders = gtc_pack_parts_reference(
            list(parts), tau, capacity, offset, shapes, residuals
        )
        return words, count, tuple(remainders)

    return dispatch.batched(pack)


def gtc_unpack(
    words: jax.Array,
    count: jax.Array | int,
    tau: jax.Array | float,
    size: int,
    *,
    impl: str | None = None,
) -> jax.Array:
    """Decode GTC words into a dense float32[size]: the sum of their +-tau.

    ``words`` int32[..., capacity] and ``count`` int32[...] share their leading
    dimensions (the plain case is one buffer: ``words[capacity]`` and a scalar
    ``count``); slots ``>= count`` are ignored, and all buffers are summed, so P
    workers' all-gathered buffers ``[P, capacity]`` decode in one call. Per element the
    result is ``tau * (#plus - #minus)``, computed from exact integer counts, so it
    does not depend on the order of the buffers. Words with an index ``>= size`` are
    ignored.

    Args:
      words: int32[..., capacity] as produced by :func:`gtc_pack`.
      count: int32[...], the number of valid words of each buffer.
      tau: float32 scalar, may be traced.
      size: static int in ``[1, 2**31 - 1]``, the length of the dense output.
      impl: as for :func:`gtc_pack`.

    Returns:
      float32[size], ``tau * (#plus - #minus)`` per element over all buffers.

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.kernels import gtc_unpack
      >>> minus = -(2**31)  # the sign bit: the word carries -tau
      >>> words = jnp.array([[1 | minus, 3, 0], [3, 4 | minus, 0]], jnp.int32)
      >>> count = jnp.array([2, 2], jnp.int32)  # two buffers, e.g. two workers
      >>> print(gtc_unpack(words, count, 0.5, size=6))
      [ 0.  -0.5  0.   1.  -0.5  0. ]

    References:
      N. Strom, "Scalable distributed DNN training using commodity GPU cloud
      computing", Interspeech 2015.
    """
    use_pallas = dispatch.use_pallas(impl)
    words = dispatch.typed_array(words, jnp.int32, "words")
    count = jnp.asarray(count)
    if words.ndim < 1 or words.shape[-1] < 1:
        raise ValueError(f"words must have shape [..., capacity >= 1], got {words.shape}")
    if not jnp.issubdtype(count.dtype, jnp.integer):
        raise TypeError(f"count must be an integer array, got dtype {count.dtype}")
    if count.shape != words.shape[:-1]:
        raise ValueError(
            f"count must have shape {words.shape[:-1]} (the leading dimensions of words), "
            f"got {count.shape}"
        )
    size = _static_int(size, "size", 1, _MAX_SIZE)
    tau = _scalar(tau, "tau", integer=False)
    return _unpack(words, count.astype(jnp.int32), tau, size=size, use_pallas=use_pallas)


@functools.partial(jax.jit, static_argnames=("size", "use_pallas"))
def _unpack(words, count, tau, *, size, use_pallas):
    if use_pallas:
        interpret = jax.default_backend() != "gpu"
        return gtc_unpack_pallas(words, count, tau, size, interpret=interpret)
    return _batchable_unpack(size, 0)(words, count, tau)


@functools.cache
def _batchable_unpack(size: int, batch_dims: int):
    """The reference unpack with a vmap rule that batches it natively, for the reason of
    `_batchable_reference` (its branch is on every buffer's count); ``batch_dims``:
    the leading dimensions stacked by vmap, decoded each on its own, not summed."""
    return dispatch.batched(
        lambda words, count, tau: gtc_unpack_reference(words, count, tau, size, batch_dims),
        stacked=lambda: _batchable_unpack(size, batch_dims + 1),
    )
