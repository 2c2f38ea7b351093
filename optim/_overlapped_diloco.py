"""DiLoCo whose outer all-reduce overlaps the next round's inner steps: delayed and eager
outer updates (Kale, Douillard & Donchev 2025).

A worker does not wait for round ``t``'s averaged outer gradient ``Delta^(t)``: it starts
round ``t + 1`` at once, while the all-reduce is in flight, and uses ``Delta^(t)`` one
round later. The delayed variant steps with the stale average alone; the eager variant
adds this worker's own fresh outer gradient in place of its stale share::

    delayed:  g_m = Delta^(t-1)
    eager:    g_m = (1/M) Delta_m^(t) + (1/M) sum_{m' != m} Delta_m'^(t-1)
    theta_m  <- theta_m + outer.update(g_m, s_m, theta_m)

References:
  Kale, Douillard & Donchev, "Eager Updates For Overlapped Communication and Computation
  in DiLoCo", arXiv:2502.12996, 2025.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from shoal.comms.agreement import check_same_structure
from shoal.comms.collective import Collective, uniform_over
from shoal.comms.wire import WireCount, WireMeter, all_reduce_bytes, tree_nbytes
from shoal.dtypes import apply_updates
from shoal.optim._diloco import _cast_like, check_outer_args
from shoal.optim._inplace import run_if
from shoal.optim._validation import check_floating_leaves, checked, require_params

__all__ = ["VARIANTS", "OverlappedDiLoCoState", "overlapped_diloco"]

VARIANTS = ("eager", "delayed")


class OverlappedDiLoCoState(NamedTuple):
    """State of `overlapped_diloco`.

    Attributes:
      inner_state: the inner optimizer's state on this worker (never reset).
      outer_state: this worker's outer optimizer state (the same on every worker in the
        delayed variant, this worker's own in the eager one).
      start: ``theta_m``, where this worker's current round started (its outer model).
      mean_delta: ``Delta^(t-1)``, the last round's averaged outer gradient, in flight
        on a real network and applied in the next round (zero before the first).
      own_delta: ``Delta_m^(t-1)``, this worker's share of it (eager: the stale share
        that its fresh outer gradient replaces; zero before the first round).
      step: int32 count of updates done.
      rounds: int32 count of outer steps done.
      wire: bytes of this transformation's own collectives.
    """

    inner_state: Any
    outer_state: Any
    start: Any
    mean_delta: Any
    own_delta: Any
    step: jax.Array
    rounds: jax.Array
    wire: WireMeter

    # The same on every worker (`shoal.optim.helpers.uniform_axes`); the eager variant's
    # outer model and state differ per worker.
    RANK_UNIFORM = ("mean_delta", "step", "rounds")


def overlapped_diloco(
    inner: optax.GradientTransformation,
    *,
    collective: Collective,
    sync_every: int,
    outer: optax.GradientTransformation,
    variant: str = "eager",
) -> optax.GradientTransformationExtraArgs:
    """DiLoCo with the outer all-reduce overlapped by the next round: delayed or eager.

    Every worker ``m`` of ``M`` applies ``inner`` to its own gradient at every update. On
    every ``sync_every``-th update (``H``), after that inner step, reaching ``theta_m'``,
    it forms its outer gradient from where the round started, all-reduces it (mean), and
    steps its outer model with what a real overlapped all-reduce would already have
    delivered, the previous round's mean (section 3 of the paper)::

        Delta_m^(t) = theta_m - theta_m'                         (one all-reduce: mean)
        delayed:  g_m = Delta^(t-1)
        eager:    g_m = Delta^(t-1) + (Delta_m^(t) - Delta_m^(t-1)) / M
                      = (1/M) Delta_m^(t) + (1/M) sum_{m' != m} Delta_m'^(t-1)
        u, s_m      = outer.update(g_m, s_m, theta_m)
        theta_m    <- theta_m + u                                 (the next round's start)

    with ``Delta^(0) = Delta_m^(0) = 0``. ``Delta^(t)`` is kept in the state and applied
    next round; the last round's stays in ``state.mean_delta`` (a checkpoint keeps it).
    In the delayed variant every worker holds the same outer model and state; in the
    eager one each worker's fresh share differs, so their outer models differ (evaluate
    their mean). Each worker restarts its round from its ``theta_m``.

    Bytes: one float32 all-reduce of the model per round, as `shoal.optim.diloco`
    (``2 (M - 1) / M`` times the param bytes each way, in ``state.wire.step``). What it
    buys is time, not bytes: on a real network the all-reduce of round ``t`` runs during
    the ``H`` inner steps of round ``t + 1``, so a round costs ``max(H c, a)`` instead of
    ``H c + a`` for an all-reduce of ``a`` seconds and inner steps of ``c``
    (`shoal.costmodel.overlapped` projects it). The simulation here computes the same
    numbers as that schedule; it does not overlap anything itself.

    Args:
      inner: the per-worker optimizer (e.g. ``optax.adamw(...)``).
      collective: the workers (`shoal.comms.Collective`).
      sync_every: ``H``, updates per round, an int >= 1.
      outer: the outer optimizer (DiLoCo's: ``optax.sgd(0.7, momentum=0.9,
        nesterov=True)``), one state per worker.
      variant: ``"eager"`` (the paper's proposal) or ``"delayed"`` (its baseline).

    Returns:
      an ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` returns an
      `OverlappedDiLoCoState` and whose ``update(updates, state, params)`` returns
      ``(updates, new_state)``; ``optax.apply_updates(params, updates)`` is the next model.

    Example:
      Two workers, one inner SGD step (lr 1) per round towards targets 2 and 4, outer
      SGD (lr 1). Round 1 (eager): worker 0 moved by 2 and steps by its own half, 1;
      worker 1 by 4, stepping 2. Delayed: nothing has arrived yet, neither moves:

      >>> import jax, jax.numpy as jnp, optax
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import overlapped_diloco
      >>> coll = AxisCollective("workers", 2)
      >>> def first_round(variant):
      ...     tx = overlapped_diloco(optax.sgd(1.0), collective=coll, sync_every=1,
      ...                            outer=optax.sgd(1.0), variant=variant)
      ...     def worker(params, target):
      ...         updates, state = tx.update(params - target, tx.init(params), params)
      ...         return optax.apply_updates(params, updates)
      ...     return jax.vmap(worker, axis_name="workers")(jnp.zeros((2, 1)),
      ...                                                  jnp.array([[2.0], [4.0]]))
      >>> print(first_round("eager").ravel(), first_round("delayed").ravel())
      [1. 2.] [0. 0.]

    References:
      Kale, Douillard & Donchev, "Eager Updates For Overlapped Communication and
      Computation in DiLoCo", arXiv:2502.12996, 2025, sections 3.1-3.2.
    """
    sync_every = check_outer_args(collective, inner, outer, sync_every, None)
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    inner = optax.with_extra_args_support(inner)
    n_workers = collective.size

    def init_fn(params):
        check_same_structure(params, collective)
        check_floating_leaves("params", params)
        zeros = jax.tree.map(jnp.zeros_like, params)
        return OverlappedDiLoCoState(
            inner_state=inner.init(params),
            outer_state=outer.init(params),
            start=jax.tree.map(jnp.array, params),
            mean_delta=zeros,
            own_delta=zeros if variant == "eager" else (),
            step=jnp.zeros((), jnp.int32),
            rounds=jnp.zeros((), jnp.int32),
            wire=WireMeter.zero(),
        )

    def update_fn(updates, state, params=None, **extra_args):
        require_params("overlapped_diloco", params)
        step = uniform_over(collective, state.step)
        inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        nbytes = all_reduce_bytes(tree_nbytes(params), n_workers)

        def outer_step(carry):
            out, outer_state, start, mean_delta, own_delta, rounds, _ = carry
            local = apply_updates(params, out)
            delta = jax.tree.map(jnp.subtract, start, local)
            fresh = collective.all_reduce(delta, "mean")  # in flight during the next round
            if variant == "eager":
                g = jax.tree.map(
                    lambda mean, new, old: mean + (new - old) / n_workers,
                    mean_delta,
                    delta,
                    own_delta,
                )
                own_delta = _cast_like(delta, own_delta)
            else:
                g = mean_delta
            u, new_outer = outer.update(g, outer_state, start)
            start = apply_updates(start, u)
            restart = jax.tree.map(lambda s, p, o: (s - p).astype(o.dtype), start, params, out)
            return (
                restart,
                _cast_like(new_outer, outer_state),
                start,
                _cast_like(fresh, mean_delta),
                own_delta,
                rounds + 1,
                WireCount.of(*nbytes),
            )

        carry = (
            inner_updates,
            state.outer_state,
            state.start,
            state.mean_delta,
            state.own_delta,
            state.rounds,
            WireCount.zero(),
        )
        is_sync = (step + 1) % sync_every == 0
        out, outer_state, start, mean_delta, own_delta, rounds, wire = run_if(
            is_sync, outer_step, carry
        )
        return out, OverlappedDiLoCoState(
            inner_state=inner_state,
            outer_state=outer_state,
            start=start,
            mean_delta=mean_delta,
            own_delta=own_delta,
            step=state.step + 1,
            rounds=rounds,
            wire=state.wire.record(wire),
        )

    return optax.GradientTransformationExtraArgs(
        init_fn, checked("overlapped_diloco", OverlappedDiLoCoState, update_fn, lambda s: s.start)
    )
