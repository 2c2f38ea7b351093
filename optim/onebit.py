"""1-bit LAMB and 1-bit Adam: frozen-variance optimizers whose momentum crosses the wire
as signs, through the error-compensated `shoal.comms.compressed_allreduce`.

Both run in two stages on a rank-uniform step counter ``t = 1, 2, ...`` (a real
in-place branch, `run_if`, so each step runs only its own collectives):

* warm-up, ``t <= freeze_step``: the optimizer on the all-reduced gradient (Adam or
  LAMB, no bias correction); at ``t == freeze_step`` the second moment ``v`` is frozen;
* compression, ``t > freeze_step``: each worker adds its local gradient to the momentum,
  the momenta of all leaves, fused into one buffer, are averaged by one compressed
  all-reduce (about 1 bit per element each way), and the update uses the frozen ``v``.

Every piece of state (moments, frozen and fresh variance, LAMB coefficients and scales,
worker and server errors) is in the optax state, so a checkpoint resumes exactly.
Unlike the DeepSpeed implementation, the first step is a real step. Gradients are not
checked for NaN/Inf here: wrap the optimizer in `shoal.optim.skip_nonfinite`.

References:
    H. Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
    Convergence Speed", ICML 2021, Algorithm 1.
    C. Li et al., "1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training
    with LAMB's Convergence Speed", HiPC 2022 (arXiv:2104.06069), Algorithm 1.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from shoal import vma
from shoal.comms.agreement import check_same_structure
from shoal.comms.collective import Collective
from shoal.comms.compressed import OneBit
from shoal.comms.compressor import tree_mean
from shoal.comms.shards import check_sharded_alike, worker_max, worker_size, worker_sums
from shoal.comms.wire import WireCount, WireMeter
from shoal.optim.inplace import run_if
from shoal.optim.validation import (
    check_collective,
    check_floating_leaves,
    check_int,
    checked,
    concrete_float,
    require_params,
)

__all__ = ["OneBitAdamState", "OneBitLambState", "onebit_adam", "onebit_lamb"]


class OneBitAdamState(NamedTuple):
    """State of `onebit_adam`.

    Attributes:
      count: int32 steps taken.
      mu: param-shaped float32 momentum ``m``.
      nu: param-shaped float32 second moment ``v``, frozen after ``freeze_step``.
      worker_error, server_error: float32 error feedback of the compressed all-reduce.
      wire: bytes of the most recent update and since init.
    """

    count: jax.Array
    mu: Any
    nu: Any
    worker_error: jax.Array
    server_error: jax.Array
    wire: WireMeter


class OneBitLambState(NamedTuple):
    """State of `onebit_lamb`.

    Attributes:
      count: int32 steps taken.
      mu: param-shaped float32 momentum ``m``.
      nu: param-shaped float32 second moment ``v``, frozen after ``freeze_step``.
      nu_fresh: param-shaped float32 ``v_fresh``, tracked from the reconstructed
        gradients of the compression stage (a copy of ``v`` at ``freeze_step``).
      coeff_avg: per-leaf float32 running average of the warm-up LAMB coefficients.
      last_factor: per-leaf float32 scaling factor of the previous compressed step.
      scale: per-leaf float32 momentum scale (1 until the first compressed step).
      worker_error, server_error: float32 error feedback of the compressed all-reduce.
      wire: bytes of the most recent update and since init.
    """

    count: jax.Array
    mu: Any
    nu: Any
    nu_fresh: Any
    coeff_avg: Any
    last_factor: Any
    scale: Any
    worker_error: jax.Array
    server_error: jax.Array
    wire: WireMeter


# --------------------------------------------------------------------------- checks


def _check_range(name, value, low, high, *, low_open=False, high_open=False):
    v = concrete_float(value)
    if v is None:
        return
    ok = np.isfinite(v) or (high == np.inf and not high_open and v == np.inf)
    ok = ok and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")


def _check_order(low_name, low, high_name, high):
    lo, hi = concrete_float(low), concrete_float(high)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"{low_name} ({low}) must not exceed {high_name} ({high})")


def _check_mask(mask, params):
    if mask is None:
        return
    if jax.tree.structure(mask) != jax.tree.structure(params):
        raise ValueError("momentum_mask must have the structure of params")
    for m, p in zip(jax.tree.leaves(mask), jax.tree.leaves(params)):
        try:
            jnp.broadcast_shapes(jnp.shape(m), jnp.shape(p))
        except ValueError:
            raise ValueError(
                f"momentum_mask leaf of shape {jnp.shape(m)} does not broadcast to the "
                f"parameter of shape {jnp.shape(p)}"
            ) from None


class _Hyper(NamedTuple):
    learning_rate: optax.ScalarOrSchedule
    collective: Collective
    freeze_step: int
    b1: float
    b2: float
    eps: float
    weight_decay: float
    momentum_mask: Any


def _hyper(learning_rate, collective, freeze_step, b1, b2, eps, weight_decay, mask) -> _Hyper:
    """The hyper-parameters both algorithms share, checked."""
    check_collective(collective)
    check_int("freeze_step", freeze_step, 1)
    if not callable(learning_rate):
        _check_range("learning_rate", learning_rate, 0.0, np.inf, high_open=True)
    _check_range("b1", b1, 0.0, 1.0, high_open=True)
    _check_range("b2", b2, 0.0, 1.0, high_open=True)
    _check_range("eps", eps, 0.0, np.inf, low_open=True, high_open=True)
    _check_range("weight_decay", weight_decay, 0.0, np.inf, high_open=True)
    return _Hyper(learning_rate, collective, freeze_step, b1, b2, eps, weight_decay, mask)


# ------------------------------------------------------------------ the two stages


class _Step(NamedTuple):
    """What a stage reads besides the state: float32 leaves, in the gradient's order."""

    grads: list  # this worker's gradient
    params: list
    count: jax.Array  # 0-based steps taken, the same on every worker (`Collective.uniform`)
    lr: Any
    treedef: Any

    def tree(self, leaves):
        return self.treedef.unflatten(leaves)


def _f32(xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


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


def _numel(tree) -> int:
    return sum(math.prod(jnp.shape(x)) for x in jax.tree.leaves(tree))


def _two_stage(name, state_type, h: _Hyper, *, init, warmup, scales, compressed):
    """The transformation both algorithms share; each supplies its own rules:

    * ``init(params, zeros)``: its own state fields, as a dict;
    * ``warmup(state, step)``: from the state with the new ``mu`` and ``nu``, the new
      state and the per-leaf ``rate`` of the update ``rate (m / (sqrt(v) + eps) +
      weight_decay p)``;
    * ``scales(state, step)``: the state and the per-leaf momentum scales (None: none);
    * ``compressed(state, mu_last, step)``: as ``warmup``, after the exchange.
    """
    b1, b2, collective, size = h.b1, h.b2, h.collective, h.collective.size
    codec = OneBit()

    def init_fn(params):
        check_same_structure(params, collective)
        check_floating_leaves("params", params)
        _check_mask(h.momentum_mask, params)
        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        worker_error, server_error = codec.init(max(_numel(params), 1), size)
        return state_type(
            count=jnp.zeros((), jnp.int32),
            mu=zeros,
            nu=zeros,
            worker_error=worker_error,
            server_error=server_error,
            wire=WireMeter.zero(),
            **init(params, zeros),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        require_params(name, params)
        check_floating_leaves("updates", updates)
        leaves, treedef = jax.tree.flatten(updates)
        check_sharded_alike(name, leaves, collective)
        lr = h.learning_rate(state.count) if callable(h.learning_rate) else h.learning_rate
        count = collective.uniform(state.count)
        step = _Step(_f32(leaves), _f32(treedef.flatten_up_to(params)), count, lr, treedef)
        mask = h.momentum_mask
        mask = None if mask is None else _f32(treedef.flatten_up_to(mask))

        # Each stage rewrites the carry, (state, rate, wire), in place (`run_if`).
        def warmup_stage(carry):
            g, _, nbytes = tree_mean(updates, collective=collective)
            g = _f32(jax.tree.leaves(g))
            mu = [b1 * m + (1 - b1) * x for m, x in zip(jax.tree.leaves(carry[0].mu), g)]
            nu = [b2 * v + (1 - b2) * x * x for v, x in zip(jax.tree.leaves(carry[0].nu), g)]
            state, rate = warmup(carry[0]._replace(mu=step.tree(mu), nu=step.tree(nu)), step)
            return state, rate, WireCount.of(*nbytes)

        def compressed_stage(carry):
            state, k = scales(carry[0], step)
            mu_last = jax.tree.leaves(state.mu)
            local = [b1 * m + (1 - b1) * x for m, x in zip(mu_last, step.grads)]
            if k is not None:
                local = [x * s for x, s in zip(local, jax.tree.leaves(k))]
            errors = (state.worker_error, state.server_error)
            mu, errors, nbytes = tree_mean(local, errors, collective=collective, exchange=codec)
            if k is not None:
                mu = [m / s for m, s in zip(mu, jax.tree.leaves(k))]
            if mask is not None:
                mu = [m * z for m, z in zip(mu, mask)]
            state = state._replace(mu=step.tree(mu), worker_error=errors[0], server_error=errors[1])
            state, rate = compressed(state, mu_last, step)
            return state, rate, WireCount.of(*nbytes)

        carry = (state, [jnp.zeros((), jnp.float32)] * len(leaves), WireCount.zero())
        if not _numel(updates):  # nothing to compress
            carry = warmup_stage(carry)
        else:
            # The stage is the same on every worker: a real branch (not both) under vmap.
            warm = count < h.freeze_step
            carry = run_if(~warm, compressed_stage, run_if(warm, warmup_stage, carry))
        # The update after the branch, from the new state: one pass (fused into whatever
        # applies it), and no parameter-sized update in the carry.
        state, rate, wire = carry
        mu, nu = jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)
        out = [
            (r * (m / (jnp.sqrt(v) + h.eps) + h.weight_decay * w)).astype(x.dtype)
            for r, m, v, w, x in zip(rate, mu, nu, step.params, leaves)
        ]
        state = state._replace(count=state.count + 1, wire=state.wire.record(wire))
        return treedef.unflatten(out), state

    return optax.GradientTransformationExtraArgs(
        init_fn, checked(name, state_type, update_fn, lambda s: s.mu)
    )


# ------------------------------------------------------------------------ 1-bit Adam


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
            m = compressed_allreduce(b1 m + (1 - b1) g_i)   (all leaves fused)
            m = m * momentum_mask                           (if given)
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
    h = _hyper(learning_rate, collective, freeze_step, b1, b2, eps, weight_decay, momentum_mask)
    rate = lambda step: [jnp.asarray(-step.lr, jnp.float32)] * len(step.grads)  # both stages
    return _two_stage(
        "onebit_adam",
        OneBitAdamState,
        h,
        init=lambda params, zeros: {},
        warmup=lambda state, step: (state, rate(step)),
        scales=lambda state, step: (state, None),
        compressed=lambda state, mu_last, step: (state, rate(step)),
    )


# ------------------------------------------------------------------------ 1-bit LAMB


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
        m = compressed_allreduce(m) / scale_l      (all layers fused: one exchange)
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
    h = _hyper(learning_rate, collective, freeze_step, b1, b2, eps, weight_decay, momentum_mask)
    for name, value, high in [
        ("max_coeff", max_coeff, np.inf),
        ("min_coeff", min_coeff, np.inf),
        ("coeff_beta", coeff_beta, 1.0),
        ("factor_max", factor_max, np.inf),
        ("factor_min", factor_min, np.inf),
        ("factor_threshold", factor_threshold, np.inf),
    ]:
        _check_range(name, value, 0.0, high, high_open=True)
    _check_order("min_coeff", min_coeff, "max_coeff", max_coeff)
    _check_order("factor_min", factor_min, "factor_max", factor_max)
    leaves = jax.tree.leaves
    # Without weight decay rho is 1 whatever the norms: skip the passes that take them.
    decays = concrete_float(weight_decay) != 0

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
            sizes = [math.sqrt(max(worker_size(m, collective), 1)) for m in mu]
            r = [x / k for x, k in zip(_norms(mu, collective), sizes)]
            united = sum(r) / len(r)
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
            raw.append(jnp.max(_on_its_own(denom / (jnp.sqrt(fresh[-1]) + eps))))
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
            rate.append(-step.lr * avg * f)
            factors.append(f)
        return state._replace(nu_fresh=step.tree(fresh), last_factor=step.tree(factors)), rate

    return _two_stage(
        "onebit_lamb",
        OneBitLambState,
        h,
        init=init,
        warmup=warmup,
        scales=scales,
        compressed=compressed,
    )
