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

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from optax import tree_utils

from shoal.optim._gtc import sent_fraction
from shoal.optim._nonfinite import skipped_steps
from shoal.optim.helpers import noise_scale

__all__ = ["READOUTS", "Readout", "evaluation_params", "step_figures"]


@dataclasses.dataclass(frozen=True)
class Readout:
    """One per-step figure a training loop reads from any optimizer state.

    Attributes:
      name: its key in `step_figures` and in the runner's records.
      read: the figure of a state (one worker's, or stacked), None when it holds none.
      by_device: how the values of a worker's devices make the worker's (``"mean"`` or
        ``"first"``: one its devices share), when a worker spans several.
      over_workers: how the workers' values make the run's record (``"mean"`` or
        ``"max"``).
      shown: whether a run's value is recorded (e.g. a count only once it is not 0).
    """

    name: str
    read: Callable[[Any], jax.Array | None]
    by_device: str
    over_workers: str
    shown: Callable[[Any], bool] = lambda value: True

    def combine(self, values: np.ndarray) -> float | int:
        """The run's value from the workers' ``values`` (host arrays)."""
        if self.over_workers == "max":
            return np.max(values).item()
        return float(np.mean(values, dtype=np.float64))


# The per-step figures, in the order the runner records them: a new one is a new row.
READOUTS = (
    # Elements sent over elements compressed by GTC (`shoal.optim._gtc.sent_fraction`).
    Readout("density", sent_fraction, by_device="mean", over_workers="mean"),
    # The gradient noise scale B_simple (`shoal.optim.helpers.noise_scale`).
    Readout("noise_scale", noise_scale, by_device="first", over_workers="mean"),
    # Steps skipped so far for a non-finite gradient (`shoal.optim.skip_nonfinite`).
    Readout("skipped", skipped_steps, "first", "max", shown=lambda steps: steps > 0),
)


def step_figures(opt_state: Any) -> dict[str, jax.Array]:
    """The figures of `READOUTS` that ``opt_state`` holds, by name (only those it has).

    On a state stacked over workers (leading worker axes, read outside ``vmap``) every
    figure is the workers' own figures, stacked alike: worker ``i``'s entry is what worker
    ``i`` reads inside ``vmap``, never divided or summed over the workers. The run's value
    is then ``Readout.combine`` of them (their mean, or their maximum), as the runner
    records it.

    Args:
      opt_state: an optimizer state (one worker's, or stacked over workers).

    Returns:
      a dict of scalar arrays (with the worker axes when stacked or under ``vmap``).
    """
    found = {r.name: r.read(opt_state) for r in READOUTS}
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
