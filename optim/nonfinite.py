"""One policy for non-finite gradients, shared by every communicating transformation.

A NaN or Inf in one worker's gradient must not reach the others (an average with a NaN is
NaN everywhere) nor stay in a residual, error-feedback buffer or momentum, where it would
poison every later step. So every worker counts whether its gradient is finite, the count
is all-reduced (one int32, ``2 (N-1)/N * 4`` bytes each way, in the state's wire count),
and with ``bad > 0`` every worker skips alike (how, below):

* ``"skip"`` (default): the step is skipped on every worker: the update is zero and the
  transformation's state is exactly what it was, except ``skipped += 1`` (the step
  counter does not advance: a skipped step is one that never happened). The finite
  workers' gradients of that step are discarded, as in mixed-precision loss scaling.
* ``"raise"``: the same skip, and every worker raises `NonFiniteGradientError` from a host
  callback. Under ``jit`` it surfaces as a ``jax.errors.JaxRuntimeError`` whose message
  contains ``NonFiniteGradientError`` and the count; since the count is all-reduced, all
  ranks of an MPI job raise at the same step, none is left waiting.
* ``None``: no check and no extra collective; a non-finite gradient propagates as the
  algorithm's arithmetic makes it.

Every communicating transformation applies this policy to itself (``nonfinite=`` at
construction): its own state is protected, and it returns a zero update, which optimizers
chained after it still apply (a momentum then decays one step). To skip a whole
``optax.chain`` as one, wrap it in `skip_nonfinite` and build its members with
``nonfinite=None`` (one flag all-reduce per step instead of one per member).

How a step is skipped: the count is one read pass over the gradient (`any_nonfinite`),
and the skip itself is chosen to copy as little as XLA allows. A transformation that leaves most
of its state as it was (BMUF's global model on a local step) runs inside `run_if`, a
branch that updates the state in place. One that rewrites its state element-wise runs
every step and ``where(ok, new, old)`` keeps the old state on a bad step: the select
fuses into the kernels that compute the new state, where a branch would copy it. Its
collectives then run on a bad step too, on every worker alike, and their results are
discarded with the rest (the wire count still reports 0 bytes for that step).

GTC needs no extra collective: its all-gather header carries the flag (see `gtc`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from shoal.comms import vma
from shoal.comms.collective import Collective
from shoal.comms.shards import worker_max
from shoal.comms.wire import WireCount, WireMeter, all_reduce_bytes, tree_nbytes
from shoal.optim.inplace import keeps_shape, passthrough_bytes, run_if
from shoal.optim.validation import check_collective, checked, require_params

NONFINITE_POLICIES = ("skip", "raise", None)


class NonFiniteGradientError(FloatingPointError):
    """Some worker's gradient held a NaN or Inf (policy ``nonfinite="raise"``)."""


def check_nonfinite(nonfinite: Any) -> None:
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


def _raise_if_bad(bad, workers):
    if int(bad) > 0:
        raise NonFiniteGradientError(
            f"NaN/Inf in the gradient of {int(bad)} of {workers} workers; the step was "
            f"skipped on every worker (nonfinite='raise')"
        )


def report(bad: jax.Array, workers: int, nonfinite: str | None) -> None:
    """Under ``nonfinite="raise"``, raise on the host once the all-reduced ``bad`` count is
    known (a callback, so the error comes from inside ``jit``)."""
    if nonfinite == "raise":
        jax.debug.callback(_raise_if_bad, bad, workers)


def skipped_steps(opt_state: Any) -> jax.Array | None:
    """Steps skipped so far: the largest ``skipped`` counter in ``opt_state`` (a wrapper and
    the transformations inside it never both count one step); None when there is none."""
    has = lambda x: isinstance(x, tuple) and "skipped" in getattr(x, "_fields", ())
    counts = [s.skipped for s in jax.tree.leaves(opt_state, is_leaf=has) if has(s)]
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


def guard(
    update_fn: Callable,
    nonfinite: str | None,
    collectives: Collective | Sequence[Collective],
    *,
    needs_params: str | None = None,
) -> Callable:
    """Wrap a transformation's ``update_fn`` with the policy above.

    ``collectives`` together span every worker whose step must stay in lock-step (two-tier
    algorithms pass ``(intra, inter)``: the count is summed within the group, then across
    groups). The state must be a NamedTuple with ``skipped`` and ``wire`` fields.
    ``needs_params``: the transformation's name if its update reads ``params`` (refused
    before any communication when missing).
    """
    check_nonfinite(nonfinite)
    if nonfinite is None:
        return update_fn
    if not isinstance(collectives, (list, tuple)):
        collectives = (collectives,)
    workers = 1
    for c in collectives:
        workers *= c.size

    def guarded(updates, state, params=None, **extra_args):
        if needs_params:
            require_params(needs_params, params)
        if not jax.tree.leaves(updates):  # nothing to check, nothing to send
            return update_fn(updates, state, params, **extra_args)
        # A worker spanning devices is bad if any of its shards is (`shoal.comms.shards`).
        bad = worker_max(local_nonfinite(updates), collectives)
        wire = WireCount.zero()
        for c in collectives:
            bad = c.all_reduce(bad, "sum")
            wire = wire + WireCount.of(*all_reduce_bytes(4, c.size))
        report(bad, workers, nonfinite)

        ok = bad == 0
        run = lambda c: update_fn(c[0], c[1], params, **extra_args)
        carry = (updates, state)
        if not keeps_shape(run, carry):  # the update changes the gradient's dtype or tree

            def skip(_):
                zeros = jax.tree.map(jnp.zeros_like, updates)
                return zeros, _without_traffic(state)

            new_updates, new_state = vma.cond(ok, lambda _: run(carry), skip, None)
        else:
            if passthrough_bytes(run, carry) * 2 > tree_nbytes(updates):
                # Much of the state is left as it was (BMUF's global model on a local
                # step): a select would cost a pass over it, a 0-or-1-trip loop nothing.
                new_updates, new_state = run_if(ok, run, carry)
            else:
                # The step rewrites its state element-wise: the select fuses into the
                # kernels that compute it, and costs no pass of its own.
                new_updates, new_state = run(carry)
                keep = lambda new, old: jnp.where(ok, new, old)
                new_state = jax.tree.map(keep, new_state, state)
            new_updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), new_updates)
            new_state = _idle_unless(ok, new_state)
        skipped = new_state.skipped + (bad > 0).astype(new_state.skipped.dtype)
        return new_updates, new_state._replace(skipped=skipped, wire=new_state.wire.add(wire))

    return guarded


class SkipNonFiniteState(NamedTuple):
    """State of `skip_nonfinite`: the wrapped transformation's state, the int32 count of
    skipped steps, and the flag's bytes (most recent update and since init)."""

    inner_state: Any
    skipped: jax.Array
    wire: WireMeter


def skip_nonfinite(
    inner: optax.GradientTransformation,
    *,
    collective: Collective | Sequence[Collective],
    nonfinite: str = "skip",
) -> optax.GradientTransformationExtraArgs:
    """Skip a step of all of ``inner`` on every worker when any gradient is non-finite.

    ``inner`` is typically a chain; a step is skipped when any worker's gradient holds a
    NaN or Inf.

    Each step every worker counts whether its gradient is finite and the count is
    all-reduced (one int32, ``2 (N - 1) / N * 4`` bytes each way)::

        bad = sum_i [g_i has a NaN/Inf];   bad > 0: updates = 0, inner_state unchanged,
                                                    skipped += 1

    On a skipped step every worker returns zero updates and keeps ``inner``'s whole state,
    so the chain's momentum, counters and schedules do not move either. ``"raise"`` also
    raises `NonFiniteGradientError` from a host callback (under ``jit`` it surfaces as a
    ``jax.errors.JaxRuntimeError`` naming it).

    Args:
      inner: any optax transformation (typically a chain of shoal's transformations built
        with ``nonfinite=None`` and an optimizer).
      collective: the workers that must skip together (all of them; a two-tier algorithm
        passes ``(intra, inter)``).
      nonfinite: ``"skip"`` or ``"raise"``.

    Returns:
      an ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` returns
      a `SkipNonFiniteState` and whose ``update(updates, state, params=None)``
      returns ``(updates, new_state)``; on a skipped step the updates are zeros
      and ``inner``'s state is unchanged.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from shoal.comms import AxisCollective
      >>> coll = AxisCollective("workers", 2)
      >>> from shoal.optim import allreduce_gradients, skip_nonfinite
      >>> chain = optax.chain(allreduce_gradients(collective=coll, nonfinite=None), optax.sgd(1.0))
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
    if nonfinite is None:
        raise ValueError("nonfinite must be 'skip' or 'raise' for skip_nonfinite, got None")
    check_nonfinite(nonfinite)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return SkipNonFiniteState(inner.init(params), jnp.zeros((), jnp.int32), WireMeter.zero())

    def update_fn(updates, state, params=None, **extra_args):
        new_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        return new_updates, state._replace(inner_state=inner_state, wire=state.wire.idle())

    guarded = guard(update_fn, nonfinite, collectives)
    return optax.GradientTransformationExtraArgs(
        init_fn, checked("skip_nonfinite", SkipNonFiniteState, guarded)
    )
