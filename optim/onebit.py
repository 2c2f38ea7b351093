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
Unlike the DeepSpeed implementation, the first step is a real step.

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

from shoal.comms.agreement import check_same_structure
from shoal.comms.collective import Collective
from shoal.comms.compressed import (
    compressed_allreduce,
    compressed_allreduce_bytes,
    compressed_allreduce_init,
)
from shoal.comms.shards import check_sharded_alike, worker_max, worker_size, worker_sums
from shoal.comms.wire import WireCount, WireMeter, all_reduce_bytes, tree_nbytes
from shoal.optim.inplace import run_if
from shoal.optim.nonfinite import check_nonfinite, guard
from shoal.optim.validation import (
    check_collective,
    check_floating_leaves,
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
      skipped: int32 steps skipped for a non-finite gradient (`shoal.optim.nonfinite`).
      wire: bytes of the most recent update and since init.
    """

    count: jax.Array
    mu: Any
    nu: Any
    worker_error: jax.Array
    server_error: jax.Array
    skipped: jax.Array
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
      skipped: int32 steps skipped for a non-finite gradient (`shoal.optim.nonfinite`).
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
    skipped: jax.Array
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


def _check_common(learning_rate, collective, freeze_step, b1, b2, eps, weight_decay):
    check_collective(collective)
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, (int, np.integer)):
        raise ValueError(f"freeze_step must be an int >= 1, got {freeze_step!r}")
    if freeze_step < 1:
        raise ValueError(f"freeze_step must be an int >= 1, got {freeze_step!r}")
    if not callable(learning_rate):
        _check_range("learning_rate", learning_rate, 0.0, np.inf, high_open=True)
    _check_range("b1", b1, 0.0, 1.0, high_open=True)
    _check_range("b2", b2, 0.0, 1.0, high_open=True)
    _check_range("eps", eps, 0.0, np.inf, low_open=True, high_open=True)
    _check_range("weight_decay", weight_decay, 0.0, np.inf, high_open=True)


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


# ----------------------------------------------------------------------- machinery


def _f32(leaves):
    return [jnp.asarray(x, jnp.float32) for x in leaves]


def _norms(xs, collective):
    """The norm of each array in ``xs``, of the whole leaf: a worker that spans devices
    sums its shards' squares, in one collective for all (`shoal.comms.shards`)."""
    return [jnp.sqrt(q) for q in worker_sums([jnp.sum(x * x) for x in xs], collective)]


def _numel(params) -> int:
    return sum(math.prod(jnp.shape(p)) for p in jax.tree.leaves(params))


def _compressed_mean(leaves, worker_error, server_error, collective):
    """The mean over workers of per-leaf float32 arrays through one fused compressed
    all-reduce (leaves concatenated in ``jax.tree_util.tree_leaves`` order)."""
    flat = jnp.concatenate([x.ravel() for x in leaves])
    flat, worker_error, server_error = compressed_allreduce(
        flat, worker_error, server_error, collective=collective
    )
    out, start = [], 0
    for x in leaves:
        out.append(flat[start : start + x.size].reshape(x.shape))
        start += x.size
    return out, worker_error, server_error


def _warmup_wire(grads, size):
    return WireCount.of(*all_reduce_bytes(tree_nbytes(grads), size))


def _apply_mask(mu, mask_leaves):
    if mask_leaves is None:
        return mu
    return [m * jnp.asarray(k, jnp.float32) for m, k in zip(mu, mask_leaves)]


def _lr(learning_rate, count):
    return learning_rate(count) if callable(learning_rate) else learning_rate


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
    nonfinite: str | None = "skip",
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
      nonfinite: ``"skip"``, ``"raise"`` or None (`shoal.optim.nonfinite`).

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
    _check_common(learning_rate, collective, freeze_step, b1, b2, eps, weight_decay)
    check_nonfinite(nonfinite)
    size = collective.size

    def init_fn(params):
        check_same_structure(params, collective)
        check_floating_leaves("params", params)
        _check_mask(momentum_mask, params)
        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        worker_error, server_error = compressed_allreduce_init(max(_numel(params), 1), size)
        return OneBitAdamState(
            count=jnp.zeros((), jnp.int32),
            mu=zeros,
            nu=zeros,
            worker_error=worker_error,
            server_error=server_error,
            skipped=jnp.zeros((), jnp.int32),
            wire=WireMeter.zero(),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        require_params("onebit_adam", params)
        check_floating_leaves("updates", updates)
        leaves, treedef = jax.tree.flatten(updates)
        check_sharded_alike("onebit_adam", leaves, collective)
        p = _f32(treedef.flatten_up_to(params))
        mu, nu = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
        mask = None if momentum_mask is None else treedef.flatten_up_to(momentum_mask)
        n = _numel(updates)
        c_bytes = compressed_allreduce_bytes(max(n, 1), size)

        # Each stage rewrites the carry in place (`run_if`, like every rank-uniform branch).
        def warmup(carry):
            mu, nu, we, se, _ = carry
            g = _f32(collective.all_reduce(leaves, "mean"))
            new_mu = [b1 * m + (1 - b1) * x for m, x in zip(mu, g)]
            new_nu = [b2 * v + (1 - b2) * x * x for v, x in zip(nu, g)]
            return new_mu, new_nu, we, se, _warmup_wire(updates, size)

        def compressed(carry):
            mu, nu, we, se, _ = carry
            local = [b1 * m + (1 - b1) * x for m, x in zip(mu, _f32(leaves))]
            new_mu, we, se = _compressed_mean(local, we, se, collective)
            return _apply_mask(new_mu, mask), nu, we, se, WireCount.of(*c_bytes)

        carry = (mu, nu, state.worker_error, state.server_error, WireCount.zero())
        if n == 0:
            new = warmup(carry)
        else:
            # The stage is the same on every worker: a real branch (not both stages) under vmap.
            stage = collective.uniform(state.count) < freeze_step
            new = run_if(~stage, compressed, run_if(stage, warmup, carry))
        new_mu, new_nu, we, se, wire = new
        lr = _lr(learning_rate, state.count)
        out = [
            (-lr * (m / (jnp.sqrt(v) + eps) + weight_decay * w)).astype(x.dtype)
            for m, v, w, x in zip(new_mu, new_nu, p, leaves)
        ]
        new_state = OneBitAdamState(
            count=state.count + 1,
            mu=treedef.unflatten(new_mu),
            nu=treedef.unflatten(new_nu),
            worker_error=we,
            server_error=se,
            skipped=state.skipped,
            wire=state.wire.record(wire),
        )
        return treedef.unflatten(out), new_state

    guarded = guard(update_fn, nonfinite, collective, needs_params="onebit_adam")
    return optax.GradientTransformationExtraArgs(
        init_fn, checked("onebit_adam", OneBitAdamState, guarded, lambda s: s.mu)
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
    nonfinite: str | None = "skip",
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
      nonfinite: ``"skip"``, ``"raise"`` or None (`shoal.optim.nonfinite`).

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
    _check_common(learning_rate, collective, freeze_step, b1, b2, eps, weight_decay)
    check_nonfinite(nonfinite)
    _check_range("max_coeff", max_coeff, 0.0, np.inf, high_open=True)
    _check_range("min_coeff", min_coeff, 0.0, np.inf, high_open=True)
    _check_range("coeff_beta", coeff_beta, 0.0, 1.0, high_open=True)
    _check_range("factor_max", factor_max, 0.0, np.inf, high_open=True)
    _check_range("factor_min", factor_min, 0.0, np.inf, high_open=True)
    _check_range("factor_threshold", factor_threshold, 0.0, np.inf, high_open=True)
    lo, hi = concrete_float(min_coeff), concrete_float(max_coeff)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"min_coeff ({min_coeff}) must not exceed max_coeff ({max_coeff})")
    lo, hi = concrete_float(factor_min), concrete_float(factor_max)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"factor_min ({factor_min}) must not exceed factor_max ({factor_max})")
    size = collective.size

    def init_fn(params):
        check_same_structure(params, collective)
        check_floating_leaves("params", params)
        _check_mask(momentum_mask, params)
        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        scalar = lambda value: jax.tree.map(lambda _: jnp.full((), value, jnp.float32), params)
        worker_error, server_error = compressed_allreduce_init(max(_numel(params), 1), size)
        return OneBitLambState(
            count=jnp.zeros((), jnp.int32),
            mu=zeros,
            nu=zeros,
            nu_fresh=zeros,
            coeff_avg=scalar(0.0),
            last_factor=scalar(1.0),
            scale=scalar(1.0),
            worker_error=worker_error,
            server_error=server_error,
            skipped=jnp.zeros((), jnp.int32),
            wire=WireMeter.zero(),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        require_params("onebit_lamb", params)
        check_floating_leaves("updates", updates)
        leaves, treedef = jax.tree.flatten(updates)
        check_sharded_alike("onebit_lamb", leaves, collective)
        p = _f32(treedef.flatten_up_to(params))
        s = [treedef.flatten_up_to(x) for x in state[1:7]]  # mu ... scale
        mu, nu, nu_fresh, coeff_avg, last_factor, scale = s
        mask = None if momentum_mask is None else treedef.flatten_up_to(momentum_mask)
        n = _numel(updates)
        c_bytes = compressed_allreduce_bytes(max(n, 1), size)
        t = state.count + 1
        lr = _lr(learning_rate, state.count)

        # Each stage rewrites the carry in place (`run_if`, like every rank-uniform branch).
        def warmup(carry):
            _, mu, nu, nu_fresh, coeff_avg, last_factor, scale, we, se, _ = carry
            g = _f32(collective.all_reduce(leaves, "mean"))
            new_mu = [b1 * m + (1 - b1) * x for m, x in zip(mu, g)]
            new_nu = [b2 * v + (1 - b2) * x * x for v, x in zip(nu, g)]
            us = [m / (jnp.sqrt(v) + eps) + weight_decay * w for m, v, w in zip(new_mu, new_nu, p)]
            norms = _norms([*p, *us], collective)
            out, new_avg = [], []
            for u, w_norm, u_norm, avg in zip(us, norms[: len(p)], norms[len(p) :], coeff_avg):
                ok = (w_norm > 0) & (u_norm > 0)
                ratio = jnp.clip(w_norm / jnp.where(ok, u_norm, 1.0), min_coeff, max_coeff)
                coeff = jnp.where(ok, ratio, 1.0)
                new_avg.append(
                    jnp.where(coeff != 1, coeff_beta * avg + (1 - coeff_beta) * coeff, avg)
                )
                out.append(-lr * coeff * u)
            fresh = [jnp.where(t == freeze_step, v, f) for v, f in zip(new_nu, nu_fresh)]
            wire = _warmup_wire(updates, size)
            return (
                out, new_mu, new_nu, fresh, new_avg, last_factor, scale, we, se, wire,
            )  # fmt: skip

        def compressed(carry):
            _, mu, nu, nu_fresh, coeff_avg, last_factor, scale, we, se, _ = carry
            # Scales from the warm-up momentum, once: they even out the layers' momentum
            # magnitudes so one shared 1-bit scale does not drown the small layers.
            sizes = [math.sqrt(max(worker_size(m, collective), 1)) for m in mu]
            r = [x / k for x, k in zip(_norms(mu, collective), sizes)]
            united = sum(r) / len(r)
            fresh_scale = [jnp.where(x > 0, united / jnp.where(x > 0, x, 1.0), 1.0) for x in r]
            first = t == freeze_step + 1
            sc = [jnp.where(first, a, b) for a, b in zip(fresh_scale, scale)]
            local = [(b1 * m + (1 - b1) * x) * k for m, x, k in zip(mu, _f32(leaves), sc)]
            new_mu, we, se = _compressed_mean(local, we, se, collective)
            new_mu = _apply_mask([m / k for m, k in zip(new_mu, sc)], mask)
            fresh, u_pres, us, raw = [], [], [], []
            for m, m_last, v, vf, w in zip(new_mu, mu, nu, nu_fresh, p):
                g_rec = (m - b1 * m_last) / (1 - b1)
                vf = b2 * vf + (1 - b2) * g_rec * g_rec
                denom = jnp.sqrt(v) + eps
                u_pres.append(m / denom)
                us.append(u_pres[-1] + weight_decay * w)
                raw.append(jnp.max(denom / (jnp.sqrt(vf) + eps)))
                fresh.append(vf)
            # The worker's norms and maxima, each in one collective when it spans devices.
            norms = _norms([*us, *u_pres], collective)
            raw = worker_max(jnp.stack(raw), collective)
            out, factors = [], []
            for i, (u, avg, f_last) in enumerate(zip(us, coeff_avg, last_factor)):
                u_norm, pre_norm, f = norms[i], norms[len(us) + i], raw[i]
                ratio = pre_norm / jnp.where(u_norm > 0, u_norm, 1)
                rho = jnp.where(u_norm > 0, jnp.minimum(1.0, ratio), 1)
                f = jnp.where(weight_decay > 0, f * rho + (1 - rho), f)
                f = jnp.clip(f, factor_min, factor_max)
                f = jnp.clip(f, f_last * (1 - factor_threshold), f_last * (1 + factor_threshold))
                out.append(-lr * avg * f * u)
                factors.append(f)
            return (
                out, new_mu, nu, fresh, coeff_avg, factors, sc, we, se,
                WireCount.of(*c_bytes),
            )  # fmt: skip

        carry = (_f32(leaves), *s, state.worker_error, state.server_error, WireCount.zero())
        if n == 0:
            new = warmup(carry)
        else:
            # The stage is the same on every worker: a real branch (not both stages) under vmap.
            stage = collective.uniform(state.count) < freeze_step
            new = run_if(~stage, compressed, run_if(stage, warmup, carry))
        out, *trees, we, se, wire = new
        trees = [treedef.unflatten([jnp.asarray(x, jnp.float32) for x in tr]) for tr in trees]
        wire = state.wire.record(wire)
        new_state = OneBitLambState(state.count + 1, *trees, we, se, state.skipped, wire)
        out = [u.astype(x.dtype) for u, x in zip(out, leaves)]
        return treedef.unflatten(out), new_state

    guarded = guard(update_fn, nonfinite, collective, needs_params="onebit_lamb")
    return optax.GradientTransformationExtraArgs(
        init_fn, checked("onebit_lamb", OneBitLambState, guarded, lambda s: s.mu)
    )
