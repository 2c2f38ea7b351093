"""Synchronous model averaging (SMA) as an Optax wrapper: every step each worker's model
moves a fraction ``alpha`` towards the average model, then takes its local step::

    v_r <- (1 - alpha) v_r + alpha * (1/N) sum_i v_i + u_r

where ``u_r`` is the update of the inner optimizer computed on ``v_r`` before averaging.

References:
  Brabete, "Kungfu: A Novel Distributed Training System for TensorFlow using Flexible
  Synchronisation", MEng thesis, Imperial College London, 2019, section 2.6.2.
  Koliousis et al., "Crossbow: Scaling Deep Learning with Small Batch Sizes on Multi-GPU
  Servers", VLDB 2019. Zhang, Choromanska & LeCun, "Deep learning with Elastic Averaging
  SGD", NeurIPS 2015.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from shoal.comms.agreement import check_same_structure
from shoal.comms.collective import Collective
from shoal.comms.wire import WireCount, WireMeter, all_reduce_bytes, tree_nbytes
from shoal.optim._validation import (
    check_collective,
    check_floating_leaves,
    check_hyper,
    checked,
    require_params,
)


class SMAState(NamedTuple):
    """State of `sma`.

    Attributes:
      inner_state: state of the local optimizer.
      wire: bytes sent and received by the most recent update and since init.
    """

    inner_state: Any
    wire: WireMeter


def sma(
    inner: optax.GradientTransformation,
    *,
    collective: Collective,
    alpha: float = 0.1,
) -> optax.GradientTransformationExtraArgs:
    """Synchronous model averaging: pull each model towards the mean, then step locally.

    With ``u`` the local update of ``inner``::

        v <- (1 - alpha) v + alpha * mean_workers(v) + u,
        u, inner_state = inner.update(g, inner_state, v)

    ``update(grads, state, params)`` needs ``params`` (``v``) and returns
    ``alpha * (mean(v) - v) + u``; ``u`` is computed on the model before averaging.
    ``alpha = 1`` restarts every worker from the average model each step (plus its own
    update). The elastic pull ``alpha (mean(v) - v)`` is EASGD's with the centre variable
    replaced by the exact current average, as in Crossbow's SMA, so no parameter server
    holds a centre model.

    Wire: one ring all-reduce (mean) of the model per step, ``2 (N - 1) / N`` times the
    param bytes each way.

    Start every worker from the same model, e.g. ``collective.broadcast(params, 0)``: the
    pull shrinks their differences but never removes them. See
    `shoal.optim.helpers.same_model_check`, which checks it (``shoal-run`` does).

    Args:
      inner: the local optimizer, any optax transformation.
      collective: the workers whose models are averaged (`shoal.comms.Collective`).
      alpha: the averaging weight in ``(0, 1]``; may be injected with
        ``optax.inject_hyperparams`` (a traced value is not checked).

    Returns:
      an ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` returns
      a `SMAState` and whose ``update(updates, state, params=None)`` returns
      ``(updates, new_state)``; ``optax.apply_updates(params, updates)`` is the
      pulled model plus the local update.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from shoal.comms import AxisCollective
      >>> coll = AxisCollective("workers", 2)
      >>> from shoal.optim import sma
      >>> tx = sma(optax.sgd(0.0), collective=coll, alpha=0.5)  # lr 0: averaging alone
      >>> def step(params):
      ...     updates, _ = tx.update(jnp.zeros_like(params), tx.init(params), params)
      ...     return optax.apply_updates(params, updates)
      >>> print(jax.vmap(step, axis_name="workers")(jnp.array([[0.0], [4.0]]))[:, 0])
      [1. 3.]

    References:
      Brabete, "Kungfu", MEng thesis, Imperial College London, 2019, section 2.6.2;
      Koliousis et al., "Crossbow", VLDB 2019.
    """
    check_collective(collective)
    check_hyper("alpha", alpha, 0, 1, open_low=True)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        check_same_structure(params, collective)
        check_floating_leaves("params", params)
        return SMAState(inner_state=inner.init(params), wire=WireMeter.zero())

    def update_fn(updates, state, params=None, **extra_args):
        require_params("sma", params)
        inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        mean = collective.all_reduce(params, "mean")
        out = jax.tree.map(
            lambda m, p, u: (alpha * (m - p) + u).astype(u.dtype), mean, params, inner_updates
        )
        wire = WireCount.of(*all_reduce_bytes(tree_nbytes(params), collective.size))
        return out, SMAState(inner_state, state.wire.record(wire))

    return optax.GradientTransformationExtraArgs(init_fn, checked("sma", SMAState, update_fn))
