"""DiLoCo: local inner steps on every worker, an outer optimizer step every few updates.

Every worker applies an inner optimizer to its own gradient; every ``sync_every``-th
update the workers average how far they moved from the global model ``theta_g`` (one
all-reduce) and an outer optimizer steps ``theta_g`` with that average as its gradient::

    delta   = theta_g - (1/N) sum_i theta_i
    u, s    = outer.update(delta, s, theta_g)
    theta_g = theta_g + u

after which every worker continues from ``theta_g``.

References:
  Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
  Models", arXiv:2311.08105, 2023.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shoal.checks import check_int
from shoal.comms.agreement import check_same_structure
from shoal.comms.codecs import Compressor, tree_mean
from shoal.comms.collective import Collective, uniform_over
from shoal.comms.turns import leave_out, taking_turns
from shoal.comms.wire import WireCount, WireMeter
from shoal.dtypes import apply_updates
from shoal.optim._applying import applying_transformation
from shoal.optim._inplace import run_if
from shoal.optim._validation import (
    check_collective,
    check_floating_leaves,
    require_params,
)


class DiLoCoState(NamedTuple):
    """State of `diloco`.

    Attributes:
      inner_state: the inner optimizer's state on this worker; it persists across rounds
        (never reset at a synchronisation).
      outer_state: the outer optimizer's state (the same on every worker).
      global_params: ``theta_g``, the global model of the most recent outer step (the
        ``params`` given to ``init`` before the first); exact, where the worker's params
        equal it up to one rounding.
      step: int32 count of updates done.
      rounds: int32 count of outer steps done.
      wire: bytes of this transformation's own collectives in the most recent update and
        since init.
      exchange_memory: the error feedback of ``exchange`` (``()`` without one, or when it
        keeps none).
    """

    inner_state: Any
    outer_state: Any
    global_params: Any
    step: jax.Array
    rounds: jax.Array
    wire: WireMeter
    exchange_memory: tuple = ()

    ERROR_FEEDBACK = ("exchange_memory",)  # `shoal.optim.helpers.error_feedback_mask`

    # The same on every worker: simulated workers can hold them once
    # (`shoal.optim.helpers.uniform_axes`).
    RANK_UNIFORM = ("outer_state", "global_params", "step", "rounds")


def diloco(
    inner: optax.GradientTransformation,
    *,
    collective: Collective,
    sync_every: int,
    outer: optax.GradientTransformation,
    exchange: Compressor | None = None,
) -> optax.GradientTransformationExtraArgs:
    """DiLoCo: per-worker inner optimizer steps, an outer optimizer step every ``sync_every``.

    Each worker ``i`` applies ``inner`` to its own gradient at every update. On every
    ``sync_every``-th update it first takes that inner step, reaching ``theta_i``, then
    all ``N`` workers run the outer step on the global model ``theta_g``::

        delta            = theta_g - (1/N) sum_i theta_i       (the outer gradient)
        u, outer_state   = outer.update(delta, outer_state, theta_g)
        theta_g         <- theta_g + u

    and every worker's model becomes the new ``theta_g``. ``outer =
    optax.sgd(0.7, momentum=0.9, nesterov=True)`` with ``inner = optax.adamw(...)`` is
    DiLoCo; ``outer = optax.sgd(1.0)`` is periodic model averaging (local SGD,
    post-local SGD after a synchronous warm-up); any optax transformation, e.g.
    ``optax.adam``, may serve as ``outer``. The inner state is this worker's own and
    persists across rounds: it is never reset.

    ``update(grads, state, params)`` needs ``params`` (this worker's model) and returns
    updates such that ``optax.apply_updates(params, updates)`` is this worker's next
    model: its inner step ``inner_update`` on the other updates, and ``theta_g - params``
    on a synchronisation update, which lands every worker on ``theta_g`` up to one
    rounding of ``params + (theta_g - params)`` (``state.global_params`` holds
    ``theta_g`` exactly; evaluate it). Only synchronisation updates communicate: one
    all-reduce (mean) of the param-sized ``theta_g - theta_i``, inside a branch on the
    rank-uniform step counter, ``2 (N - 1) / N`` times the param bytes each way in
    ``state.wire.step`` (0 on the other updates). With ``exchange``, a
    `shoal.comms.Compressor`, the mean of ``delta`` travels compressed instead: every
    leaf flattened into one float32 vector, ``exchange.mean`` of it (its error feedback
    in ``state.exchange_memory``), and ``exchange.wire_bytes`` of that vector counted.

    With constant hyper-parameters this is `shoal.optim.bmuf` with ``nesterov=True,
    nbm="chen_huo", reset_inner_state=False``, ``block_size = sync_every`` and
    ``outer = optax.sgd(block_lr, momentum=block_momentum, nesterov=True)``.

    Start: ``theta_g`` is the ``params`` given to ``init``, so every worker must init from
    the same model, e.g. ``params = collective.broadcast(params, 0)`` first; see
    `shoal.optim.helpers.same_model_check`, which checks it (``shoal-run`` does).

    Inner steps communicate nothing; `shoal.optim.skip_nonfinite` around it, which skips
    steps with a NaN/Inf gradient, all-reduces its 4-byte flag on every update.

    Args:
      inner: the per-worker optimizer, any optax transformation (e.g. ``optax.adamw``),
        applied every update to this worker's gradient.
      collective: the workers whose models are averaged (`shoal.comms.Collective`).
      sync_every: updates per round, an int >= 1: the outer step runs on updates
        ``sync_every``, ``2 sync_every``, ...
      outer: the outer optimizer, any optax transformation, applied to ``delta`` with
        ``theta_g`` as its params.
      exchange: None (a float32 all-reduce of ``delta``) or a `shoal.comms.Compressor`
        for it, e.g. ``shoal.comms.Quantized("fp4")`` or ``shoal.comms.TopK(0.01)``.

    A training step that applies the update itself should take it with
    ``params, state = shoal.optim.update_and_apply(tx, grads, state, params)``: the
    parameters then ride in the outer step's in-place branch, so an inner step is the one
    pass ``params + u`` and the restart is ``theta_g`` itself (as in `shoal.optim.bmuf`).

    Returns:
      an `shoal.optim.ApplyingTransformation` (an
      ``optax.GradientTransformationExtraArgs``) whose ``init(params)`` returns a
      `DiLoCoState` and whose ``update(updates, state, params)`` returns ``(updates,
      new_state)``; ``optax.apply_updates(params, updates)`` is this worker's next model.
      Its ``apply_step`` is what `shoal.optim.update_and_apply` calls.

    Example:
      Two workers take two inner SGD steps towards different targets, to 0.75 and 2.25;
      the outer Nesterov step on ``delta = 0 - 1.5`` moves both to ``theta_g = 0.7 *
      (1.5 + 0.9 * 1.5)``:

      >>> import jax, jax.numpy as jnp, optax
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import diloco
      >>> coll = AxisCollective("workers", 2)
      >>> outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
      >>> tx = diloco(optax.sgd(0.5), collective=coll, sync_every=2, outer=outer)
      >>> def train(params, target):
      ...     state = tx.init(params)
      ...     for _ in range(2):  # one round: two inner steps, then the outer step
      ...         grads = params - target  # gradient of 0.5 |params - target|^2
      ...         updates, state = tx.update(grads, state, params)
      ...         params = optax.apply_updates(params, updates)
      ...     return state.global_params
      >>> start = jnp.zeros((2, 1))  # both workers start from the same model
      >>> theta_g = jax.vmap(train, axis_name="workers")(start, jnp.array([[1.0], [3.0]]))
      >>> print(theta_g.round(4))
      [[1.995]
       [1.995]]

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
      Models", arXiv:2311.08105, 2023.
    """
    return diloco_named("diloco", inner, collective, sync_every, outer, exchange)


def diloco_named(
    name: str,
    inner: optax.GradientTransformation,
    collective: Collective,
    sync_every: int,
    outer: optax.GradientTransformation,
    exchange: Compressor | None,
) -> optax.GradientTransformationExtraArgs:
    """`diloco` whose errors name ``name``: the DiLoCo family's factories that are a
    DiLoCo with a fixed outer step and exchange (`shoal.optim.sparseloco`) build on it."""
    sync_every = check_outer_args(collective, inner, outer, sync_every, exchange)
    inner = optax.with_extra_args_support(inner)
    n_workers = collective.size

    def init_fn(params):
        check_same_structure(params, collective)
        check_floating_leaves("params", params)
        return DiLoCoState(
            inner_state=inner.init(params),
            outer_state=outer.init(params),
            global_params=jax.tree.map(jnp.array, params),
            step=jnp.zeros((), jnp.int32),
            rounds=jnp.zeros((), jnp.int32),
            wire=WireMeter.zero(),
            exchange_memory=_exchange_init(exchange, params, n_workers),
        )

    def step_fn(updates, state, params, apply, **extra_args):
        """The update (``apply=False``) or the new params (``apply=True``) and the state:
        applied here, the params ride in the outer step's in-place branch, and an inner
        step is the one pass ``params + u`` (`shoal.optim._applying`)."""
        require_params(name, params)
        # Branch on the step counter, the same on every worker: an inner-only update then
        # costs an inner step under vmap too, not a select over the outer step.
        step = uniform_over(collective, state.step)
        inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        first = apply_updates(params, inner_updates) if apply else inner_updates

        def outer_step(carry):
            out, outer_state, theta_g, rounds, _, memory = carry
            local = out if apply else apply_updates(params, out)
            # Average the workers' distances from theta_g, not their models: the same
            # bytes, and a mean of small differences loses less precision.
            diff = jax.tree.map(jnp.subtract, theta_g, local)
            delta, memory, nbytes = tree_mean(
                diff, memory, collective=collective, exchange=exchange
            )
            delta = _cast_like(delta, theta_g)
            u, new_outer = outer.update(delta, outer_state, theta_g)
            theta_g = apply_updates(theta_g, u)
            if apply:  # every worker restarts from theta_g itself
                restart = _cast_like(theta_g, out)
            else:
                restart = jax.tree.map(
                    lambda g, p, o: (g - p).astype(o.dtype), theta_g, params, out
                )
            new_outer = _cast_like(new_outer, outer_state)
            return restart, new_outer, theta_g, rounds + 1, WireCount.of(*nbytes), memory

        is_sync = (step + 1) % sync_every == 0
        carry = (
            first,
            state.outer_state,
            state.global_params,
            state.rounds,
            WireCount.zero(),
            state.exchange_memory,
        )
        if taking_turns(collective):  # a worker's local steps, one at a time: no outer step
            leave_out(collective, is_sync)  # (the turn's taker checks it was not due)
            out, outer_state, theta_g, rounds, wire, memory = carry
        else:
            out, outer_state, theta_g, rounds, wire, memory = run_if(is_sync, outer_step, carry)
        new_state = DiLoCoState(
            inner_state=inner_state,
            outer_state=outer_state,
            global_params=theta_g,
            step=state.step + 1,
            rounds=rounds,
            wire=state.wire.record(wire),
            exchange_memory=memory,
        )
        return out, new_state

    return applying_transformation(name, DiLoCoState, init_fn, step_fn, lambda s: s.global_params)


def check_outer_args(collective, inner, outer, sync_every, exchange) -> int:
    """The arguments `diloco` and `streaming_diloco` share, checked; ``sync_every`` as an
    int."""
    check_collective(collective)
    _check_transformation("inner", inner)
    _check_transformation("outer", outer)
    check_int("sync_every", sync_every, 1)
    if exchange is not None and not isinstance(exchange, Compressor):
        raise ValueError(
            "exchange must be None or a shoal.comms.Compressor (e.g. Quantized('fp4')), "
            f"got {type(exchange).__name__}"
        )
    return int(sync_every)


def _exchange_init(exchange: Compressor | None, params: Any, size: int) -> tuple:
    if exchange is None:
        return ()
    n = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    return exchange.init(max(n, 1), size)


def _check_transformation(name: str, value: Any) -> None:
    if callable(getattr(value, "init", None)) and callable(getattr(value, "update", None)):
        return  # an optax.GradientTransformation, or anything shaped like one
    hint = ""
    if callable(value) and not hasattr(value, "init"):
        hint = " (a factory such as optax.adamw must be called: optax.adamw(1e-3))"
    raise ValueError(
        f"{name} must be an optax.GradientTransformation, got {type(value).__name__}{hint}"
    )


def _cast_like(tree: Any, like: Any) -> Any:
    # A branch must return its carry's dtypes exactly (weak types included).
    return jax.tree.map(lambda x, ref: jnp.asarray(x).astype(jnp.result_type(ref)), tree, like)
