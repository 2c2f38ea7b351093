"""State fields that a state class declares by name, read through any nesting: which
leaves are rank-uniform (``RANK_UNIFORM``, `shoal.optim._uniform`) and which are error
feedback (``ERROR_FEEDBACK``: gradient mass a worker owes the others, which an elastic
restart must redistribute and never drop or copy, `error_feedback_mask`)."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["declared_fields", "error_feedback_mask", "rank_uniform_mask"]


def declared_fields(state: Any, attribute: str, inside: Any, outside: Any) -> Any:
    """A pytree of ``state``'s structure: ``inside`` at every leaf under a field that its
    state class lists in the class attribute ``attribute`` (``"RANK_UNIFORM"``,
    ``"ERROR_FEEDBACK"``), ``outside`` at the others. State classes nest (a wrapper's
    state holds the wrapped one's): every level is read."""

    def declares(node: Any) -> bool:
        return (
            isinstance(node, tuple)
            and hasattr(type(node), "_fields")
            and hasattr(type(node), attribute)
        )

    def walk(node):
        if declares(node):
            marked = set(getattr(type(node), attribute))
            return type(node)(
                *(
                    jax.tree.map(lambda _: inside, value) if name in marked else walk(value)
                    for name, value in zip(node._fields, node)
                )
            )
        children, treedef = jax.tree.flatten(node, is_leaf=lambda x: x is not node and declares(x))
        if treedef.num_leaves == 1 and children and children[0] is node:
            return outside  # a leaf
        return jax.tree.unflatten(treedef, [walk(c) for c in children])

    return walk(state)


def error_feedback_mask(state: Any) -> Any:
    """Which leaves of ``state`` are error-feedback memory: gradient mass owed to others.

    True at the leaves under a field their state class lists in ``ERROR_FEEDBACK``
    (GTC's residual, top-k's and PowerSGD's error, the DiLoCo family's exchange memory,
    1-bit Adam's worker and server errors, DeMo's momentum, which keeps what was not
    sent), False elsewhere. An elastic restart redistributes these, never drops or copies
    them (`shoal.experiments.runner.elastic`).

    Args:
      state: an optimizer state (stacked over workers or not: only its structure is read).

    Returns:
      a pytree of bools.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import gtc
      >>> from shoal.optim.helpers import error_feedback_mask
      >>> tx = gtc(threshold=0.1, collective=AxisCollective("workers", 1))
      >>> mask = error_feedback_mask(jax.vmap(tx.init, axis_name="workers")(jnp.zeros((1, 3))))
      >>> mask.residual, mask.offset
      (True, False)

    References:
      Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
      Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014 (error
      feedback); Strom, Interspeech 2015 (GTC's residuals).
    """
    return declared_fields(state, "ERROR_FEEDBACK", True, False)


def rank_uniform_mask(state: Any) -> Any:
    """Which leaves of ``state`` are rank-uniform: the same on every worker.

    True at the leaves under a field their state class lists in ``RANK_UNIFORM``
    (DiLoCo's global model, outer state and counters; BMUF's global model and block
    momentum), False elsewhere: what simulated workers hold once
    (`shoal.optim.helpers.uniform_axes`), and what a worker that was away under churn
    takes as it is (`shoal.experiments.churn`).

    Args:
      state: an optimizer state (stacked over workers or not: only its structure is read).

    Returns:
      a pytree of bools.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import diloco
      >>> from shoal.optim.helpers import rank_uniform_mask
      >>> coll = AxisCollective("workers", 2)
      >>> inner = optax.sgd(0.1, momentum=0.9)  # its momentum is this worker's own
      >>> tx = diloco(inner, collective=coll, sync_every=2, outer=optax.sgd(1.0))
      >>> mask = rank_uniform_mask(tx.init(jnp.zeros(3)))
      >>> mask.global_params, mask.step, jax.tree.leaves(mask.inner_state)
      (True, True, [False])

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
      Models", arXiv:2311.08105, 2023 (the global model every worker shares).
    """
    return declared_fields(state, "RANK_UNIFORM", True, False)
