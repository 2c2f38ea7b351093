"""1-bit Adam (`onebit_adam`): Adam's update rules in the two stages of
`shoal.optim._onebit`, whose compression stage sends the momentum as signs.

References:
    H. Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
    Convergence Speed", ICML 2021, Algorithm 1.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax

from shoal.comms.collective import Collective
from shoal.optim._onebit import OneBitAdamState, hyper, two_stage

__all__ = ["onebit_adam"]


def onebit_adam(
    learning_rate: optax.ScalarOrSchedule,
    *,
    collective: Collective,
    freeze_step: int,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum_mask: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """1-bit Adam (Tang et al. 2021, Algorithm 1), without bias correction.

    Inputs are each worker's local gradients; outputs are the updates (the same on every
    worker), to be applied with ``optax.apply_updates``. Per leaf, with ``t`` from 1::

        warm-up (t <= freeze_step), g = mean_i g_i (all-reduce):
            m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        compression (t > freeze_step), local g_i:
            m = OneBit().mean(b1 m + (1 - b1) g_i)   (all leaves fused)
            m = m * momentum_mask                    (if given)
        update = -lr (m / (sqrt(v) + eps) + weight_decay p)

    Args:
      learning_rate: a float or an optax schedule (called with the 0-based step count).
      collective: the workers (`shoal.comms.Collective`).
      freeze_step: warm-up steps (``>= 1``); ``v`` is frozen after step ``freeze_step``.
      b1, b2: moment decays in ``[0, 1)``.
      eps: ``> 0``, added to ``sqrt(v)``.
      weight_decay: ``>= 0``, decoupled (added to the update as in AdamW).
      momentum_mask: optional params-shaped tree of 0/1 arrays (broadcastable to the
        leaves) marking elements whose gradients are structurally zero; their momentum is
        zeroed after each decompression, so compression noise cannot move them. Without
        it such an element diverges: its frozen ``v`` is 0 and the decompressed momentum
        is ``+-scale``, never 0, so its update is ``scale / eps``.

    Returns:
      an ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` returns
      a `OneBitAdamState` and whose ``update(updates, state, params=None)``
      returns ``(updates, new_state)``; the updates are ``-lr`` times the Adam
      direction, identical on every worker.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from shoal.comms import AxisCollective
      >>> coll = AxisCollective("workers", 2)
      >>> from shoal.optim import onebit_adam
      >>> tx = onebit_adam(0.1, collective=coll, freeze_step=1)
      >>> def train(params, g):
      ...     state = tx.init(params)
      ...     for _ in range(3):  # one warm-up step, then two compressed ones
      ...         updates, state = tx.update(g, state, params)
      ...         params = optax.apply_updates(params, updates)
      ...     return params
      >>> grads = jnp.array([[1.0, 2.0], [3.0, 2.0]])  # one row per worker
      >>> out = jax.vmap(train, axis_name="workers")(jnp.zeros((2, 2)), grads)
      >>> print(out.round(3))
      [[-0.91 -0.91]
       [-0.91 -0.91]]

    References:
      Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with
      Adam's Convergence Speed", ICML 2021, Algorithm 1.
    """
    h = hyper(learning_rate, collective, freeze_step, b1, b2, eps, weight_decay, momentum_mask)
    rate = lambda step: [jnp.asarray(-step.lr, jnp.float32)] * len(step.grads)  # both stages
    return two_stage(
        "onebit_adam",
        OneBitAdamState,
        h,
        init=lambda params, zeros: {},
        warmup=lambda state, step: (state, rate(step)),
        scales=lambda state, step: (state, None),
        compressed=lambda state, mu_last, step: (state, rate(step)),
    )
