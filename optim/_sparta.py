"""SPARTA: after every step, average a small random subset of the parameters over the
workers (Exo Labs, "SPARTA: sparse parameter averaging", 2025).

Each worker trains on its own; after update ``t`` the workers average the entries at
``k = ceil(p n)`` indices of every leaf of ``n`` values, drawn from a seed they share::

    I_t      ~ k indices of each leaf, from fold_in(seed, t)   (the same on every worker)
    x_m[I_t] <- (1/M) sum_m' x_m'[I_t]                         (one all-reduce of k values)

References:
  Exo Labs, "SPARTA: Distributed Training with Sparse Parameter Averaging", 2025
  (https://blog.exolabs.net/day-12/; EXO Gym's ``SPARTAStrategy``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from shoal.checks import check_int, check_real
from shoal.comms.agreement import check_same_structure
from shoal.comms.collective import Collective, uniform_over
from shoal.comms.wire import WireCount, WireMeter, all_reduce_bytes
from shoal.dtypes import apply_updates
from shoal.optim._diloco import _check_transformation
from shoal.optim._validation import (
    check_collective,
    check_floating_leaves,
    checked,
    require_params,
)

__all__ = ["SpartaState", "sparta"]


class SpartaState(NamedTuple):
    """State of `sparta`.

    Attributes:
      inner_state: the wrapped transformation's state on this worker.
      step: int32 count of updates done (the index draws' counter).
      wire: bytes of this transformation's own all-reduce (the inner one's are in
        ``inner_state``).
    """

    inner_state: Any
    step: jax.Array
    wire: WireMeter

    RANK_UNIFORM = ("step",)  # `shoal.optim.helpers.uniform_axes`


def sparta(
    inner: optax.GradientTransformation,
    *,
    collective: Collective,
    fraction: float = 0.005,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """SPARTA: ``inner`` on every worker, then a random ``fraction`` of each leaf averaged.

    After ``inner``'s update on this worker, reaching ``x_m``, update ``t = state.step``
    (0, 1, ...) draws ``k = ceil(fraction n)`` indices of each leaf of ``n`` values,
    uniformly with replacement, from ``fold_in(fold_in(PRNGKey(seed), t), j)`` for the
    ``j``-th leaf (``jax.tree.leaves`` order), the same draw on every worker; the
    workers then average those entries (one float32 all-reduce of all leaves' ``k``
    values, concatenated)::

        x_m[I_t] <- (1/M) sum_m' x_m'[I_t]

    and the update returned moves ``params`` to that. An index drawn twice is sent twice
    and averaged to the same value (the draw with replacement costs ``O(k)``, not a
    permutation of ``n``; at ``fraction = 0.5%`` about 0.25% of the draws repeat).

    Wrap `shoal.optim.diloco` to add its outer step every ``H`` updates, as the SPARTA
    post does (``sparta(diloco(...), ...)``): the sparse averages run after each update
    and the outer step's restart makes them a no-op on syncing updates.

    Bytes: ``2 (M - 1) / M`` times ``4 sum_leaves ceil(fraction n)`` each way per update
    (rounded down), in ``state.wire.step``; ``inner``'s own in its state.

    Args:
      inner: the per-worker transformation, any optax transformation whose updates,
        applied to ``params``, give this worker's model (an optimizer, or `diloco`).
      collective: the workers (`shoal.comms.Collective`).
      fraction: ``p``, the share of each leaf averaged per update, in (0, 1] (the post's
        0.05%-0.5%).
      seed: the index draws' seed, the same on every worker, an int.

    Returns:
      an ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` returns a
      `SpartaState` and whose ``update(updates, state, params)`` returns the updates and
      the new state.

    Example:
      Two workers, one leaf of 4, ``fraction=0.5``: the two entries drawn (here 1 and 3)
      are averaged after the plain SGD step, the others keep each worker's value:

      >>> import jax, jax.numpy as jnp, optax
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import sparta
      >>> tx = sparta(optax.sgd(1.0), collective=AxisCollective("workers", 2), fraction=0.5)
      >>> def step(params, grads):
      ...     updates, state = tx.update(grads, tx.init(params), params)
      ...     return optax.apply_updates(params, updates), state.wire.step.sent
      >>> x, sent = jax.vmap(step, axis_name="workers")(
      ...     jnp.zeros((2, 4)), jnp.array([[1.0, 2.0, 3.0, 4.0], [-1.0, -2.0, -3.0, -4.0]]))
      >>> print(x)
      [[-1.  0. -3.  0.]
       [ 1.  0.  3.  0.]]
      >>> int(sent[0])  # 2 float32 values, ring all-reduce over 2 workers
      8

    References:
      Exo Labs, "SPARTA: Distributed Training with Sparse Parameter Averaging", 2025.
    """
    check_collective(collective)
    _check_transformation("inner", inner)
    fraction = check_real("fraction", fraction, 0, 1, open_low=True)
    seed = check_int("seed", seed)
    inner = optax.with_extra_args_support(inner)
    n_workers = collective.size

    def counts(leaves) -> list[int]:
        return [math.ceil(round(fraction * x.size, 9)) if x.size else 0 for x in leaves]

    def init_fn(params):
        check_same_structure(params, collective)
        check_floating_leaves("params", params)
        return SpartaState(
            inner_state=inner.init(params), step=jnp.zeros((), jnp.int32), wire=WireMeter.zero()
        )

    def update_fn(updates, state, params=None, **extra_args):
        require_params("sparta", params)
        inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        # Only the picked entries move: the update elsewhere is the inner one, untouched (no
        # pass over the whole model), and at a picked entry it takes the model to the mean.
        leaves, treedef = jax.tree.flatten(params)
        u_leaves = treedef.flatten_up_to(inner_updates)
        ks = counts(leaves)
        step_key = jax.random.fold_in(
            jax.random.PRNGKey(seed), uniform_over(collective, state.step)
        )
        picks = [
            jax.random.randint(jax.random.fold_in(step_key, j), (k,), 0, x.size)
            for j, (x, k) in enumerate(zip(leaves, ks))
        ]
        here = [x.ravel()[i] for x, i in zip(leaves, picks)]
        values = [
            apply_updates(h, u.ravel()[i]).astype(jnp.float32)
            for h, u, i in zip(here, u_leaves, picks)
        ]
        sizes = [v.shape[0] for v in values]
        if not sum(sizes):  # only zero-size leaves: nothing to average
            return inner_updates, SpartaState(
                inner_state, state.step + 1, state.wire.record(WireCount.zero())
            )
        mean = collective.all_reduce(jnp.concatenate(values), "mean")
        out, start = [], 0
        for x, h, u, i, k in zip(leaves, here, u_leaves, picks, sizes):
            step_to_mean = (mean[start : start + k].astype(x.dtype) - h).astype(u.dtype)
            out.append(u.ravel().at[i].set(step_to_mean).reshape(u.shape))
            start += k
        final = jax.tree.unflatten(treedef, out)
        nbytes = all_reduce_bytes(4 * sum(ks), n_workers)
        wire = state.wire.record(WireCount.of(*nbytes))
        return final, SpartaState(inner_state=inner_state, step=state.step + 1, wire=wire)

    return optax.GradientTransformationExtraArgs(init_fn, checked("sparta", SpartaState, update_fn))
