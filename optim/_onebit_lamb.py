"""1-bit LAMB (`onebit_lamb`): LAMB's layer-wise rules in the two stages of
`shoal.optim._onebit`: the warm-up coefficients, the momentum scales and the
fresh-variance factors of the compression stage.

References:
    C. Li et al., "1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training
    with LAMB's Convergence Speed", HiPC 2022 (arXiv:2104.06069), Algorithm 1.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from shoal import vma
from shoal.comms.collective import Collective
from shoal.comms.shards import worker_max, worker_size, worker_sums
from shoal.optim._inplace import run_if
from shoal.optim._onebit import OneBitLambState, check_order, check_range, hyper, two_stage

__all__ = ["onebit_lamb"]


def _norms(xs, collective):
    """The norm of each array in ``xs``, of the whole leaf: a worker that spans devices
    sums its shards' squares, in one collective for all (`shoal.comms.shards`)."""
    return [jnp.sqrt(q) for q in worker_sums([jnp.sum(x * x) for x in xs], collective)]


def _on_its_own(x):
    """``x`` unchanged (float32 rounded to float32), computed by a loop of its own.

    A reduction of ``x`` then reads it from memory. Otherwise XLA:CPU computes ``x``
    inside the reduction (a YNNPACK fusion): on one thread, ~4x slower when ``x`` divides
    or takes square roots, and rounded differently from a stored ``x``.
    """
    return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=23)


def onebit_lamb(
    learning_rate: optax.ScalarOrSchedule,
    *,
    collective: Collective,
    freeze_step: int,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    coeff_beta: float = 0.9,
    factor_max: float = 4.0,
    factor_min: float = 0.5,
    factor_threshold: float = 0.1,
    momentum_mask: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """1-bit LAMB (Li et al. 2021, Algorithm 1), without bias correction.

    Inputs are each worker's local gradients; outputs are the updates (the same on every
    worker), to be applied with ``optax.apply_updates``. A "layer" is a leaf of the
    parameter tree; ``t`` counts from 1.

    Warm-up, ``t <= freeze_step``, on ``g = mean_i g_i`` (plain all-reduce), per layer::

        m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
        u = m / (sqrt(v) + eps) + weight_decay p
        c = clip(||p|| / ||u||, min_coeff, max_coeff)   (1 if either norm is 0)
        coeff_avg = coeff_beta coeff_avg + (1 - coeff_beta) c   (only when c != 1)
        update = -lr c u;   at t == freeze_step: v_fresh = v

    At the first compressed step, from the warm-up momentum: ``r_l = ||m_l|| /
    sqrt(numel_l)``, ``scale_l = mean_k(r_k) / r_l`` (1 where ``r_l = 0``), then frozen.
    Compression, ``t > freeze_step``, on each worker's local ``g_i``, per layer::

        m_last = m;   m = (b1 m + (1 - b1) g_i) scale_l
        m = OneBit().mean(m) / scale_l      (all layers fused: one exchange)
        g_rec = (m - b1 m_last) / (1 - b1);   v_fresh = b2 v_fresh + (1 - b2) g_rec^2
        d = sqrt(v) + eps;   u_pre = m / d;   u = u_pre + weight_decay p
        f = max(d / (sqrt(v_fresh) + eps))
        if weight_decay > 0: rho = min(1, ||u_pre|| / ||u||), f = f rho + (1 - rho)
        f = clip(f, factor_min, factor_max)
        f = clip(f, f_last (1 - factor_threshold), f_last (1 + factor_threshold))
        f_last = f   (starts at 1);   update = -lr coeff_avg f u

    (``rho = 1`` when ``||u|| = 0``.)

    Args:
      learning_rate: a float or an optax schedule (called with the 0-based step count).
      collective: the workers (`shoal.comms.Collective`).
      freeze_step: warm-up steps (``>= 1``).
      b1, b2: moment decays in ``[0, 1)``.
      eps: ``> 0``.
      weight_decay: ``>= 0``.
      max_coeff, min_coeff: bounds of the warm-up LAMB coefficient,
        ``0 <= min_coeff <= max_coeff``.
      coeff_beta: decay of the coefficient average, in ``[0, 1)``.
      factor_max, factor_min: bounds of the compression-stage factor,
        ``0 <= factor_min <= factor_max``.
      factor_threshold: the largest relative change of the factor per step, ``>= 0``.
      momentum_mask: optional params-shaped tree of 0/1 arrays (broadcastable to the
        leaves) for structurally zero gradients; their momentum is zeroed after each
        decompression (without it they diverge, as in `onebit_adam`).

    Returns:
      an ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` returns
      a `OneBitLambState` and whose ``update(updates, state, params=None)``
      returns ``(updates, new_state)``; the updates are identical on every worker.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from shoal.comms import AxisCollective
      >>> coll = AxisCollective("workers", 2)
      >>> from shoal.optim import onebit_lamb
      >>> tx = onebit_lamb(0.1, collective=coll, freeze_step=1)
      >>> def train(params, g):
      ...     state = tx.init(params)
      ...     for _ in range(3):
      ...         updates, state = tx.update(g, state, params)
      ...         params = optax.apply_updates(params, updates)
      ...     return params
      >>> grads = jnp.array([[1.0, 2.0], [3.0, 2.0]])  # one row per worker
      >>> out = jax.vmap(train, axis_name="workers")(jnp.ones((2, 2)), grads)
      >>> print(out.round(3))
      [[0.883 0.883]
       [0.883 0.883]]

    References:
      Li et al., "1-bit LAMB: Communication Efficient Large-Scale Large-Batch
      Training with LAMB's Convergence Speed", 2021, Algorithm 1.
    """
    h = hyper(learning_rate, collective, freeze_step, b1, b2, eps, weight_decay, momentum_mask)
    for name, value, high in [
        ("max_coeff", max_coeff, np.inf),
        ("min_coeff", min_coeff, np.inf),
        ("coeff_beta", coeff_beta, 1.0),
        ("factor_max", factor_max, np.inf),
        ("factor_min", factor_min, np.inf),
        ("factor_threshold", factor_threshold, np.inf),
    ]:
        check_range(name, value, 0.0, high, high_open=True)
    check_order("min_coeff", min_coeff, "max_coeff", max_coeff)
    check_order("factor_min", factor_min, "factor_max", factor_max)
    leaves = jax.tree.leaves
    # Without weight decay rho is 1 whatever the norms: skip the passes that take them.
    decays = h.decays

    def init(params, zeros):
        scalar = lambda value: jax.tree.map(lambda _: jnp.full((), value, jnp.float32), params)
        return dict(
            nu_fresh=zeros, coeff_avg=scalar(0.0), last_factor=scalar(1.0), scale=scalar(1.0)
        )

    def warmup(state, step):
        p = step.params
        # Stored, then its norm taken: the coefficients do not hang on XLA's fusion.
        us = [
            _on_its_own(m / (jnp.sqrt(v) + eps) + weight_decay * w)
            for m, v, w in zip(leaves(state.mu), leaves(state.nu), p)
        ]
        norms = _norms([*p, *us], collective)
        rate, avg = [], []
        for w_norm, u_norm, a in zip(norms[: len(p)], norms[len(p) :], leaves(state.coeff_avg)):
            ok = (w_norm > 0) & (u_norm > 0)
            coeff = jnp.where(
                ok, jnp.clip(w_norm / jnp.where(ok, u_norm, 1.0), min_coeff, max_coeff), 1.0
            )
            avg.append(jnp.where(coeff != 1, coeff_beta * a + (1 - coeff_beta) * coeff, a))
            rate.append(-step.lr * coeff)
        # v freezes after this step and v_fresh starts from it: a copy on that step only.
        # (What a nested `run_if` reads goes in its carry, or XLA copies it every step.)
        freeze = lambda c: (c[0], c[0])
        nu, fresh = run_if(step.count == freeze_step - 1, freeze, (state.nu, state.nu_fresh))
        return state._replace(nu=nu, nu_fresh=fresh, coeff_avg=step.tree(avg)), rate

    def scales(state, step):
        # Once, from the warm-up momentum: they even out the layers' momentum magnitudes
        # so that one shared 1-bit scale does not drown the small layers.
        def fresh(mu):
            mu = leaves(mu)
            sizes = [worker_size(m, collective) for m in mu]
            r = [x / math.sqrt(max(k, 1)) for x, k in zip(_norms(mu, collective), sizes)]
            # A zero-size layer has no magnitude to even out: it stays out of the mean, so
            # the other layers' scales are those of the tree without it.
            held = [x for x, k in zip(r, sizes) if k]
            united = sum(held) / len(held)
            return step.tree([jnp.where(x > 0, united / jnp.where(x > 0, x, 1.0), 1.0) for x in r])

        # A branch, not `run_if`: its result is small, and a loop would copy what it reads.
        keep = lambda _: state.scale
        scale = vma.cond(step.count == freeze_step, fresh, keep, state.mu)
        return state._replace(scale=scale), scale

    def compressed(state, mu_last, step):
        mu, p = leaves(state.mu), step.params
        fresh, u_pres, us, raw = [], [], [], []
        for m, m_last, v, vf, w in zip(mu, mu_last, leaves(state.nu), leaves(state.nu_fresh), p):
            g_rec = (m - b1 * m_last) / (1 - b1)
            fresh.append(b2 * vf + (1 - b2) * g_rec * g_rec)
            denom = jnp.sqrt(v) + eps
            u_pres.append(m / denom)
            us.append(u_pres[-1] + weight_decay * w)
            ratio = _on_its_own(denom / (jnp.sqrt(fresh[-1]) + eps))
            # A zero-size layer has no maximum: its factor is kept (below).
            raw.append(jnp.max(ratio) if ratio.size else jnp.ones((), jnp.float32))
        # The worker's norms and maxima, each in one collective when it spans devices.
        norms = _norms([*us, *u_pres], collective) if decays else None
        raw = worker_max(jnp.stack(raw), collective)
        rate, factors = [], []
        for i, (avg, f_last) in enumerate(zip(leaves(state.coeff_avg), leaves(state.last_factor))):
            f = raw[i]
            if decays:
                u_norm, pre_norm = norms[i], norms[len(us) + i]
                ratio = pre_norm / jnp.where(u_norm > 0, u_norm, 1)
                rho = jnp.where(u_norm > 0, jnp.minimum(1.0, ratio), 1)
                f = jnp.where(weight_decay > 0, f * rho + (1 - rho), f)
            f = jnp.clip(f, factor_min, factor_max)
            f = jnp.clip(f, f_last * (1 - factor_threshold), f_last * (1 + factor_threshold))
            if not mu[i].size:  # its update is empty whatever the factor
                f = f_last
            rate.append(-step.lr * avg * f)
            factors.append(f)
        return state._replace(nu_fresh=step.tree(fresh), last_factor=step.tree(factors)), rate

    return two_stage(
        "onebit_lamb",
        OneBitLambState,
        h,
        init=init,
        warmup=warmup,
        scales=scales,
        compressed=compressed,
        held=("mu", "nu", "nu_fresh"),
    )
