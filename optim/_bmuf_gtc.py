"""Two-tier BMUF_GTC (Ladkat et al., section 2.3, Fig. 1): GTC inside groups, BMUF across.

``N`` workers form ``M`` groups of ``P = N / M`` consecutive workers. Every step the
workers of a group exchange threshold-compressed gradients (`shoal.optim._gtc.gtc` over
``intra``) and apply the same mean update with the inner optimizer, so the ``P`` models
of a group stay identical. Every ``block_size`` steps the ``M`` group models take the
BMUF step of `shoal.optim._bmuf.bmuf` over ``inter`` (``N`` replaced by ``M`` in eq. 5),
and every worker restarts from the new global model.

References:
  Ladkat et al., "Two Tiered Distributed Training Algorithm for Acoustic Modeling",
  sections 2.1-2.3. Chen & Huo, ICASSP 2016. Strom, Interspeech 2015.
"""

from __future__ import annotations

import optax

from shoal.comms.collective import Collective
from shoal.optim._bmuf import block_update_filtering
from shoal.optim._gtc import gtc
from shoal.optim._validation import check_collective


def bmuf_gtc(
    inner: optax.GradientTransformation,
    *,
    intra: Collective,
    inter: Collective,
    block_size: int,
    threshold: float,
    capacity: int | float = 0.02,
    block_lr: optax.ScalarOrSchedule = 1.0,
    block_momentum: optax.ScalarOrSchedule | None = None,
    nesterov: bool = True,
    nbm: str = "seed",
    reset_inner_state: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Two-tier training: GTC within each group of ``P`` workers, BMUF across the ``M`` groups.

    Per step (lower tier): ``optax.chain(gtc(threshold, collective=intra,
    capacity=capacity), inner)`` on this worker's gradient. Per block (upper tier): the
    BMUF step of `shoal.optim._bmuf.bmuf` (same ``block_lr``, ``block_momentum``,
    ``nesterov``, ``nbm``; default ``eta = 1 - zeta / M``) over ``inter``.

    Communication: the paper lets one leader per group run the BMUF step and broadcast
    the result inside its group. Here all ``P`` members take part instead: member ``p``
    of every group all-reduces over ``inter`` (the workers at position ``p`` of all
    groups, as `shoal.comms.two_tier` builds it). The ``P`` parallel all-reduces carry
    identical data, because a group's models are identical, so every member computes
    the same ``W_g`` and no broadcast is needed. Per worker and step, the bytes are
    GTC's all-gather over ``intra`` (``(P - 1) * 4 * (capacity + 1)`` each way) plus, on
    block steps only, the ring all-reduce of the model over ``inter``
    (``2 (M - 1) / M * n`` each way, ``n`` = bytes of the params); `wire_bytes` of the
    state sums both.

    ``P = 1`` is `bmuf` (GTC is skipped: a group of one sends nothing, so there is
    nothing to compress); ``M = 1`` with the default ``block_lr`` and
    ``block_momentum`` (``zeta = 1, eta = 0``) is GTC chained with ``inner``, the BMUF
    step only re-setting the model it already has. ``reset_inner_state`` re-inits
    ``inner``'s state only; GTC's residuals are kept, so no gradient mass is lost.

    Every worker must ``init`` from the same params, e.g. rank 0's:
    ``params = intra.broadcast(inter.broadcast(params, 0), 0)``; see
    `shoal.optim.helpers.same_model_check` with ``(intra, inter)``, which checks it.

    To skip steps with a NaN/Inf gradient on all ``N`` workers together, wrap it in
    ``shoal.optim.skip_nonfinite(tx, collective=(intra, inter))``: the flag is summed
    within the group, then across groups.

    Args:
      inner: the optimizer applied to the group's aggregated gradient, e.g. ``optax.sgd``.
      intra: collective of the ``P`` workers of this worker's group.
      inter: collective of the ``M`` workers at this worker's position in every group.
      block_size: steps per block (int >= 1).
      threshold: GTC's ``tau > 0``.
      capacity: GTC's words per worker per step (see `shoal.optim._gtc.gtc`).
      block_lr, block_momentum, nesterov, nbm, reset_inner_state: as in `bmuf`.

    State: `shoal.optim._bmuf.BMUFState`; its ``inner_state`` is the chain state
    ``(GTCState, inner state)``, or the inner state alone when ``P = 1``.

    Returns:
      an `shoal.optim.ApplyingTransformation` whose ``init(params)`` returns
      a `shoal.optim.BMUFState` and whose ``update(updates, state, params=None)``
      returns ``(updates, new_state)``; ``optax.apply_updates(params, updates)``
      is this worker's next model. As for `shoal.optim.bmuf`,
      `shoal.optim.update_and_apply` takes a step and applies it in place.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from shoal.comms import AxisCollective
      >>> intra, inter = AxisCollective("workers", 4).split(2)
      >>> from shoal.optim import bmuf_gtc
      >>> tx = bmuf_gtc(optax.sgd(0.5), intra=intra, inter=inter, block_size=2, threshold=0.1)
      >>> def train(params, target):
      ...     state = tx.init(params)
      ...     for _ in range(2):
      ...         updates, state = tx.update(params - target, state, params)
      ...         params = optax.apply_updates(params, updates)
      ...     return params
      >>> targets = jnp.arange(4.0).reshape(2, 2, 1)  # [group, member, param]
      >>> run = jax.vmap(jax.vmap(train, axis_name="member"), axis_name="group")
      >>> print(run(jnp.zeros((2, 2, 1)), targets)[..., 0])
      [[0.1125 0.1125]
       [0.1125 0.1125]]

    References:
      Ladkat et al., "Two Tiered Distributed Training Algorithm for Acoustic
      Modeling", sections 2-3. Chen & Huo, ICASSP 2016 (BMUF). Strom, Interspeech
      2015 (threshold compression).
    """
    check_collective(intra)
    check_collective(inter)
    # gtc() validates tau and capacity.
    compress = gtc(threshold, collective=intra, capacity=capacity)
    inner = optax.with_extra_args_support(inner)
    if intra.size == 1:
        local = inner
        reset = lambda local_state, params: inner.init(params)
    else:
        local = optax.chain(compress, inner)
        reset = lambda local_state, params: (local_state[0], inner.init(params))
    return block_update_filtering(
        local,
        collective=inter,
        block_size=block_size,
        block_lr=block_lr,
        block_momentum=block_momentum,
        nesterov=nesterov,
        nbm=nbm,
        reset_local_state=reset if reset_inner_state else None,
        all_workers=(intra, inter),
        name="bmuf_gtc",
    )
