"""The shared part of 1-bit Adam (`shoal.optim.onebit_adam`) and 1-bit LAMB
(`shoal.optim.onebit_lamb`): their states, hyper-parameter checks and the two-stage
transformation whose momentum crosses the wire as signs, through the error-compensated
all-reduce of `shoal.comms.OneBit`.

Both run in two stages on a rank-uniform step counter ``t = 1, 2, ...`` (a real
in-place branch, `run_if`, so each step runs only its own collectives):

* warm-up, ``t <= freeze_step``: the optimizer on the all-reduced gradient (Adam or
  LAMB, no bias correction); at ``t == freeze_step`` the second moment ``v`` is frozen;
* compression, ``t > freeze_step``: each worker adds its local gradient to the momentum,
  the momenta of all leaves, fused into one buffer, are averaged by one compressed
  all-reduce (about 1 bit per element each way), and the update uses the frozen ``v``.

Every piece of state (moments, frozen and fresh variance, LAMB coefficients and scales,
worker and server errors) is in the optax state, so a checkpoint resumes exactly. ``m``,
``v``, ``v_fresh`` and the layer scales come from the exchanges alone and are the same
on every worker. Simulated workers hold one copy of the moments between them, a chunk
each (`shoal.optim._held.Held`; `onebit_moments` reads them whole), so a step reads and
writes one copy, not N (1-bit LAMB's compression stage at 1.05M params x 16: 1.80x local
SGD's step -> 1.44x, side by side in one process; 1.39x at x 64).
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

from shoal.checks import check_int
from shoal.comms.agreement import check_same_structure
from shoal.comms.codecs import OneBit, tree_mean
from shoal.comms.collective import Collective
from shoal.comms.shards import check_sharded_alike
from shoal.comms.wire import WireCount, WireMeter
from shoal.optim._held import Held
from shoal.optim._inplace import run_if
from shoal.optim._validation import (
    check_collective,
    check_floating_leaves,
    checked,
    concrete_float,
    require_params,
)

__all__ = ["OneBitAdamState", "OneBitLambState", "onebit_moments"]


class OneBitAdamState(NamedTuple):
    """State of `onebit_adam`.

    Attributes:
      count: int32 steps taken.
      mu: float32 momentum ``m``, the same on every worker: param-shaped, or on simulated
        workers one chunk per worker (`onebit_moments` reads it whole).
      nu: float32 second moment ``v``, frozen after ``freeze_step``; held as ``mu``.
      worker_error, server_error: float32 error feedback of the compressed all-reduce.
      wire: bytes of the most recent update and since init.
    """

    count: jax.Array
    mu: Any
    nu: Any
    worker_error: jax.Array
    server_error: jax.Array
    wire: WireMeter

    ERROR_FEEDBACK = ("worker_error", "server_error")  # `shoal.optim.helpers.error_feedback_mask`


class OneBitLambState(NamedTuple):
    """State of `onebit_lamb`.

    Attributes:
      count: int32 steps taken.
      mu: float32 momentum ``m``, the same on every worker: param-shaped, or on simulated
        workers one chunk per worker (`onebit_moments` reads it whole).
      nu: float32 second moment ``v``, frozen after ``freeze_step``; held as ``mu``.
      nu_fresh: float32 ``v_fresh``, tracked from the reconstructed gradients of the
        compression stage (a copy of ``v`` at ``freeze_step``); held as ``mu``.
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

    ERROR_FEEDBACK = ("worker_error", "server_error")  # `shoal.optim.helpers.error_feedback_mask`


# --------------------------------------------------------------------------- checks


def check_range(name, value, low, high, *, low_open=False, high_open=False):
    v = concrete_float(value)
    if v is None:
        return
    ok = np.isfinite(v) or (high == np.inf and not high_open and v == np.inf)
    ok = ok and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")


def check_order(low_name, low, high_name, high):
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


class Hyper(NamedTuple):
    learning_rate: optax.ScalarOrSchedule
    collective: Collective
    freeze_step: int
    b1: float
    b2: float
    eps: float
    weight_decay: float
    momentum_mask: Any

    @property
    def decays(self) -> bool:
        """Whether the update adds weight decay (a traced weight decay may be non-zero):
        without it the params are not read at all (``0 * w`` would still be a pass)."""
        return concrete_float(self.weight_decay) != 0


def hyper(learning_rate, collective, freeze_step, b1, b2, eps, weight_decay, mask) -> Hyper:
    """The hyper-parameters both algorithms share, checked."""
    check_collective(collective)
    check_int("freeze_step", freeze_step, 1)
    if not callable(learning_rate):
        check_range("learning_rate", learning_rate, 0.0, np.inf, high_open=True)
    check_range("b1", b1, 0.0, 1.0, high_open=True)
    check_range("b2", b2, 0.0, 1.0, high_open=True)
    check_range("eps", eps, 0.0, np.inf, low_open=True, high_open=True)
    check_range("weight_decay", weight_decay, 0.0, np.inf, high_open=True)
    return Hyper(learning_rate, collective, freeze_step, b1, b2, eps, weight_decay, mask)


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


def _numel(tree) -> int:
    return sum(math.prod(jnp.shape(x)) for x in jax.tree.leaves(tree))


def two_stage(name, state_type, h: Hyper, *, init, warmup, scales, compressed, held=("mu", "nu")):
    """The transformation both algorithms share; each supplies its own rules:

    * ``init(params, zeros)``: its own state fields, as a dict (``zeros``: as `Held`
      holds a moment);
    * ``warmup(state, step)``: from the state with the new ``mu`` and ``nu``, the new
      state and the per-leaf ``rate`` of the update ``rate (m / (sqrt(v) + eps) +
      weight_decay p)``;
    * ``scales(state, step)``: the state and the per-leaf momentum scales (None: none);
    * ``compressed(state, mu_last, step)``: as ``warmup``, after the exchange.

    The rules see the fields named in ``held`` whole (param-shaped, the same on every
    worker); the state holds them as `Held` says.
    """
    b1, b2, collective, size = h.b1, h.b2, h.collective, h.collective.size
    codec = OneBit()

    def init_fn(params):
        check_same_structure(params, collective)
        check_floating_leaves("params", params)
        _check_mask(h.momentum_mask, params)
        zeros = Held.of(collective).zeros(params)
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
        layout = Held.of(collective)
        layout.check(name, state.mu, updates)
        leaves, treedef = jax.tree.flatten(updates)
        check_sharded_alike(name, leaves, collective)
        lr = h.learning_rate(state.count) if callable(h.learning_rate) else h.learning_rate
        count = collective.uniform(state.count)
        step = _Step(_f32(leaves), _f32(treedef.flatten_up_to(params)), count, lr, treedef)
        mask = h.momentum_mask
        mask = None if mask is None else _f32(treedef.flatten_up_to(mask))

        # The moments come from the exchanges alone, the same on every worker: a stage
        # reads them whole (one copy for simulated workers) and writes back what it changed.
        def whole(state):
            load = lambda f: step.tree(layout.load(jax.tree.leaves(getattr(state, f)), step.grads))
            return state._replace(**{f: load(f) for f in held})

        def kept(state, old, new):
            store = lambda f: step.tree(layout.store(jax.tree.leaves(getattr(new, f))))
            same = lambda f: getattr(new, f) is getattr(old, f)
            return new._replace(**{f: getattr(state, f) if same(f) else store(f) for f in held})

        # Each stage rewrites the carry, (state, rate, wire), in place (`run_if`).
        def warmup_stage(carry):
            g, _, nbytes = tree_mean(updates, collective=collective)
            g = _f32(jax.tree.leaves(g))
            old = whole(carry[0])
            mu = [b1 * m + (1 - b1) * x for m, x in zip(jax.tree.leaves(old.mu), g)]
            nu = [b2 * v + (1 - b2) * x * x for v, x in zip(jax.tree.leaves(old.nu), g)]
            state, rate = warmup(old._replace(mu=step.tree(mu), nu=step.tree(nu)), step)
            return kept(carry[0], old, state), rate, WireCount.of(*nbytes)

        def compressed_stage(carry):
            old = whole(carry[0])
            state, k = scales(old, step)
            mu_last = jax.tree.leaves(old.mu)
            local = [b1 * m + (1 - b1) * x for m, x in zip(mu_last, step.grads)]
            if k is not None:
                k = collective.uniform(k)
                local = [x * s for x, s in zip(local, jax.tree.leaves(k))]
            errors = (state.worker_error, state.server_error)
            mu, errors, nbytes = tree_mean(local, errors, collective=collective, exchange=codec)
            if k is not None:
                mu = [m / s for m, s in zip(mu, jax.tree.leaves(k))]
            if mask is not None:
                mu = [m * z for m, z in zip(mu, mask)]
            state = state._replace(mu=step.tree(mu), worker_error=errors[0], server_error=errors[1])
            state, rate = compressed(state, mu_last, step)
            return kept(carry[0], old, state), rate, WireCount.of(*nbytes)

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
        mu, nu = (layout.load(jax.tree.leaves(x), step.grads) for x in (state.mu, state.nu))

        def rule(m, v, w):
            u = m / (jnp.sqrt(v) + h.eps)
            return u + h.weight_decay * w if h.decays else u

        out = [
            (r * rule(m, v, w)).astype(x.dtype)
            for r, m, v, w, x in zip(rate, mu, nu, step.params, leaves)
        ]
        state = state._replace(count=state.count + 1, wire=state.wire.record(wire))
        return treedef.unflatten(out), state

    return optax.GradientTransformationExtraArgs(init_fn, checked(name, state_type, update_fn))


def onebit_moments(
    state: OneBitAdamState | OneBitLambState, like: Any, *, collective: Collective
) -> dict[str, Any]:
    """The moments of a 1-bit Adam or LAMB state whole, however the state holds them.

    Param-shaped trees, the same on every worker; on simulated workers each worker holds
    one chunk of them (`Held`), and this gathers them (no copy under vmap). Call it where
    the transformation's ``update`` runs (inside the workers' vmap or shard_map).

    Args:
      state: a `OneBitAdamState` or `OneBitLambState`.
      like: a tree of the params' shapes (the params, or the gradient).
      collective: the transformation's collective.

    Returns:
      ``{"mu": m, "nu": v}``, with ``"nu_fresh"`` for 1-bit LAMB.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import onebit_adam, onebit_moments
      >>> coll = AxisCollective("workers", 2)
      >>> tx = onebit_adam(0.1, collective=coll, freeze_step=1, b1=0.5)
      >>> def step(p, g):
      ...     _, state = tx.update(g, tx.init(p), p)  # m = 0.5 mean_i g_i
      ...     return state.mu, onebit_moments(state, p, collective=coll)["mu"]
      >>> grads = jnp.array([[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]])
      >>> held, m = jax.vmap(step, axis_name="workers")(jnp.zeros((2, 3)), grads)
      >>> held.shape  # each of the 2 simulated workers holds 2 of the 3 (padded to 4)
      (2, 2)
      >>> print(m)
      [[1.  1.5 2. ]
       [1.  1.5 2. ]]

    References:
      H. Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with
      Adam's Convergence Speed", ICML 2021, Algorithm 1 (``m``, ``v``).
    """
    layout = Held.of(collective)
    fields = ("mu", "nu", "nu_fresh") if isinstance(state, OneBitLambState) else ("mu", "nu")
    shapes, treedef = jax.tree.flatten(like)
    return {
        f: treedef.unflatten(layout.load(jax.tree.leaves(getattr(state, f)), shapes))
        for f in fields
    }
