"""Dtype promotion made explicit, so that shoal runs under
``jax.config.update("jax_numpy_dtype_promotion", "strict")`` as under JAX's default.

Strict promotion refuses an implicit mix of dtypes (``bfloat16 + float32``, a Python
float times an int32 counter) and even refuses to *name* the promoted type
(``jnp.promote_types(bfloat16, float32)`` raises). shoal decides its accumulation and
buffer dtypes with JAX's standard lattice, then casts every operand explicitly:
`promote_types` gives that lattice's answer whatever the session's promotion mode is,
and `apply_updates` is ``optax.apply_updates`` with its cast written out. Under the
default ("standard") mode both give exactly what the implicit promotion gave.

Third-party code that is not strict-clean (optax 0.2.8's Adam family) runs under strict
promotion through `standard_promotion`, which relaxes that transformation only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["apply_updates", "promote_types", "standard_promotion"]


def promote_types(*dtypes: Any) -> np.dtype:
    """The dtype JAX's standard promotion gives ``dtypes``, in any promotion mode.

    For deciding a dtype to cast to explicitly (an accumulator, a fusion buffer), never
    for computing with mixed dtypes.

    Args:
      *dtypes: dtypes, or arrays (whose weak types count, as in ``jnp.result_type``); at
        least one.

    Returns:
      the promoted ``numpy.dtype``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> with jax.numpy_dtype_promotion("strict"):
      ...     print(promote_types(jnp.bfloat16, jnp.float16), promote_types(jnp.int8, jnp.float16))
      float32 float16
    """
    with jax.numpy_dtype_promotion("standard"):
        return np.dtype(jnp.result_type(*dtypes))


def apply_updates(params: Any, updates: Any) -> Any:
    """``optax.apply_updates`` with its promotion explicit: ``p + u`` in the promoted dtype
    of the two, cast back to ``p``'s dtype (a ``None`` leaf of ``params`` stays ``None``).

    Args:
      params: a tree of parameters.
      updates: a tree of updates of the same structure and shapes.

    Returns:
      the updated parameters, each leaf in its parameter's dtype: bit for bit what
      ``optax.apply_updates`` gives under standard promotion.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> p, u = jnp.ones(2, jnp.bfloat16), jnp.array([0.5, 1e-3], jnp.float32)
      >>> with jax.numpy_dtype_promotion("strict"):
      ...     print(apply_updates(p, u))
      [1.5 1]
    """

    def one(p, u):
        if p is None:
            return None
        p, u = jnp.asarray(p), jnp.asarray(u)
        wide = promote_types(p, u)  # a weak-typed update takes p's dtype, as in p + u
        return (p.astype(wide) + u.astype(wide)).astype(p.dtype)

    return jax.tree.map(one, params, updates, is_leaf=lambda x: x is None)


def standard_promotion(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``tx`` with its ``init`` and ``update`` traced under JAX's standard dtype promotion,
    whatever the session's mode: for a third-party transformation that is not
    strict-clean, such as optax 0.2.8's Adam family (its bias correction raises a Python
    float to an int32 count). Only ``tx`` runs relaxed; the code around it stays strict.
    Results are those of ``tx`` itself, bit for bit.

    Args:
      tx: an optax transformation.

    Returns:
      an ``optax.GradientTransformationExtraArgs`` with ``tx``'s state.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> tx = standard_promotion(optax.adam(0.1))
      >>> with jax.numpy_dtype_promotion("strict"):
      ...     updates, _ = tx.update(jnp.ones(2), tx.init(jnp.zeros(2)))
      >>> print(updates.dtype, bool(jnp.allclose(updates, -0.1, atol=1e-5)))
      float32 True
    """
    tx = optax.with_extra_args_support(tx)

    def init(params):
        with jax.numpy_dtype_promotion("standard"):
            return tx.init(params)

    def update(updates, state, params=None, **extra_args):
        with jax.numpy_dtype_promotion("standard"):
            return tx.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init, update)
