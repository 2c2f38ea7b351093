"""Rank-uniform state held once by simulated workers.

Some of a transformation's state is the same on every worker by construction: DiLoCo's
global model and outer optimizer state come from the all-reduced outer gradient alone. A
state class lists such fields in its class attribute ``RANK_UNIFORM``. Under
``jax.vmap`` every worker would hold its own copy of them; `uniform_axes` gives the
``in_axes``/``out_axes`` that pass them unbatched instead (``None``), one copy for all
workers, and `hold_uniform` takes that copy from a stacked state. The step computes the
same values either way (`shoal.comms.AxisCollective.all_reduce` returns an unbatched
result under vmap, so what follows from it stays unbatched), up to rounding: XLA
compiles the unbatched arithmetic into other fused kernels, and where it contracts a
multiply-add differently a value moves by an ulp, which later steps carry on (a few to
16 ulps of the params after 7 steps of DiLoCo with AdamW in the tests; bit for bit in
others). A field that would come out different per worker makes vmap refuse the
``None`` out-axis at trace time, never a silent mix. Under MPI and shard_map each
worker holds its own copy, as before.
"""

from __future__ import annotations

from typing import Any

import jax

from shoal.optim._declared import declared_fields

__all__ = ["hold_uniform", "uniform_axes"]


def uniform_axes(state: Any, axis: int = 0) -> Any:
    """The ``in_axes``/``out_axes`` of ``state`` under vmap that hold rank-uniform fields once.

    ``axis`` for every leaf of ``state``, ``None`` for those under a field its state class
    lists in ``RANK_UNIFORM`` (`shoal.optim.diloco`'s global model, outer state and
    counters): vmap then passes those unbatched, one copy for all simulated workers.

    Args:
      state: an optimizer state (stacked over workers or not: only its structure is read).
      axis: the workers' axis of the other leaves.

    Returns:
      a pytree of ``state``'s structure with ``axis`` or ``None`` at each leaf.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import diloco, update_and_apply
      >>> from shoal.optim.helpers import hold_uniform, uniform_axes
      >>> coll = AxisCollective("workers", 2)
      >>> tx = diloco(optax.sgd(0.5), collective=coll, sync_every=2, outer=optax.sgd(1.0))
      >>> params = jnp.zeros((2, 3))
      >>> state = hold_uniform(jax.vmap(tx.init, axis_name="workers")(params))
      >>> state.global_params.shape  # one copy for both workers
      (3,)
      >>> axes = uniform_axes(state)
      >>> step = lambda p, s, g: update_and_apply(tx, g, s, p)
      >>> step = jax.vmap(step, axis_name="workers", in_axes=(0, axes, 0), out_axes=(0, axes))
      >>> params, state = step(params, state, jnp.ones((2, 3)))
      >>> params, state = step(params, state, jnp.array([[1.0] * 3, [3.0] * 3]))
      >>> print(state.global_params)  # the mean of the workers' -1 and -2
      [-1.5 -1.5 -1.5]

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
      Models", arXiv:2311.08105, 2023 (the global model and outer state all workers
      share). DrJAX (github.com/google/drjax), whose unplaced values hold such state once.
    """

    return declared_fields(state, "RANK_UNIFORM", None, axis)


def hold_uniform(stacked: Any, axis: int = 0) -> Any:
    """``stacked`` with the leaves `uniform_axes` marks ``None`` as worker 0's one copy.

    Args:
      stacked: an optimizer state stacked over workers, e.g. ``jax.vmap(tx.init)`` of
        stacked params.
      axis: the workers' axis.

    Returns:
      the state as `uniform_axes` passes it to ``jax.vmap``.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import diloco
      >>> from shoal.optim.helpers import hold_uniform
      >>> tx = diloco(optax.sgd(0.1), collective=AxisCollective("workers", 4), sync_every=5,
      ...             outer=optax.sgd(0.7, momentum=0.9, nesterov=True))
      >>> stacked = jax.vmap(tx.init, axis_name="workers")(jnp.zeros((4, 1000)))
      >>> held = hold_uniform(stacked)
      >>> stacked.outer_state[0].trace.shape, held.outer_state[0].trace.shape
      ((4, 1000), (1000,))

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
      Models", arXiv:2311.08105, 2023 (the global model and outer state all workers
      share). DrJAX (github.com/google/drjax), whose unplaced values hold such state once.
    """
    axes = uniform_axes(stacked, axis)
    return jax.tree.map(
        # (None in ``stacked`` is an empty subtree, e.g. a fragment's outer state elsewhere.)
        lambda a, x: x if a is not None or x is None else jax.numpy.take(x, 0, axis=axis),
        axes,
        stacked,
        is_leaf=lambda a: a is None,
    )
