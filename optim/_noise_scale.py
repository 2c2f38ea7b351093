"""Gradient noise scale monitor: synchronous averaging plus McCandlish et al.'s estimate of
the simple noise scale ``B_simple = tr(Sigma) / |G|^2``, the signal KungFu uses to adapt
the batch size (Brabete, KungFu, section 4 and appendix A.3).

With ``N`` workers of local batch ``b``, ``B_small = b`` and ``B_big = N b``::

    |G|^2 = (B_big |g_big|^2 - B_small |g_small|^2) / (B_big - B_small)
    S     = (|g_small|^2 - |g_big|^2) / (1 / B_small - 1 / B_big)

are unbiased estimates of ``|G|^2`` and ``tr(Sigma)`` (the trace of the per-example
gradient covariance), but their ratio is not; so each is smoothed by an EMA first and
``B_simple = S_ema / |G|^2_ema``.

References:
  McCandlish, Kaplan, Amodei and the OpenAI Dota Team, "An Empirical Model of Large-Batch
  Training", arXiv:1812.06162, 2018, appendix A.1.
  Brabete, "KungFu: A Novel Distributed Training System for TensorFlow using Flexible
  Synchronisation", 2019, section 4.3 and appendix A.3.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shoal.checks import check_int
from shoal.comms.agreement import check_same_structure
from shoal.comms.collective import Collective
from shoal.comms.shards import worker_sums
from shoal.comms.wire import WireCount, WireMeter, all_reduce_bytes, tree_nbytes
from shoal.optim._validation import check_collective, check_hyper, checked
from shoal.trees import find_instances

_SCALAR_BYTES = 4  # one float32: the local squared norm


class NoiseScaleState(NamedTuple):
    """State of `gradient_noise_scale` (identical on every worker).

    Attributes:
      step: int32 number of updates so far (``t``).
      g2_ema: float32 raw EMA of the per-step ``|G|^2`` estimates.
      s_ema: float32 raw EMA of the per-step ``S`` estimates.
      g2: float32 bias-corrected ``|G|^2``, ``g2_ema / (1 - ema^t)`` (0 before step 1).
      s: float32 bias-corrected ``tr(Sigma)``, ``s_ema / (1 - ema^t)`` (0 before step 1).
      noise_scale: float32 ``B_simple = s / g2`` (0 before step 1).
      wire: bytes of the most recent update and since init.
    """

    step: jax.Array
    g2_ema: jax.Array
    s_ema: jax.Array
    g2: jax.Array
    s: jax.Array
    noise_scale: jax.Array
    wire: WireMeter


def _check_batch_size(value: Any) -> None:
    if isinstance(value, jax.core.Tracer):  # fed in by inject_hyperparams inside jit
        return
    if isinstance(value, (np.ndarray, jax.Array)):
        # A concrete integer array of shape () (e.g. from optax.inject_hyperparams) counts
        # as its int; any other array is refused below, as it is no int.
        arr = np.asarray(value)
        if arr.shape == () and np.issubdtype(arr.dtype, np.integer):
            value = arr[()]
    check_int("local_batch_size", value, 1)


def _sq_norm(tree: Any, collective: Any) -> jax.Array:
    """``sum_i x_i^2`` over every leaf of the whole worker (all its shards), in float32."""
    squares = [jnp.sum(jnp.square(jnp.asarray(x, jnp.float32))) for x in jax.tree.leaves(tree)]
    return sum(worker_sums(squares, collective), jnp.zeros((), jnp.float32))


def gradient_noise_scale(
    *,
    collective: Collective,
    local_batch_size: int,
    ema: float = 0.9,
) -> optax.GradientTransformationExtraArgs:
    """Average gradients over workers and track the gradient noise scale in the state.

    Like `allreduce_gradients`, plus McCandlish et al.'s ``B_simple = tr(Sigma) / |G|^2``.

    Per step ``t``, with ``N`` workers, ``b = local_batch_size``, ``g_i`` worker ``i``'s
    gradient and ``g = (1/N) sum_i g_i`` (the returned update)::

        |g_small|^2 = (1/N) sum_i |g_i|^2        |g_big|^2 = |g|^2
        |G|^2_t = (N |g_big|^2 - |g_small|^2) / (N - 1)
        S_t     = N b (|g_small|^2 - |g_big|^2) / (N - 1)
        m_t = ema m_{t-1} + (1 - ema) x_t,  x_hat_t = m_t / (1 - ema^t)   (x in |G|^2, S)
        B_simple = S_hat_t / |G|^2_hat_t

    These are McCandlish et al.'s estimators with ``B_small = b`` and ``B_big = N b``,
    simplified algebraically. Choices:

    * ``|g_small|^2`` is the mean over workers of every worker's own squared norm, not
      one worker's, so it has less variance and every worker holds identical estimates.
    * Squared norms run over the whole pytree and are accumulated in float32, whatever
      the gradients' dtype; ``|g_big|^2`` is taken of the averaged gradient as returned.
    * EMAs are bias-corrected as in Adam, so ``ema=0`` reports the raw per-step
      estimates. ``ema`` is the weight of the past (KungFu's ``alpha`` is ``1 - ema``).
    * ``|G|^2`` may come out <= 0 when the signal is small against the noise; the ratio is
      then reported as is (negative or non-finite), never clipped. A non-finite gradient
      would stay in the EMAs for ever: `shoal.optim.skip_nonfinite` around the chain
      skips such a step and leaves them untouched.

    Communication: one all-reduce of the gradient tree with one more float32 leaf (each
    worker's squared norm); ``wire`` counts both.

    Args:
      collective: the workers to average over (`shoal.comms.Collective`), ``size >= 2``.
      local_batch_size: examples per worker per step (``B_small``), a positive int.
      ema: EMA decay in ``[0, 1)``.

    Returns:
      an ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` returns
      a `NoiseScaleState` and whose ``update(updates, state, params=None)``
      returns ``(updates, new_state)``; the updates are the mean gradient and
      ``noise_scale(state)`` reads ``B_simple``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from shoal.comms import AxisCollective
      >>> coll = AxisCollective("workers", 2)
      >>> from shoal.optim import gradient_noise_scale
      >>> from shoal.optim.helpers import noise_scale
      >>> tx = gradient_noise_scale(collective=coll, local_batch_size=8, ema=0.0)
      >>> def step(g):
      ...     updates, state = tx.update(g, tx.init(g))
      ...     return updates, noise_scale(state)
      >>> grads = jnp.array([[1.0, 1.0], [1.0, 3.0]])
      >>> updates, b_simple = jax.vmap(step, axis_name="workers")(grads)
      >>> print(updates[0], b_simple)
      [1. 2.] [4. 4.]

    References:
      McCandlish et al., "An Empirical Model of Large-Batch Training", 2018, appendix A.1.
      Brabete, "KungFu", 2019, section 4.3 and appendix A.3.
    """
    check_collective(collective)
    _check_batch_size(local_batch_size)
    check_hyper("ema", ema, 0, 1, open_high=True)
    n = collective.size
    if n == 1:
        raise ValueError(
            "collective must have size >= 2: with one worker B_big == B_small and the "
            "noise scale estimates are undefined"
        )

    def init_fn(params: Any) -> NoiseScaleState:
        check_same_structure(params, collective)
        del params
        zero = jnp.zeros((), jnp.float32)
        return NoiseScaleState(
            step=jnp.zeros((), jnp.int32),
            g2_ema=zero,
            s_ema=zero,
            g2=zero,
            s=zero,
            noise_scale=zero,
            wire=WireMeter.zero(),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        local_sq = _sq_norm(updates, collective)
        # The squared norm rides in the gradient's all-reduce: no extra message, whose
        # latency would double the exchange's on a large cluster.
        updates, small_sq = collective.all_reduce((updates, local_sq), op="mean")
        big_sq = _sq_norm(updates, collective)

        b = jnp.asarray(local_batch_size, jnp.float32)
        g2_t = (n * big_sq - small_sq) / (n - 1)
        s_t = n * b * (small_sq - big_sq) / (n - 1)

        beta = jnp.asarray(ema, jnp.float32)
        step = optax.safe_increment(state.step)
        g2_ema = beta * state.g2_ema + (1 - beta) * g2_t
        s_ema = beta * state.s_ema + (1 - beta) * s_t
        correction = 1 - beta ** step.astype(jnp.float32)
        g2 = g2_ema / correction
        s = s_ema / correction

        wire = state.wire.record(
            WireCount.of(*all_reduce_bytes(tree_nbytes(updates) + _SCALAR_BYTES, n))
        )
        new_state = NoiseScaleState(step, g2_ema, s_ema, g2, s, s / g2, wire)
        return updates, new_state

    return optax.GradientTransformationExtraArgs(
        init_fn, checked("gradient_noise_scale", NoiseScaleState, update_fn)
    )


def noise_scale(opt_state: Any) -> jax.Array | None:
    """The gradient noise scale ``B_simple`` recorded in an optimizer state.

    ``B_simple = S_hat / |G|^2_hat`` of the first `gradient_noise_scale` inside
    ``opt_state`` (any nesting of optax states), or None when there is none. Works on
    the host and under tracing; under ``vmap`` over workers the result has a leading
    worker axis.

    Args:
      opt_state: an optimizer state (any nesting of optax states) that may hold a
        `NoiseScaleState`.

    Returns:
      a float32 array, ``B_simple`` (with a leading worker axis under ``vmap``),
      or None when ``opt_state`` holds no `NoiseScaleState`.

    Example:
      It finds the estimate anywhere in a chain's state (0 before the first update), and
      says None where there is none (`gradient_noise_scale` shows a value):

      >>> import jax.numpy as jnp, optax
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import gradient_noise_scale
      >>> from shoal.optim.helpers import noise_scale
      >>> monitor = gradient_noise_scale(collective=AxisCollective("workers", 2),
      ...                                local_batch_size=8)
      >>> print(noise_scale(optax.chain(monitor, optax.sgd(0.1)).init(jnp.zeros(2))))
      0.0
      >>> print(noise_scale(optax.sgd(0.1).init(jnp.zeros(2))))
      None

    References:
      McCandlish et al., "An Empirical Model of Large-Batch Training", 2018,
      appendix A.1.
    """
    states = find_instances(opt_state, NoiseScaleState)
    return states[0].noise_scale if states else None
