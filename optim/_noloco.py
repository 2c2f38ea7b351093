"""NoLoCo: DiLoCo without the all-reduce: after ``H`` local steps each worker averages
with one random peer, through a modified Nesterov step (Kolehmainen et al. 2025).

Worker ``i``, paired with ``j`` for this round (``G = {i, j}``, ``n = |G|``), with slow
weights ``phi_i`` and fast (inner) weights ``theta_i``::

    Delta_i = (1/n) sum_{k in G} (phi_k - theta_k)
    delta_i = alpha delta_i - beta Delta_i - gamma (phi_i - (1/n) sum_{k in G} phi_k)
    phi_i  <- phi_i + delta_i;        theta_i <- phi_i

References:
  Kolehmainen, Blagoev, Donaghy, Ersoy & Nies, "NoLoCo: No-all-reduce Low Communication
  Training Method for Large Models", arXiv:2506.10911, 2025.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shoal.checks import check_int
from shoal.comms.agreement import check_same_structure
from shoal.comms.collective import Collective, ppermute_switch, uniform_over
from shoal.comms.wire import WireCount, WireMeter, tree_nbytes
from shoal.dtypes import apply_updates
from shoal.optim._diloco import _cast_like, _check_transformation
from shoal.optim._inplace import run_if
from shoal.optim._validation import (
    check_collective,
    check_floating_leaves,
    check_hyper,
    checked,
    require_params,
)

__all__ = ["NoLoCoState", "noloco", "pairing"]

POOL = 64  # distinct random pairings drawn once; a round picks one of them


class NoLoCoState(NamedTuple):
    """State of `noloco`.

    Attributes:
      inner_state: the inner optimizer's state on this worker (never reset).
      slow: ``phi_i``, this worker's slow (outer) weights.
      momentum: ``delta_i``, this worker's outer momentum.
      step: int32 count of updates done.
      rounds: int32 count of outer steps done (the pairing's counter).
      wire: bytes of this transformation's own exchanges.
    """

    inner_state: Any
    slow: Any
    momentum: Any
    step: jax.Array
    rounds: jax.Array
    wire: WireMeter

    RANK_UNIFORM = ("step", "rounds")  # `shoal.optim.helpers.uniform_axes`


@functools.cache
def _pool(size: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """Random pairings of ``range(size)`` as involutions ``p`` (``p[p[r]] == r``): every
    worker with another, and for an odd ``size`` one worker alone (``p[r] == r``)."""
    rng = np.random.default_rng(seed)
    pool: dict[tuple[int, ...], None] = {}
    for _ in range(50 * POOL):  # few sizes have fewer than POOL pairings: stop on repeats
        order = rng.permutation(size)
        p = list(range(size))
        for a, b in zip(order[0::2], order[1::2]):
            p[a], p[b] = int(b), int(a)
        pool.setdefault(tuple(p), None)
        if len(pool) == POOL:
            break
    return tuple(pool)


def pairing(size: int, outer_step: int, seed: int = 0) -> tuple[int, ...]:
    """The pairing `noloco` uses at its 0-based outer step ``outer_step`` (host-side).

    Args:
      size: the number of workers, an int >= 1.
      outer_step: the 0-based outer step, an int >= 0.
      seed: `noloco`'s ``seed``, an int >= 0.

    Returns:
      a tuple ``p`` of ``size`` ints: ``p[i]`` is worker ``i``'s peer (``i`` itself:
      alone this round, for an odd ``size``), and ``p[p[i]] == i``.

    Example:
      >>> from shoal.optim.helpers import pairing
      >>> p = pairing(4, 0)
      >>> sorted(p) == [0, 1, 2, 3] and all(p[p[i]] == i != p[i] for i in range(4))
      True

    References:
      Kolehmainen et al., "NoLoCo", arXiv:2506.10911, 2025 (pairs of random peers).
    """
    check_int("size", size, 1)
    check_int("outer_step", outer_step, 0)
    check_int("seed", seed, 0)
    pool = _pool(int(size), int(seed))
    return pool[int(_pick(len(pool), int(seed), jnp.int32(outer_step)))]


def _pick(pool: int, seed: int, rounds: jax.Array) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(seed), rounds)
    return jax.random.randint(key, (), 0, pool)


def noloco(
    inner: optax.GradientTransformation,
    *,
    collective: Collective,
    sync_every: int,
    alpha: float = 0.5,
    beta: float = 0.7,
    gamma: float = 0.5,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """NoLoCo: inner steps, then an outer step with one random peer instead of all workers.

    Every worker applies ``inner`` to its own gradient at every update. On every
    ``sync_every``-th update (``H``), after that inner step, reaching ``theta_i``, the
    workers pair up at random (the same pairing on every worker, drawn from ``seed`` and
    the outer step's count; for an odd number one worker sits the round out, ``G =
    {i}``), exchange their slow weights and outer gradients with their peer, and each
    takes the paper's modified Nesterov step (its section 3)::

        Delta_i = (1/n) sum_{k in G} (phi_k - theta_k)
        delta_i = alpha delta_i - beta Delta_i - gamma (phi_i - (1/n) sum_{k in G} phi_k)
        phi_i  <- phi_i + delta_i

    and restarts from ``phi_i``. The ``gamma`` term pulls the pair's slow weights
    together: with no all-reduce the workers' models never become one, and evaluation
    should take their mean. With every worker in one group and ``gamma = 0`` this is
    DiLoCo with heavy-ball outer momentum, ``optax.sgd(beta, momentum=alpha)``.
    The defaults are not the paper's tuned values: tune them.

    Bytes: one peer exchange per round, this worker's slow weights and outer gradient
    (twice the param bytes) sent and as much received, in ``state.wire.step``; no
    collective over all workers.

    Args:
      inner: the per-worker optimizer (e.g. ``optax.adamw(...)``).
      collective: the workers (`shoal.comms.Collective`).
      sync_every: ``H``, updates per round, an int >= 1.
      alpha: the outer momentum, in [0, 1).
      beta: the outer learning rate, > 0.
      gamma: the pull towards the pair's mean slow weights, >= 0.
      seed: the pairings' seed, the same on every worker, an int >= 0.

    Returns:
      an ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` returns a
      `NoLoCoState` and whose ``update(updates, state, params)`` returns the updates
      (``optax.apply_updates(params, updates)`` is the next model) and the new state.

    Example:
      Two workers (always each other's peer), one inner SGD step (lr 1) per round to
      targets 2 and 4: ``Delta = -3`` for both, ``delta = 0.7 * 3``; their slow weights
      agree, so the ``gamma`` term is 0:

      >>> import jax, jax.numpy as jnp, optax
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import noloco
      >>> tx = noloco(optax.sgd(1.0), collective=AxisCollective("workers", 2), sync_every=1)
      >>> def step(params, target):
      ...     updates, state = tx.update(params - target, tx.init(params), params)
      ...     return optax.apply_updates(params, updates)
      >>> x = jax.vmap(step, axis_name="workers")(jnp.zeros((2, 1)), jnp.array([[2.0], [4.0]]))
      >>> print(x.ravel().round(4))
      [2.1 2.1]

    References:
      Kolehmainen, Blagoev, Donaghy, Ersoy & Nies, "NoLoCo: No-all-reduce Low
      Communication Training Method for Large Models", arXiv:2506.10911, 2025.
    """
    check_collective(collective)
    _check_transformation("inner", inner)
    sync_every = check_int("sync_every", sync_every, 1)
    check_hyper("alpha", alpha, 0, 1, open_high=True)
    check_hyper("beta", beta, 0, open_low=True)
    check_hyper("gamma", gamma, 0)
    seed = check_int("seed", seed, 0)
    inner = optax.with_extra_args_support(inner)
    size = collective.size
    perms = _pool(size, seed)

    def init_fn(params):
        check_same_structure(params, collective)
        check_floating_leaves("params", params)
        return NoLoCoState(
            inner_state=inner.init(params),
            slow=jax.tree.map(jnp.array, params),
            momentum=jax.tree.map(jnp.zeros_like, params),
            step=jnp.zeros((), jnp.int32),
            rounds=jnp.zeros((), jnp.int32),
            wire=WireMeter.zero(),
        )

    def update_fn(updates, state, params=None, **extra_args):
        require_params("noloco", params)
        step = uniform_over(collective, state.step)
        inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        n = tree_nbytes(params)

        def outer_step(carry):
            out, slow, momentum, rounds, _ = carry
            local = apply_updates(params, out)
            pseudo = jax.tree.map(jnp.subtract, slow, local)
            index = _pick(len(perms), seed, rounds)
            # One message per leaf: the peer's slow weights and pseudo-gradient, stacked.
            both = jax.tree.map(
                lambda s, d: ppermute_switch(collective, jnp.stack([s, d]), perms, index),
                slow,
                pseudo,
            )
            peer_slow = jax.tree.map(lambda b: b[0], both)
            peer_pseudo = jax.tree.map(lambda b: b[1], both)
            # Alone this round (odd size): the peer is this worker, and both means are its own.
            new_momentum = jax.tree.map(
                lambda d, p, q, s, r: alpha * d - beta * (p + q) / 2 - gamma * (s - r) / 2,
                momentum,
                pseudo,
                peer_pseudo,
                slow,
                peer_slow,
            )
            slow = apply_updates(slow, new_momentum)
            restart = jax.tree.map(lambda s, p, o: (s - p).astype(o.dtype), slow, params, out)
            return (
                restart,
                slow,
                _cast_like(new_momentum, momentum),
                rounds + 1,
                WireCount.of(2 * n, 2 * n),
            )

        carry = (inner_updates, state.slow, state.momentum, state.rounds, WireCount.zero())
        is_sync = (step + 1) % sync_every == 0
        out, slow, momentum, rounds, wire = run_if(is_sync, outer_step, carry)
        return out, NoLoCoState(
            inner_state=inner_state,
            slow=slow,
            momentum=momentum,
            step=state.step + 1,
            rounds=rounds,
            wire=state.wire.record(wire),
        )

    return optax.GradientTransformationExtraArgs(
        init_fn, checked("noloco", NoLoCoState, update_fn, lambda s: s.slow)
    )
