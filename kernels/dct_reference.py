"""Pure-jnp chunked 2-D DCT-II (orthonormal) and its inverse, for `shoal.optim.demo`.

A matrix ``x`` of shape ``[R, C]`` is cut into ``[h, w]`` chunks (``h`` divides ``R``,
``w`` divides ``C``); chunk ``(p, q)`` is ``x[p h : (p + 1) h, q w : (q + 1) w]``. Each
chunk ``X`` is transformed separably with the orthonormal DCT-II matrices ``D_h``,
``D_w``::

    D_n[k, j] = s_k cos(pi (2 j + 1) k / (2 n)),   s_0 = sqrt(1/n), s_k = sqrt(2/n) (k > 0)
    coefficients  Y = D_h X D_w^T,      inverse  X = D_h^T Y D_w

(``D_n`` is orthogonal, so the inverse is the transpose: the DCT-III). The coefficients
come out as ``[(R/h) (C/w), h w]``: one row per chunk, chunks in row-major order of
``(p, q)``, and in a row coefficient ``(b, d)`` (frequency ``b`` along the rows, ``d``
along the columns) at ``b w + d``. A vector is the ``[1, n]`` matrix with ``h = 1``.

The transform is a pair of small matmuls per chunk, which XLA runs well everywhere; a
Pallas kernel would gain little over them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shoal.checks import check_int


@functools.cache
def dct_matrix(n: int) -> np.ndarray:
    """The orthonormal DCT-II matrix of size ``n`` in float64 (rows are frequencies).

    Args:
      n: the transform length, an int >= 1.

    Returns:
      a float64 ``[n, n]`` NumPy array ``D`` with ``D[k, j] = s_k cos(pi (2 j + 1) k /
      (2 n))``, ``s_0 = sqrt(1/n)`` and ``s_k = sqrt(2/n)``; ``D @ D.T`` is the identity.
      An entry whose cosine is 0 is exactly 0, and entries of equal magnitude are equal.

    Example:
      >>> from shoal.kernels.dct_reference import dct_matrix
      >>> print((dct_matrix(4) @ [1.0, 1.0, 1.0, 1.0]).round(6) + 0.0)  # only DC
      [2. 0. 0. 0.]
    """
    n = check_int("n", n, 1)
    # The angle is pi a / (2 n) with the integer a = (2 j + 1) k. Folding a into [0, n]
    # by cos's period and symmetries, exactly in integers, makes the entries equal in
    # magnitude bitwise equal and the zeros (a = n: the middle element of an odd n at odd
    # frequencies) exactly 0. np.cos(pi / 2) is 6e-17, whose sign DeMo would act on.
    a = (2 * np.arange(n)[None, :] + 1) * np.arange(n)[:, None] % (4 * n)
    a = np.where(a > 2 * n, 4 * n - a, a)  # cos(2 pi - x) = cos(x)
    sign = np.where(a > n, -1.0, 1.0)
    a = np.where(a > n, 2 * n - a, a)  # cos(pi - x) = -cos(x)
    d = np.where(a == n, 0.0, sign * np.cos(np.pi * a / (2 * n))) * np.sqrt(2.0 / n)
    d[0] *= np.sqrt(0.5)
    d.flags.writeable = False  # cached: shared by every caller
    return d


def _basis(n: int, dtype) -> jax.Array:
    return jnp.asarray(dct_matrix(n), dtype)


def chunk_dct(x: jax.Array, h: int, w: int) -> jax.Array:
    """Orthonormal 2-D DCT-II of every ``[h, w]`` chunk of the matrix ``x``.

    Args:
      x: a floating ``[R, C]`` array with ``R % h == 0`` and ``C % w == 0``.
      h: chunk rows.
      w: chunk columns.

    Returns:
      the coefficients, ``[(R/h) (C/w), h w]`` in ``x``'s dtype: row ``p (C/w) + q`` is
      chunk ``(p, q)``, coefficient ``(b, d)`` of a chunk at column ``b w + d``.

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.kernels.dct_reference import chunk_dct
      >>> print(chunk_dct(jnp.ones((2, 4)), 2, 2).round(4) + 0.0)  # DC only
      [[2. 0. 0. 0.]
       [2. 0. 0. 0.]]
    """
    rows, cols = x.shape
    _check_chunks(rows, cols, h, w)
    blocks = x.reshape(rows // h, h, cols // w, w)
    y = jnp.einsum(
        "pjql,bj,dl->pqbd",
        blocks,
        _basis(h, x.dtype),
        _basis(w, x.dtype),
        precision=lax.Precision.HIGHEST,
    )
    return y.reshape((rows // h) * (cols // w), h * w)


def chunk_idct(y: jax.Array, rows: int, cols: int, h: int, w: int) -> jax.Array:
    """The inverse of `chunk_dct`: the ``[rows, cols]`` matrix whose chunk coefficients are ``y``.

    Args:
      y: ``[(rows/h) (cols/w), h w]`` coefficients in `chunk_dct`'s layout.
      rows: rows of the matrix.
      cols: columns of the matrix.
      h: chunk rows.
      w: chunk columns.

    Returns:
      the ``[rows, cols]`` matrix in ``y``'s dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.kernels.dct_reference import chunk_dct, chunk_idct
      >>> x = jnp.arange(8.0).reshape(2, 4)
      >>> print(chunk_idct(chunk_dct(x, 2, 2), 2, 4, 2, 2).round(4) + 0.0)
      [[0. 1. 2. 3.]
       [4. 5. 6. 7.]]
    """
    _check_chunks(rows, cols, h, w)
    blocks = y.reshape(rows // h, cols // w, h, w)
    x = jnp.einsum(
        "pqbd,bj,dl->pjql",
        blocks,
        _basis(h, y.dtype),
        _basis(w, y.dtype),
        precision=lax.Precision.HIGHEST,
    )
    return x.reshape(rows, cols)


def _check_chunks(rows: int, cols: int, h: int, w: int) -> None:
    if h < 1 or w < 1 or rows % h or cols % w:
        raise ValueError(f"chunks [{h}, {w}] do not tile a [{rows}, {cols}] matrix")
