"""Simulated workers' local steps taken in turn: one worker's scan at a time, not all
workers under ``vmap`` (`take_turns`; the mechanism is `shoal.comms.turns`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from shoal.comms.turns import in_turn
from shoal.optim._uniform import uniform_axes

__all__ = ["take_turns"]


def take_turns(
    step: Callable[..., tuple[Any, Any, Any]],
    collective: Any,
    params: Any,
    state: Any,
    *batches: Any,
) -> tuple[Any, Any, Any]:
    """Every simulated worker's local steps, one worker after another.

    For ``i = 0 .. N-1`` in turn, worker ``i`` runs ``K`` steps on its own rows::

        (params_i, state_i, out_i[k]) = step(params_i, state_i, *batch_i[k]),  k < K

    inside `shoal.comms.turns.in_turn` (``collective.rank()`` is ``i``; an exchange
    raises `shoal.comms.turns.TurnError`; DiLoCo leaves its outer step out). The results
    are those of the same steps under ``jax.vmap`` over the workers, to float32 rounding,
    but each worker's steps touch one worker's model, state and activations: the
    ``N``-fold working set of a vmapped step no longer thrashes the caches (1.2x the
    time of ``N`` one-worker steps with the 1M MLP at ``N = 16`` vmapped, on 2 CPU cores:
    ``benchmarks/sim_vs_jax_peer.py``). For the steps between two exchanges only: the
    caller knows the schedule (``sync_every``); where it was wrong, an exchange left out
    was due, and the program raises `shoal.comms.turns.TurnError` when it runs
    (`shoal.comms.turns.leave_out`). A `shoal.optim.skip_nonfinite` inside decides on
    each worker's gradient alone (it counts its flag's all-reduce all the same): where
    all workers must skip together, a caller whose workers skipped runs the steps again
    under ``vmap``, as ``shoal-run`` does.

    Rank-uniform state held once (`uniform_axes` gives ``None``: DiLoCo's global model,
    outer state and counters) is passed to every worker as it is; all workers change it
    alike, and the last worker's comes back.

    Args:
      step: one worker's step, ``(params, state, *batch) -> (params, state, out)``,
        outside any ``vmap``; ``out`` a pytree of arrays (per-step metrics).
      collective: the workers' `shoal.comms.AxisCollective` (``size`` ``N``).
      params: the workers' parameters, every leaf ``[N, ...]``.
      state: the optimizer state as `hold_uniform` holds it.
      *batches: arrays ``[N, K, ...]``: worker ``i``'s ``K`` steps' batches.

    Returns:
      ``(params, state, outs)``: ``params`` and ``state`` after the ``K`` steps, laid out
      as given, and ``outs`` with leaves ``[N, K, ...]``.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import diloco, update_and_apply
      >>> from shoal.optim.helpers import hold_uniform, take_turns
      >>> coll = AxisCollective("workers", 2)
      >>> tx = diloco(optax.sgd(0.5), collective=coll, sync_every=3, outer=optax.sgd(1.0))
      >>> params = jnp.zeros((2, 1))
      >>> state = hold_uniform(jax.vmap(tx.init, axis_name="workers")(params))
      >>> def step(p, s, target):  # gradient of (p - target)^2 / 2
      ...     p, s = update_and_apply(tx, p - target, s, p)
      ...     return p, s, p[0]
      >>> targets = jnp.array([[[1.0], [1.0]], [[3.0], [3.0]]])  # [N, K = 2 steps, 1]
      >>> params, state, outs = take_turns(step, coll, params, state, targets)
      >>> print(outs)  # the two local steps of a round of 3, per worker
      [[0.5  0.75]
       [1.5  2.25]]
      >>> int(state.step)  # held once: both workers' counters moved alike
      2

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
      Models", arXiv:2311.08105, 2023 (the workers' inner steps, independent between the
      outer steps).
    """
    n = collective.size
    # Per leaf of ``state``, whether it is held once (an empty subtree has no leaf).
    flags = jax.tree.map(
        lambda a, x: None if x is None else a is None, uniform_axes(state), state,
        is_leaf=_is_none,
    )  # fmt: skip
    held = jax.tree.leaves(flags)
    leaves, treedef = jax.tree.flatten(state)
    own = [x for x, h in zip(leaves, held) if not h]  # [N, ...] per-worker leaves
    shared = [x for x, h in zip(leaves, held) if h]

    def state_of(own_i, shared_):
        mine, others = iter(own_i), iter(shared_)
        return treedef.unflatten([next(others) if h else next(mine) for h in held])

    def split(s):
        flat = treedef.flatten_up_to(s)
        return [x for x, h in zip(flat, held) if not h], [x for x, h in zip(flat, held) if h]

    def row(tree, i):
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)

    def put(tree, value, i):
        return jax.tree.map(
            lambda a, v: lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), i, 0), tree, value
        )

    def steps(i, p, s, b):
        with in_turn(collective, i):

            def body(carry, batch):
                p, s, out = step(*carry, *batch)
                return (p, s), out

            (p, s), outs = lax.scan(body, (p, s), b)
        return p, s, outs

    first = jax.eval_shape(steps, 0, row(params, 0), state_of(row(own, 0), shared), row(batches, 0))
    outs = jax.tree.map(lambda x: jnp.zeros((n, *x.shape), x.dtype), first[2])

    def worker(i, carry):
        params, own, _, outs = carry
        p, s, out = steps(i, row(params, i), state_of(row(own, i), shared), row(batches, i))
        mine, theirs = split(s)
        theirs = [t.astype(x.dtype) for t, x in zip(theirs, shared)]
        return put(params, p, i), put(own, mine, i), theirs, put(outs, out, i)

    params, own, shared, outs = lax.fori_loop(0, n, worker, (params, own, shared, outs))
    return params, state_of(own, shared), outs


def _is_none(x: Any) -> bool:
    return x is None
