"""BMUF: blockwise model-update filtering (Chen & Huo 2016), as an Optax transformation.

Each of ``N`` workers runs an inner optimizer on its own data for ``block_size`` steps,
starting from the global model ``W_g(t-1)``; then one all-reduce and the BMUF step::

    Wbar(t)  = (1/N) sum_i W_i(t)                           (1)
    G(t)     = Wbar(t) - W_g(t-1)                           (2)
    Delta(t) = eta_t Delta(t-1) + zeta_t G(t)               (3)

after which every worker restarts from the new global model ``W_g(t)`` (below).

References:
  Chen & Huo, "Scalable training of deep learning machines by incremental block training
  with intra-block parallel optimization and blockwise model-update filtering",
  ICASSP 2016. Ladkat et al., "Two Tiered Distributed Training Algorithm for Acoustic
  Modeling", section 2.2, eqs. (1)-(5). Douillard et al., "DiLoCo: Distributed
  Low-Communication Training of Language Models", 2023.
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
from shoal.dtypes import apply_updates, promote_types
from shoal.optim._applying import applying_transformation
from shoal.optim._inplace import run_if
from shoal.optim._validation import (
    check_collective,
    check_floating_leaves,
    check_positive,
    concrete_float,
    require_params,
)

NBM_VARIANTS = ("seed", "chen_huo")


class BMUFState(NamedTuple):
    """State of `bmuf` (and `shoal.optim._bmuf_gtc.bmuf_gtc`).

    Attributes:
      inner_state: state of the per-step local optimizer (reset after each BMUF step when
        ``reset_inner_state``).
      global_params: ``W_g``, the model every worker (re)started the current block from.
      delta: ``Delta``, the block momentum buffer (zeros until the first BMUF step).
      filtered: ``W``, the filtered model without the Nesterov look-ahead (only with
        ``nesterov=True, nbm="chen_huo"``; None otherwise).
      step: int32 count of updates done (warm-up included).
      block: int32 count of BMUF steps done, the 0-based index of the next one.
      wire: bytes of this transformation's own collectives in the most recent update
        and since init.
    """

    inner_state: Any
    global_params: Any
    delta: Any
    filtered: Any
    step: jax.Array
    block: jax.Array
    wire: WireMeter

    # The same on every worker: simulated workers can hold them once
    # (`shoal.optim.helpers.uniform_axes`).
    RANK_UNIFORM = ("global_params", "delta", "filtered", "step", "block")


class GroupBMUFState(BMUFState):
    """`BMUFState` of BMUF over groups (`shoal.optim._bmuf_gtc.bmuf_gtc`): a group's
    members hold equal models, but each computes its own from its own params, so simulated
    workers hold every field per worker."""

    RANK_UNIFORM = ()


def bmuf(
    inner: optax.GradientTransformation,
    *,
    collective: Collective,
    block_size: int,
    block_lr: optax.ScalarOrSchedule = 1.0,
    block_momentum: optax.ScalarOrSchedule | None = None,
    nesterov: bool = True,
    nbm: str = "seed",
    warmup_steps: int = 0,
    reset_inner_state: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Blockwise model-update filtering (BMUF) around any optax optimizer ``inner``.

    Each of ``N`` workers runs ``inner`` on its own gradients for ``block_size`` steps,
    starting from the global model ``W_g(t-1)``; then one all-reduce and the BMUF step::

        Wbar(t)  = (1/N) sum_i W_i(t)                  (1) the average of the local models
        G(t)     = Wbar(t) - W_g(t-1)                  (2) the block's progress
        Delta(t) = eta_t Delta(t-1) + zeta_t G(t)      (3) the filtered update

    after which every worker restarts from the new global model ``W_g(t)`` (below).

    ``update(grads, state, params)`` returns updates such that
    ``optax.apply_updates(params, updates)`` is this worker's next model: the local
    step of ``inner`` on its own gradient, or, on every ``block_size``-th step, the new
    global model ``W_g(t)`` that all workers restart from (as ``W_g(t) - params``, so
    exact up to one rounding; ``state.global_params`` holds it exactly). Only that step
    communicates: one all-reduce of the param-sized ``W_i - W_g(t-1)`` inside a
    branch on the rank-uniform step counter (`run_if`, in place), ``2 (N - 1) / N`` times the param
    bytes each way in ``state.wire.step`` (0 on the other steps). With ``t`` the 1-based
    index of the BMUF step and eqs. (1)-(3) (``Delta(0) = 0``):

    * classic block momentum (``nesterov=False``)::

          W_g(t) = W_g(t-1) + Delta(t)

      i.e. heavy-ball ``optax.sgd(zeta, momentum=eta)`` on the outer gradient ``-G``.
    * Nesterov, ``nbm="seed"`` (the paper's eq. 4; fairseq's and CNTK's BMUF)::

          W_g(t) = W_g(t-1) + Delta(t) + eta_{t+1} Delta(t)

      ``W_g`` is the look-ahead restart point, and ``G`` is measured against it; the
      look-ahead is never taken back, so for constant ``eta`` this is heavy-ball with
      block learning rate ``(1 + eta) zeta``.
    * Nesterov, ``nbm="chen_huo"`` (two buffers, Chen & Huo's NBM)::

          W(t)   = W(t-1) + Delta(t)              (the filtered model, state.filtered)
          W_g(t) = W(t) + eta_{t+1} Delta(t)      (the look-ahead restart point)

      ``G`` is again measured against the restart point ``W_g(t-1)``. With constant
      ``zeta`` (outer learning rate) and ``eta`` (outer momentum) this is exactly
      DiLoCo's outer step, ``optax.sgd(zeta, momentum=eta, nesterov=True)`` applied to
      ``W_g(t-1)`` with the outer gradient ``W_g(t-1) - Wbar(t)`` (use
      ``reset_inner_state=False`` and an AdamW ``inner`` for DiLoCo itself). Evaluate
      the filtered model ``state.filtered``.

    Defaults follow eq. (5), ``zeta / (N (1 - eta)) = C`` with ``C = 1``: ``zeta = 1``,
    ``eta = 1 - zeta / N`` (``N = collective.size``, the number of models averaged).

    Start: ``W_g(0)`` is the ``params`` given to ``init``, so every worker must init
    from the same model, e.g. ``params = collective.broadcast(params, 0)`` first; see
    `shoal.optim.helpers.same_model_check`, which checks it (``shoal-run`` does).

    Local steps communicate nothing; `shoal.optim.skip_nonfinite` around it, which skips
    steps with a NaN/Inf gradient, all-reduces its 4-byte flag on every step.

    Args:
      inner: the local optimizer, any optax transformation (run every step on this
        worker's gradient; during warm-up on the mean gradient).
      collective: the workers whose models are averaged (`shoal.comms.Collective`).
      block_size: local steps per block (int >= 1).
      block_lr: ``zeta > 0``, a float or an optax schedule.
      block_momentum: ``eta`` in ``[0, 1)``, a float, a schedule, or None for
        ``1 - zeta_t / N``. Schedules of ``zeta`` and ``eta`` are called with the
        0-based index ``s = t - 1`` of the BMUF step (the count of BMUF steps done,
        like optax's count): ``zeta_t = block_lr(s)``, ``eta_t = block_momentum(s)``, and
        the look-ahead ``eta_{t+1} = block_momentum(s + 1)``.
      nesterov: Nesterov block momentum (NBM) or classic block momentum.
      nbm: ``"seed"`` or ``"chen_huo"``, the NBM variant (ignored when not nesterov).
      warmup_steps: steps of synchronous SGD (``inner`` on the all-reduced mean
        gradient, counted in ``state.wire``) before block training starts; ``W_g``
        (and ``W``) track the synchronised model, so the first block starts from it.
      reset_inner_state: after every BMUF step re-init ``inner``'s state (default, as
        CNTK's BMUF, ``resetSGDMomentum`` / ``reset_sgd_momentum_after_aggregation``,
        both true by default) instead of keeping it (DiLoCo, with an AdamW ``inner``).
        Keep the default with a momentum ``inner``: the local momentum was built
        against the old model, and carried across the restart it is added on top of
        the block momentum. Measured on 8 simulated workers (MLP 16-64-4 on a
        Gaussian-mixture task, batch 32 per worker, 1000 steps,
        ``optax.sgd(0.05, momentum=0.9)``, ``block_size=10``, default ``eta = 7/8``):
        reset gave test loss 0.061 and accuracy 99.4%; keeping it diverged (largest
        training loss 1.1e9, test loss 4.6e8). Plain SGD has no state to keep
        (test loss 0.012 either way). Pass False for DiLoCo-style training.

    With ``optax.inject_hyperparams``, pass ``static_args=("block_size", "nesterov",
    "nbm", "warmup_steps", "reset_inner_state")``; ``block_lr`` and ``block_momentum``
    may then be injected.

    A training step that applies the update itself should take it with
    ``params, state = shoal.optim.update_and_apply(tx, grads, state, params)``: the
    parameters then ride in the BMUF step's in-place branch, so a local step is the one
    pass ``params + u`` (the update is never written out and read back) and the restart
    is ``W_g(t)`` itself. Under vmap at 1M parameters x 16 workers a local step then costs
    1.02-1.08x a local-SGD step, against 1.10-1.13x (`benchmarks/sim_scale.py`).

    Returns:
      an `shoal.optim.ApplyingTransformation` (an
      ``optax.GradientTransformationExtraArgs``) whose ``init(params)`` returns a
      `BMUFState` and whose ``update(updates, state, params)`` returns ``(updates,
      new_state)``; ``optax.apply_updates(params, updates)`` is this worker's next model.
      Its ``apply_step`` is what `shoal.optim.update_and_apply` calls.

    Example:
      Two workers, one block of two local SGD steps towards different targets; the
      BMUF step (``zeta = 1``, ``eta = 1 - 1/2``, Nesterov look-ahead) moves both to
      ``W_g = 1.5 + 0.5 * 1.5``:

      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from shoal.comms import AxisCollective
      >>> coll = AxisCollective("workers", 2)
      >>> from shoal.optim import bmuf
      >>> tx = bmuf(optax.sgd(0.5), collective=coll, block_size=2)
      >>> def train(params, target):
      ...     state = tx.init(params)
      ...     for _ in range(2):  # one block: two local steps, then the BMUF step
      ...         grads = params - target  # gradient of 0.5 |params - target|^2
      ...         updates, state = tx.update(grads, state, params)
      ...         params = optax.apply_updates(params, updates)
      ...     return params
      >>> start = jnp.zeros((2, 1))  # both workers start from the same model
      >>> print(jax.vmap(train, axis_name="workers")(start, jnp.array([[1.0], [3.0]])))
      [[2.25]
       [2.25]]

    References:
      Chen & Huo, "Scalable training of deep learning machines by incremental block
      training with intra-block parallel optimization and blockwise model-update
      filtering", ICASSP 2016. Ladkat et al., "Two Tiered Distributed Training Algorithm
      for Acoustic Modeling", section 2.2, eqs. (1)-(5). Douillard et al., "DiLoCo:
      Distributed Low-Communication Training of Language Models", 2023.
    """
    inner = optax.with_extra_args_support(inner)
    reset = (lambda inner_state, params: inner.init(params)) if reset_inner_state else None
    return block_update_filtering(
        inner,
        collective=collective,
        block_size=block_size,
        block_lr=block_lr,
        block_momentum=block_momentum,
        nesterov=nesterov,
        nbm=nbm,
        warmup_steps=warmup_steps,
        reset_local_state=reset,
    )


def block_update_filtering(
    local: optax.GradientTransformationExtraArgs,
    *,
    collective: Collective,
    block_size: int,
    block_lr: optax.ScalarOrSchedule,
    block_momentum: optax.ScalarOrSchedule | None,
    nesterov: bool,
    nbm: str,
    warmup_steps: int = 0,
    reset_local_state: Callable[[Any, Any], Any] | None = None,
    all_workers: tuple[Collective, ...] | None = None,
    name: str = "bmuf",
) -> optax.GradientTransformationExtraArgs:
    """The BMUF core shared by `bmuf` and `bmuf_gtc`: ``local`` (which may communicate,
    e.g. GTC inside a group) makes every step; every ``block_size`` steps the models
    are filtered over ``collective``. ``reset_local_state(state, W_g)`` is applied to
    ``local``'s state after each BMUF step (None: keep it). ``all_workers`` (default
    ``(collective,)``) span every worker: the step counter is uniform over them."""
    check_collective(collective)
    check_int("block_size", block_size, 1)
    check_int("warmup_steps", warmup_steps, 0)
    if nbm not in NBM_VARIANTS:
        raise ValueError(f"nbm must be one of {NBM_VARIANTS}, got {nbm!r}")
    n_models = collective.size
    zeta_fn = _schedule("block_lr", block_lr, check_positive)
    if block_momentum is None:
        lr = None if callable(block_lr) else concrete_float(block_lr)
        if lr is not None:
            _check_block_momentum("block_momentum", 1.0 - lr / n_models, default=True)
        eta_fn = lambda s: 1.0 - zeta_fn(s) / n_models  # eq. (5) with C = 1
    else:
        eta_fn = _schedule("block_momentum", block_momentum, _check_block_momentum)
    two_buffers = nesterov and nbm == "chen_huo"
    state_type = BMUFState if all_workers is None else GroupBMUFState

    def init_fn(params):
        check_same_structure(params, collective)
        check_floating_leaves("params", params)
        return state_type(
            inner_state=local.init(params),
            global_params=jax.tree.map(jnp.array, params),
            delta=jax.tree.map(jnp.zeros_like, params),
            filtered=jax.tree.map(jnp.array, params) if two_buffers else None,
            step=jnp.zeros((), jnp.int32),
            block=jnp.zeros((), jnp.int32),
            wire=WireMeter.zero(),
        )

    workers = all_workers if all_workers is not None else (collective,)

    def step_fn(updates, state, params, apply, **extra_args):
        """The update (``apply=False``) or the new params (``apply=True``) and the state.

        Applied here, the params are the in-place carry of the BMUF step's branch: a
        local step is then one pass ``params + local update``, where the update alone
        would be written out for the branch and read back to be applied."""
        require_params(name, params)
        # The step counter is the same on every worker: branch on it (a local step then
        # costs a local step under vmap too, instead of a select over every branch).
        step = uniform_over(workers, state.step)
        in_warmup = step < warmup_steps
        if warmup_steps:
            updates = run_if(in_warmup, lambda g: collective.all_reduce(g, "mean"), updates)
        local_updates, local_state = local.update(updates, state.inner_state, params, **extra_args)
        first = apply_updates(params, local_updates) if apply else local_updates
        # This worker's model after its local step.
        local_model = (lambda out: out) if apply else (lambda out: apply_updates(params, out))

        # Each step below rewrites the carry in place (`run_if`): a local step leaves the
        # global model, delta and filtered buffers untouched instead of copying them.
        def warmup_step(carry):
            # Warm-up is S-SGD, so the new local model is the same on every worker: W_g (and
            # W) track it and the first block starts from the synchronised model.
            out, local_state, w_g, delta, filtered, block, _ = carry
            tracked = _cast_like(local_model(out), w_g)
            filtered = tracked if two_buffers else filtered
            wire = WireCount.of(*all_reduce_bytes(tree_nbytes(updates), n_models))
            return out, local_state, tracked, delta, filtered, block, wire

        def block_step(carry):
            out, local_state, w_g, delta, filtered, s, _ = carry
            zeta, eta, eta_next = zeta_fn(s), eta_fn(s), eta_fn(s + 1)
            new_local = local_model(out)
            # All-reduce the block's progress rather than the models: same bytes, and the
            # mean of small differences loses less precision than a difference of means.
            g = collective.all_reduce(jax.tree.map(jnp.subtract, new_local, w_g), "mean")
            delta = _lin(eta, delta, zeta, g)
            if not nesterov:
                w_g = _lin(1.0, w_g, 1.0, delta)
            elif nbm == "seed":
                w_g = _lin(1.0, _lin(1.0, w_g, 1.0, delta), eta_next, delta)
            else:
                filtered = _lin(1.0, filtered, 1.0, delta)
                w_g = _lin(1.0, filtered, eta_next, delta)
            if apply:
                restart = _cast_like(w_g, out)
            else:
                restart = jax.tree.map(lambda w, p, u: (w - p).astype(u.dtype), w_g, params, out)
            if reset_local_state is not None:
                local_state = _cast_like(reset_local_state(local_state, w_g), local_state)
            wire = WireCount.of(*all_reduce_bytes(tree_nbytes(params), n_models))
            return restart, local_state, w_g, delta, filtered, s + 1, wire

        k = step + 1 - warmup_steps  # steps into block training, this one included
        is_sync = (k >= 1) & (k % block_size == 0)
        carry = (
            first,
            local_state,
            state.global_params,
            state.delta,
            state.filtered,
            state.block,
            WireCount.zero(),
        )
        carry = run_if(is_sync, block_step, carry)
        if warmup_steps:
            carry = run_if(in_warmup, warmup_step, carry)
        out, local_state, w_g, delta, filtered, block, wire = carry
        wire = state.wire.record(wire)  # this update's bytes, added to the total
        new_state = state_type(local_state, w_g, delta, filtered, state.step + 1, block, wire)
        return out, new_state

    # BMUFState: what misuse errors name, and what a GroupBMUFState is too.
    return applying_transformation(name, BMUFState, init_fn, step_fn, lambda s: s.delta)


def _lin(a, x, b, y):
    """``a x + b y`` leaf-wise, kept in ``x``'s dtype: computed in the promoted dtype of the
    four (a schedule's float32 with bfloat16 leaves: float32), with the casts explicit."""

    def one(u, v):
        wide = promote_types(a, u, b, v)
        a_, u_, b_, v_ = (jnp.asarray(t).astype(wide) for t in (a, u, b, v))
        return (a_ * u_ + b_ * v_).astype(u.dtype)

    return jax.tree.map(one, x, y)


def _cast_like(tree, like):
    # A branch must return its carry's dtypes exactly (weak types included).
    return jax.tree.map(lambda x, ref: jnp.asarray(x).astype(jnp.result_type(ref)), tree, like)


def _check_block_momentum(name: str, value: Any, default: bool = False) -> None:
    v = concrete_float(value)
    if v is not None and not 0.0 <= v < 1.0:
        if default:
            raise ValueError(
                f"the default {name} = 1 - block_lr / N = {v:g} is outside [0, 1); "
                f"pass block_momentum explicitly"
            )
        raise ValueError(f"{name} must lie in [0, 1), got {value!r}")


def _schedule(name: str, value: Any, check: Callable[[str, Any], None]):
    if callable(value):
        return value
    check(name, value)
    return lambda s: value
