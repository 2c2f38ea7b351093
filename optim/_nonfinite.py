"""Non-finite gradients: one mechanism, `skip_nonfinite`, for every transformation.

A NaN or Inf in one worker's gradient must not reach the others (an average with a NaN is
NaN everywhere) nor stay in a residual, error-feedback buffer or momentum, where it would
poison every later step. `skip_nonfinite` wraps a transformation (typically a whole
``optax.chain`` of shoal's transformations and an optimizer), the distributed analogue of
``optax.apply_if_finite``: every worker counts whether its gradient is finite, the count
is all-reduced (one int32, ``2 (N-1)/N * 4`` bytes each way, in the wrapper's wire
count), and with ``bad > 0`` every worker skips alike:

* ``"skip"`` (default): the step is skipped on every worker: the update is zero and the
  wrapped state is exactly what it was (its wire meters report an idle step); the
  wrapper's ``skipped`` counts it. Counters and schedules inside do not advance: a
  skipped step is one that never happened. The finite workers' gradients of that step
  are discarded, as in mixed-precision loss scaling.
* ``"raise"``: the same skip, and every worker raises `NonFiniteGradientError` from a host
  callback. Under ``jit`` it surfaces as a ``jax.errors.JaxRuntimeError`` whose message
  contains ``NonFiniteGradientError`` and the count; since the count is all-reduced, all
  ranks of an MPI job raise at the same step, none is left waiting.

Without the wrapper nothing is checked and no flag is sent: a non-finite gradient
propagates as the algorithm's arithmetic makes it.

How a step is skipped: the count is one read pass over the gradient (`any_nonfinite`),
and the skip itself is chosen to copy as little as XLA allows. A wrapped transformation
that leaves most of its state as it was (BMUF's global model on a local step) runs inside
`run_if`, a branch that updates the state in place. One that rewrites its state
element-wise runs every step and ``where(ok, new, old)`` keeps the old state on a bad
step: the select fuses into the kernels that compute the new state, where a branch would
copy it. Its collectives then run on a bad step too, on every worker alike, and their
results are discarded with the rest (the wire count still reports 0 bytes for them).
``in_place`` overrides the choice: an update that mixes other workers' values into the
parameters (peer and model averaging) runs faster in the loop, because the select makes
XLA copy the momentum and the new parameters (`benchmarks/sim_scale.py`).

A loop still writes the update out, for ``optax.apply_updates`` to read it back after the
loop. A training step that applies the update itself can take the skip around both with
`update_and_apply`: with ``in_place="apply"`` the loop updates the parameters in place
too, and the update is never stored (synchronous model averaging: 1.02x local SGD's step
instead of 1.24x, side by side at 1M params x 16 simulated workers). An update that reads
other workers' parameters in that pass would make XLA copy them first, so peer averaging's
exchange, which reads no gradient, is made before the loop (`shoal.optim._prefetch`; at 1M
params x 16 workers 1.08-1.20x local SGD's step, against 1.14-1.21x made in the loop, in
three processes; at x 64 no difference beyond the noise). Inside the loop
the wrapped transformation's own ``apply_step`` runs where it has one
(`shoal.optim._applying`): BMUF and DiLoCo carry the parameters through their own branch,
so that their local steps are one pass ``params + u`` too (BMUF's local steps at 1M
params x 16 workers: 1.02-1.08x local SGD's step instead of 1.10-1.13x).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from shoal import vma
from shoal.comms.collective import Collective
from shoal.comms.shards import worker_max
from shoal.comms.turns import taking_turns
from shoal.comms.wire import WireCount, WireMeter, all_reduce_bytes, tree_nbytes
from shoal.dtypes import apply_updates
from shoal.optim._applying import ApplyingTransformation, update_and_apply
from shoal.optim._inplace import keeps_shape, passthrough_bytes, run_if
from shoal.optim._prefetch import PREFETCHED
from shoal.optim._validation import check_collective, checked
from shoal.trees import find_instances

NONFINITE_POLICIES = ("skip", "raise")


class NonFiniteGradientError(FloatingPointError):
    """Some worker's gradient held a NaN or Inf (`skip_nonfinite` with ``nonfinite="raise"``)."""


def check_nonfinite(nonfinite: Any) -> None:
    """Refuse a policy other than ``"skip"`` or ``"raise"``, naming ``nonfinite``."""
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")


def any_nonfinite(x: jax.Array) -> jax.Array:
    """True if any element of ``x`` is NaN or +-Inf, in one read pass of ``x``.

    ``rows @ 0``: ``0 * v`` is 0 for every finite ``v`` (exactly, in float32, so no sum
    can overflow) and NaN for NaN and +-Inf, and a dot reads its operand at memory
    bandwidth, where ``all(isfinite(x))`` costs ~3 read passes on XLA:CPU (a predicate
    array, then its reduction). The zeros pass an optimization barrier so that XLA
    cannot fold ``x @ 0`` to 0.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros((), bool)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag])
    rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    zeros = lax.optimization_barrier(jnp.zeros((rows.shape[1],), rows.dtype))
    dot = jnp.dot(rows, zeros, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return jnp.isnan(jnp.sum(dot))


def local_nonfinite(tree: Any) -> jax.Array:
    """int32 1 if any element of this worker's ``tree`` is NaN/Inf, else 0."""
    flags = [any_nonfinite(x) for x in jax.tree.leaves(tree) if jnp.size(x)]
    if not flags:
        return jnp.zeros((), jnp.int32)
    return jnp.any(jnp.stack(flags)).astype(jnp.int32)


_RAISED: list[NonFiniteGradientError] = []  # the latest one, for `take_raised`


def _raise_if_bad(bad, workers):
    if int(bad) > 0:
        error = NonFiniteGradientError(
            f"NaN/Inf in the gradient of {int(bad)} of {workers} workers; the step was "
            f"skipped on every worker (nonfinite='raise')"
        )
        _RAISED[:] = [error]
        raise error


def take_raised() -> NonFiniteGradientError | None:
    """The `NonFiniteGradientError` that ``nonfinite="raise"`` raised in this process since
    the last call (None: none), and forget it. JAX reports an error raised inside a
    compiled step as a ``jax.errors.JaxRuntimeError`` whose message holds the original's
    text; this gives a host loop the original itself.

    Returns:
      the error, or None.
    """
    return _RAISED.pop() if _RAISED else None


def skipped_steps(opt_state: Any) -> jax.Array | None:
    """Steps skipped so far: the ``skipped`` count of the `skip_nonfinite` in ``opt_state``
    (the largest, if several are nested); None when there is none."""
    counts = [s.skipped for s in find_instances(opt_state, SkipNonFiniteState)]
    if not counts:
        return None
    return functools.reduce(jnp.maximum, counts)


def _without_traffic(state: Any) -> Any:
    """``state`` with every `WireMeter` in it (nested ones included) idle: a skipped
    step sent nothing (its step count is 0), and the totals since init stay as they were."""
    is_wire = lambda x: isinstance(x, WireMeter)
    return jax.tree.map(lambda x: x.idle() if is_wire(x) else x, state, is_leaf=is_wire)


def _idle_unless(ok: jax.Array, state: Any) -> Any:
    """``state`` if ``ok``, else `_without_traffic` (only the meters' few words differ)."""
    idle = _without_traffic(state)
    return jax.tree.map(lambda a, b: a if a is b else jnp.where(ok, a, b), state, idle)


def _count_nonfinite(updates: Any, collectives: Sequence[Collective]):
    """The number of workers whose ``updates`` hold a NaN/Inf, the same on every worker,
    and the bytes of its all-reduces (one int32 per tier: the count is summed within the
    group, then across groups)."""
    # A worker spanning devices is bad if any of its shards is (`shoal.comms.shards`).
    bad = worker_max(local_nonfinite(updates), collectives)
    wire = WireCount.zero()
    for c in collectives:
        # In a worker's turn (`shoal.comms.turns`) its own flag: the caller runs the steps
        # again with the workers together if any worker skipped (`shoal.optim.helpers.
        # take_turns`). The bytes are the all-reduce's all the same.
        if not taking_turns(c):
            bad = c.all_reduce(bad, "sum")
        wire = wire + WireCount.of(*all_reduce_bytes(4, c.size))
    return bad, wire


def _apply_if(
    ok: jax.Array, run: Callable, updates: Any, state: Any, in_place: bool | None = None
) -> tuple[Any, Any]:
    """``run((updates, state))`` if ``ok``, else zero updates and ``state`` with idle wire
    meters; the way chosen to copy the least (module docstring), or as ``in_place`` says."""
    carry = (updates, state)
    if not keeps_shape(run, carry):  # the update changes the gradient's dtype or tree

        def skip(_):
            out_updates, out_state = jax.eval_shape(run, carry)
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_updates)
            kept = jax.tree.map(lambda x, s: jnp.asarray(x, s.dtype), state, out_state)
            return zeros, _without_traffic(kept)

        return vma.cond(ok, lambda _: run(carry), skip, None)
    if in_place is None:
        # Much of the state left as it was (BMUF's global model on a local step): a select
        # would cost a pass over it, a 0-or-1-trip loop nothing.
        in_place = passthrough_bytes(run, carry) * 2 > tree_nbytes(updates)
    if in_place:
        new_updates, new_state = run_if(ok, run, carry)
    else:
        # The step rewrites its state element-wise: the select fuses into the kernels that
        # compute it, and costs no pass of its own.
        new_updates, new_state = run(carry)
        new_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_state, state)
    new_updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), new_updates)
    return new_updates, _idle_unless(ok, new_state)


IN_PLACE = (None, True, False, "apply")


class SkipNonFiniteTransformation(ApplyingTransformation):
    """What `skip_nonfinite` returns: an optax transformation, and with ``in_place="apply"``
    also the skip around the update and its application, which `update_and_apply` takes
    (``apply_step``: None otherwise)."""


class SkipNonFiniteState(NamedTuple):
    """State of `skip_nonfinite`.

    Attributes:
      inner_state: the wrapped transformation's state (unchanged by a skipped step, but
        for its wire meters, which report an idle step).
      skipped: int32 count of steps skipped so far.
      wire: the flag's bytes, of the most recent update and since init.
    """

    inner_state: Any
    skipped: jax.Array
    wire: WireMeter


def skip_nonfinite(
    inner: optax.GradientTransformation,
    *,
    collective: Collective | Sequence[Collective],
    nonfinite: str = "skip",
    in_place: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Skip a step of ``inner`` on every worker when any worker's gradient is non-finite.

    The distributed ``optax.apply_if_finite``, and shoal's one mechanism for non-finite
    gradients (none of its transformations checks by itself). Each step every worker
    flags whether its gradient holds a NaN or Inf and the count is all-reduced (one int32,
    ``2 (N - 1) / N * 4`` bytes each way per collective in ``collective``)::

        bad = sum_i [g_i has a NaN/Inf]
        bad > 0:  updates = 0,  inner_state unchanged,  skipped += 1
        bad = 0:  updates, inner_state = inner.update(g, inner_state, params)

    On a skipped step every worker returns zero updates and keeps ``inner``'s whole state
    bit for bit (its wire meters report an idle step), so no residual, error feedback,
    momentum, counter or schedule inside moves. ``"raise"`` also raises
    `NonFiniteGradientError` from a host callback on every worker at the same step
    (under ``jit`` it surfaces as a ``jax.errors.JaxRuntimeError`` naming it).

    Args:
      inner: any optax transformation, typically a chain of shoal's transformations and
        an optimizer.
      collective: the workers that must skip together, all of them: one collective, or
        a two-tier algorithm's ``(intra, inter)`` (the count is summed over each).
      nonfinite: ``"skip"`` or ``"raise"`` (which always skips in the loop, below: no
        collective of ``inner`` runs on the step that raises).
      in_place: how a step is skipped, for speed only (the same results, but for how XLA
        contracts multiply-adds into FMAs); ``"apply"``: as ``True``, and `update_and_apply`
        takes the skip around the update's application as well (and the application
        is ``inner``'s own ``apply_step`` where it has one, as `bmuf` and `diloco` do,
        and the exchange of a `shoal.optim.PrefetchingTransformation`, as
        `peer_averaging`'s, is made before the branch):
        ``True``: ``inner`` runs in a loop of 0 or 1 trips that updates the gradient and
        its state in place; ``False``: it runs every step and a select keeps the old
        state; ``None``: in place when ``inner`` may pass most of its state through
        unchanged (module docstring). In place is faster for an update that mixes in
        other workers' values element-wise (peer and model averaging, partial exchange:
        the select would make XLA copy the momentum and the new parameters); a select
        for one whose update is an all-reduced value plus local state (S-SGD, GTC, whose
        residual's select fuses into the pass that writes it).

    Returns:
      a `SkipNonFiniteTransformation` (an ``optax.GradientTransformationExtraArgs``)
      whose ``init(params)`` returns a `SkipNonFiniteState` and whose
      ``update(updates, state, params=None)`` returns ``(updates, new_state)``; on a
      skipped step the updates are zeros and ``inner``'s state is unchanged.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from shoal.comms import AxisCollective
      >>> coll = AxisCollective("workers", 2)
      >>> from shoal.optim import allreduce_gradients, skip_nonfinite
      >>> chain = optax.chain(allreduce_gradients(collective=coll), optax.sgd(1.0))
      >>> tx = skip_nonfinite(chain, collective=coll)
      >>> def step(g):
      ...     updates, state = tx.update(g, tx.init(g))
      ...     return updates, state.skipped
      >>> grads = jnp.array([[1.0, 2.0], [jnp.nan, 0.0]])  # worker 1's gradient holds a NaN
      >>> updates, skipped = jax.vmap(step, axis_name="workers")(grads)
      >>> print(updates, skipped)
      [[0. 0.]
       [0. 0.]] [1 1]

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018 (skipping a step
      on an overflow).
    """
    collectives = tuple(collective) if isinstance(collective, (list, tuple)) else (collective,)
    for c in collectives:
        check_collective(c)
    check_nonfinite(nonfinite)
    if in_place not in IN_PLACE:
        raise ValueError(f"in_place must be None, True, False or 'apply', got {in_place!r}")
    inner = optax.with_extra_args_support(inner)  # an ExtraArgs one (prefetch too) as it is
    workers = 1
    for c in collectives:
        workers *= c.size

    def init_fn(params):
        return SkipNonFiniteState(inner.init(params), jnp.zeros((), jnp.int32), WireMeter.zero())

    def update_fn(updates, state, params=None, **extra_args):
        run = lambda c: inner.update(c[0], c[1], params, **extra_args)
        if not jax.tree.leaves(updates):  # nothing to check, nothing to send
            new_updates, inner_state = run((updates, state.inner_state))
            return new_updates, state._replace(inner_state=inner_state, wire=state.wire.idle())
        bad, wire = flag(updates)
        # "raise": a branch, never the select, so that on the bad step no collective runs
        # after the flag. With the select a rank could raise and leave its step while
        # another still waits in the update's exchange (an MPI job would hang).
        loop = True if in_place == "apply" or nonfinite == "raise" else in_place
        new_updates, inner_state = _apply_if(bad == 0, run, updates, state.inner_state, loop)
        return new_updates, counted(state, bad, inner_state, wire)

    def flag(updates):
        """The count of bad workers and its bytes (and the raise, if asked for)."""
        bad, wire = _count_nonfinite(updates, collectives)
        if nonfinite == "raise":
            jax.debug.callback(_raise_if_bad, bad, workers)
        return bad, wire

    def counted(state, bad, inner_state, wire):
        skipped = state.skipped + (bad > 0).astype(state.skipped.dtype)
        return SkipNonFiniteState(inner_state, skipped, state.wire.record(wire))

    def apply_step(updates, state, params, **extra_args):
        """`update_and_apply`: params and inner state in one in-place branch."""
        prefetch = getattr(inner, "prefetch", None)
        if prefetch is not None and jax.tree.leaves(updates):
            # An exchange that reads no gradient (peer averaging's models) is made before
            # the branch, so that the branch is one element-wise pass (`shoal.optim._prefetch`).
            extra_args = {**extra_args, PREFETCHED: prefetch(state.inner_state, params)}

        def run(carry):
            p, s = carry
            return update_and_apply(inner, updates, s, p, **extra_args)

        carry = (params, state.inner_state)
        if not jax.tree.leaves(updates) or not keeps_shape(run, carry):
            new_updates, state = update_fn(updates, state, params, **extra_args)
            return apply_updates(params, new_updates), state
        bad, wire = flag(updates)
        params, inner_state = run_if(bad == 0, run, carry)
        return params, counted(state, bad, _idle_unless(bad == 0, inner_state), wire)

    tx = SkipNonFiniteTransformation(
        init_fn, checked("skip_nonfinite", SkipNonFiniteState, update_fn)
    )
    if in_place == "apply":
        tx.apply_step = checked("skip_nonfinite", SkipNonFiniteState, apply_step)
    return tx
