"""What a training loop reads from any optimizer state: per-step figures and the model to
evaluate, found by name, so that a runner never imports an algorithm's state class.

Example:
  >>> import jax.numpy as jnp, optax
  >>> from shoal.comms import AxisCollective
  >>> from shoal.optim import gtc, readouts
  >>> tx = optax.chain(gtc(0.5, collective=AxisCollective("workers", 2)), optax.sgd(0.1))
  >>> sorted(readouts.step_figures(tx.init(jnp.zeros(4))))
  ['density']
"""

from __future__ import annotations

from typing import Any

import jax
from optax import tree_utils

from shoal.optim.gtc import sent_fraction
from shoal.optim.noise_scale import noise_scale
from shoal.optim.nonfinite import skipped_steps

__all__ = ["evaluation_params", "step_figures"]


def step_figures(opt_state: Any) -> dict[str, jax.Array]:
    """The per-step figures ``opt_state`` holds, by name; only those it has:

    * ``"density"``: elements sent over elements compressed by GTC
      (`shoal.optim.gtc.sent_fraction`);
    * ``"noise_scale"``: the gradient noise scale ``B_simple``
      (`shoal.optim.noise_scale`);
    * ``"skipped"``: steps skipped for a non-finite gradient so far
      (`shoal.optim.skip_nonfinite`).

    Args:
      opt_state: an optimizer state (one worker's, or stacked over workers).

    Returns:
      a dict of scalar arrays (a leading worker axis when stacked or under ``vmap``).
    """
    found = {
        "density": sent_fraction(opt_state),
        "noise_scale": noise_scale(opt_state),
        "skipped": skipped_steps(opt_state),
    }
    return {k: v for k, v in found.items() if v is not None}


def evaluation_params(params: Any, opt_state: Any) -> Any:
    """The model a method delivers: ``params``, or, when ``opt_state`` holds a global model
    (a ``global_params`` field: BMUF, DiLoCo and Streaming DiLoCo, per fragment), that
    model of the latest outer step, or BMUF's filtered model (a ``filtered`` field that is
    not None, ``nbm="chen_huo"``). Mid-block (mid-round) the workers' own models are
    local, unsynchronised ones.

    Args:
      params: the worker's parameters.
      opt_state: its optimizer state.

    Returns:
      a params-shaped tree.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import bmuf
      >>> tx = bmuf(optax.sgd(0.1), collective=AxisCollective("workers", 2), block_size=4)
      >>> print(evaluation_params(jnp.ones(2), tx.init(jnp.zeros(2))))
      [0. 0.]
    """
    filtered = tree_utils.tree_get(opt_state, "filtered", default=None)
    if filtered is not None:
        return filtered
    return tree_utils.tree_get(opt_state, "global_params", default=params)
