"""Transformations that can apply their own update: `update_and_apply`.

An optax step writes the update ``u`` out and ``optax.apply_updates`` reads it back. A
transformation whose state is updated in a branch (`shoal.optim._inplace.run_if`) must
write ``u`` out before the branch even when the branch does not run, since the branch
may replace it. Given the parameters instead, it can carry them through the branch, so
that on the steps the branch skips ``params + u`` is one pass and ``u`` is never stored:
the local steps of `shoal.optim.bmuf`, `shoal.optim.bmuf_gtc` and `shoal.optim.diloco`
(whose block step restarts the parameters from the global model), and
`shoal.optim.skip_nonfinite` with ``in_place="apply"`` (the skip around the update and its
application together).

Such a transformation is an `ApplyingTransformation`: an optax transformation with an
``apply_step(updates, state, params, **extra_args) -> (new_params, new_state)`` that gives
what ``optax.apply_updates(params, u)`` would give, but for rounding (``p + (w - p)``
against ``w``). `update_and_apply` takes it where there is one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from shoal.dtypes import apply_updates
from shoal.optim._validation import checked

__all__ = ["ApplyingTransformation", "applying_transformation", "update_and_apply"]


class ApplyingTransformation(optax.GradientTransformationExtraArgs):
    """An optax transformation whose ``apply_step`` (None: it has none) takes a step and
    applies it (module docstring); `update_and_apply` calls it."""

    apply_step: Callable | None = None  # set on the instance (`applying_transformation`)


def applying_transformation(
    name: str,
    state_type: type,
    init_fn: Callable,
    step_fn: Callable,
    reference: Callable | None = None,
) -> ApplyingTransformation:
    """The `ApplyingTransformation` of one step function, both ways checked (`checked`).

    Args:
      name: the transformation's name, for errors.
      state_type: its state's type.
      init_fn: ``init(params) -> state``.
      step_fn: ``step_fn(updates, state, params, apply, **extra_args)``: the update
        (``apply=False``) or the new params (``apply=True``), and the new state.
      reference: ``reference(state)``, the state's params-shaped tree (as `checked`).

    Returns:
      the transformation: ``update`` takes ``apply=False``, ``apply_step`` ``apply=True``.
    """

    def update_fn(updates, state, params=None, **extra_args):
        return step_fn(updates, state, params, False, **extra_args)

    def apply_step(updates, state, params, **extra_args):
        return step_fn(updates, state, params, True, **extra_args)

    out = ApplyingTransformation(init_fn, checked(name, state_type, update_fn, reference))
    out.apply_step = checked(name, state_type, apply_step)
    return out


def update_and_apply(
    tx: optax.GradientTransformation, updates: Any, state: Any, params: Any, **extra_args
) -> tuple[Any, Any]:
    """One training step of ``tx``, the update applied to the parameters.

    ``(params + u, new_state)`` with ``u, new_state = tx.update(updates, state, params)``.
    An `ApplyingTransformation` with an ``apply_step`` (`shoal.optim.bmuf`,
    `shoal.optim.bmuf_gtc`, `shoal.optim.diloco`, and `shoal.optim.skip_nonfinite` with
    ``in_place="apply"`` around any transformation) updates the parameters in the same
    in-place branches as its state, and ``u`` is never written out (module docstring).
    Any other transformation runs as ``optax.apply_updates`` would run it. Results are the
    same either way, up to rounding.

    Args:
      tx: an optax transformation.
      updates: the gradient; state: ``tx``'s state; params: the parameters.
      **extra_args: passed on to ``tx.update``.

    Returns:
      ``(new_params, new_state)``.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import skip_nonfinite, update_and_apply
      >>> coll = AxisCollective("workers", 2)
      >>> tx = skip_nonfinite(optax.sgd(0.5), collective=coll, in_place="apply")
      >>> step = lambda p, g: update_and_apply(tx, g, tx.init(p), p)[0]
      >>> params = jnp.ones((2, 2))
      >>> print(jax.vmap(step, axis_name="workers")(params, jnp.full((2, 2), 2.0)))
      [[0. 0.]
       [0. 0.]]
      >>> bad = jnp.array([[2.0, 2.0], [jnp.nan, 2.0]])  # worker 1's gradient holds a NaN
      >>> print(jax.vmap(step, axis_name="workers")(params, bad))
      [[1. 1.]
       [1. 1.]]

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018 (skipping a step
      on an overflow).
    """
    step = getattr(tx, "apply_step", None)
    if step is not None:
        return step(updates, state, params, **extra_args)
    new_updates, state = tx.update(updates, state, params, **extra_args)
    return apply_updates(params, new_updates), state
