"""DES-LOC: local Adam whose parameters, first and second moments are averaged over the
workers on their own periods ``K_x <= K_u <= K_v`` (Iacob et al. 2025).

On every worker ``m``, at step ``t = 1, 2, ...`` (``E_m``: the mean over the workers)::

    u_bar = E_m[u_{t-1}] if t % K_u == 0 else u_{t-1};   u_t = b1 u_bar + (1 - b1) g_t
    v_bar = E_m[v_{t-1}] if t % K_v == 0 else v_{t-1};   v_t = b2 v_bar + (1 - b2) g_t^2
    x_bar = E_m[x_t]     if t % K_x == 0 else x_t;       x_{t+1} = x_bar - lr u_t / (sqrt(v_t)+eps)

References:
  Iacob et al., "DES-LOC: Desynced Low Communication Adaptive Optimizers for Training
  Foundation Models", arXiv:2505.22549, 2025.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from shoal.checks import check_int
from shoal.comms.agreement import check_same_structure
from shoal.comms.collective import Collective, uniform_over
from shoal.comms.wire import WireCount, WireMeter, all_reduce_bytes, tree_nbytes
from shoal.dtypes import promote_types
from shoal.optim._inplace import run_if
from shoal.optim._validation import (
    check_collective,
    check_floating_leaves,
    check_hyper,
    checked,
    require_params,
)

__all__ = ["DESLOCState", "desloc"]


class DESLOCState(NamedTuple):
    """State of `desloc`.

    Attributes:
      mu: this worker's first moment ``u`` (float32 or wider, the params' shapes).
      nu: this worker's second moment ``v``.
      step: int32 count of updates done (``t - 1`` during update ``t``).
      wire: bytes of this transformation's own collectives.
    """

    mu: Any
    nu: Any
    step: jax.Array
    wire: WireMeter

    RANK_UNIFORM = ("step",)  # `shoal.optim.helpers.uniform_axes`


def desloc(
    learning_rate: float | Callable,
    *,
    collective: Collective,
    sync_every: int,
    moment_every: int | None = None,
    second_moment_every: int | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> optax.GradientTransformationExtraArgs:
    """DES-LOC: local Adam, with the params and each moment averaged on its own period.

    Every worker runs Adam on its own gradient ``g_t`` (clip it first, e.g. with
    ``optax.clip_by_global_norm``, for the paper's ``clip(g, rho)``). At update ``t``
    (``t = state.step + 1``) each of the three quantities is first replaced by its mean
    over the workers if its period divides ``t`` (Algorithm 1 of the paper)::

        u_bar = E_m[u_{t-1}] if t % K_u == 0 else u_{t-1};   u_t = b1 u_bar + (1 - b1) g_t
        v_bar = E_m[v_{t-1}] if t % K_v == 0 else v_{t-1};   v_t = b2 v_bar + (1 - b2) g_t^2
        x_bar = E_m[x_t]     if t % K_x == 0 else x_t
        x_{t+1} = x_bar - lr_t u_t / (sqrt(v_t) + eps)

    ``K_x = sync_every``; the paper's defaults ``K_u = 3 K_x`` and ``K_v = 6 K_x`` apply
    when ``moment_every`` and ``second_moment_every`` are None. ``K_x = K_u = K_v = K``
    is Local Adam; ``K = 1`` averages everything every step. As in the paper's equations
    there is no bias correction (optax's ``adam`` has one): the first steps are
    ``lr (1 - b1) / sqrt(1 - b2)`` times the gradient's sign, about ``3.2 lr``. Note that
    a worker's params are averaged before that update's own step, so after a syncing
    update the workers differ by one local step; evaluate their mean.

    Bytes: a float32 all-reduce (mean) of the param-sized quantity on each update its
    period divides, ``2 (M - 1) / M`` times its bytes each way, in ``state.wire.step``;
    with the defaults about ``(1 + 1/3 + 1/6) / K_x`` of the params per update, half of
    Local Adam's ``3 / K``.

    Args:
      learning_rate: ``lr``, a number > 0 or an optax schedule of ``state.step``.
      collective: the workers (`shoal.comms.Collective`).
      sync_every: ``K_x``, the params' period, an int >= 1.
      moment_every: ``K_u``, the first moment's period, an int >= ``K_x`` (None:
        ``3 K_x``).
      second_moment_every: ``K_v``, an int >= ``K_u`` (None: ``6 K_x``).
      b1: the first moment's decay, in [0, 1).
      b2: the second moment's decay, in [0, 1).
      eps: added to ``sqrt(v)``, >= 0.

    Returns:
      an ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` returns a
      `DESLOCState` and whose ``update(updates, state, params)`` returns the updates
      (``optax.apply_updates(params, updates)`` is ``x_{t+1}``) and the new state.

    Example:
      Two workers, ``K_x = 1``: the params are averaged (to 1), then each takes its own
      first step, ``0.1 * 0.1 / sqrt(0.001)`` against its gradient's sign:

      >>> import jax, jax.numpy as jnp, optax
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import desloc
      >>> tx = desloc(0.1, collective=AxisCollective("workers", 2), sync_every=1)
      >>> def step(params, grads):
      ...     updates, _ = tx.update(grads, tx.init(params), params)
      ...     return optax.apply_updates(params, updates)
      >>> out = jax.vmap(step, axis_name="workers")(jnp.array([[0.0], [2.0]]),
      ...                                           jnp.array([[1.0], [-1.0]]))
      >>> print(out.ravel().round(4))
      [0.6838 1.3162]

    References:
      Iacob et al., "DES-LOC: Desynced Low Communication Adaptive Optimizers for
      Training Foundation Models", arXiv:2505.22549, 2025, Algorithm 1.
    """
    check_collective(collective)
    k_x = check_int("sync_every", sync_every, 1)
    k_u = 3 * k_x if moment_every is None else moment_every
    k_u = check_int("moment_every", k_u, k_x, why=" (>= sync_every: K_x <= K_u)")
    k_v = 6 * k_x if second_moment_every is None else second_moment_every
    k_v = check_int("second_moment_every", k_v, k_u, why=" (>= moment_every: K_u <= K_v)")
    b1 = check_hyper("b1", b1, 0, 1, open_high=True)
    b2 = check_hyper("b2", b2, 0, 1, open_high=True)
    eps = check_hyper("eps", eps, 0)
    if not callable(learning_rate):
        check_hyper("learning_rate", learning_rate, 0, open_low=True, why=" or a schedule")
    n_workers = collective.size

    def moment_dtype(x):
        return promote_types(jnp.result_type(x), jnp.float32)

    def init_fn(params):
        check_same_structure(params, collective)
        check_floating_leaves("params", params)
        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), moment_dtype(p)), params)
        return DESLOCState(mu=zeros, nu=zeros, step=jnp.zeros((), jnp.int32), wire=WireMeter.zero())

    def averaged(tree, due, wire):
        nbytes = all_reduce_bytes(tree_nbytes(tree), n_workers)

        def mean(carry):
            x, w = carry
            return collective.all_reduce(x, "mean"), w + WireCount.of(*nbytes)

        return run_if(due, mean, (tree, wire))

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        require_params("desloc", params)
        count = uniform_over(collective, state.step)
        t = count + 1
        wire = WireCount.zero()
        mu, wire = averaged(state.mu, t % k_u == 0, wire)
        nu, wire = averaged(state.nu, t % k_v == 0, wire)
        x_bar, wire = averaged(params, t % k_x == 0, wire)
        g = jax.tree.map(lambda g, m: g.astype(m.dtype), updates, mu)
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, g)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, nu, g)
        lr = learning_rate(count) if callable(learning_rate) else learning_rate
        out = jax.tree.map(
            lambda xb, x, m, v: (
                xb.astype(m.dtype) - x.astype(m.dtype) - lr * m / (jnp.sqrt(v) + eps)
            ).astype(x.dtype),
            x_bar,
            params,
            mu,
            nu,
        )
        new = DESLOCState(mu=mu, nu=nu, step=state.step + 1, wire=state.wire.record(wire))
        return out, new

    return optax.GradientTransformationExtraArgs(
        init_fn, checked("desloc", DESLOCState, update_fn, lambda s: s.mu)
    )
