"""Peer model averaging (KungFu's SPMA and, deterministically, APMA) as an Optax wrapper.

After every step each worker averages its model with the model of one peer and applies
its local update to the average (Brabete's Algorithm 4, lines 4-11)::

    v_r <- (v_r + v_{src(r)}) / 2 + u_r

where ``u_r`` is the update of the inner optimizer computed on ``v_r`` before averaging.
The peers form a permutation, so every worker sends one model and receives one model per
step: a single ``ppermute`` of the model, with no global barrier or all-reduce.

References:
  Brabete, "Kungfu: A Novel Distributed Training System for TensorFlow using Flexible
  Synchronisation", MEng thesis, Imperial College London, 2019, section 3.4.3 and
  Algorithm 4. Lian et al., "Asynchronous Decentralized Parallel Stochastic Gradient
  Descent", ICML 2018.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from shoal.checks import check_int
from shoal.comms.agreement import check_same_structure
from shoal.comms.collective import Collective, ppermute_switch
from shoal.comms.wire import WireCount, WireMeter, tree_nbytes
from shoal.optim._prefetch import PREFETCHED, prefetching
from shoal.optim._validation import (
    check_collective,
    check_floating_leaves,
    check_tree_like,
    checked,
    require_params,
)

STRATEGIES = ("round_robin", "random")

# Each pool entry is one branch of a lax.switch, i.e. one compiled ppermute.
MAX_POOL = 64


class PeerAveragingState(NamedTuple):
    """State of `peer_averaging`.

    Attributes:
      inner_state: state of the local optimizer.
      step: int32 count of updates done, the 0-based index of the next one; it picks the
        peers, so it must be the same on every worker.
      history: with ``staleness = s > 0``, this worker's models before each of its last
        ``s`` updates (leading axis ``s``, a ring buffer indexed by ``step % s``); None
        when ``s == 0``.
      wire: bytes sent and received by the most recent update and since init.
    """

    inner_state: Any
    step: jax.Array
    history: Any
    wire: WireMeter


def peer_averaging(
    inner: optax.GradientTransformation,
    *,
    collective: Collective,
    strategy: str = "round_robin",
    staleness: int = 0,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Synchronous peer model averaging: average with one peer's model every step.

    Then apply the local update of ``inner`` (the thesis's Algorithm 4)::

        v <- (v + v_peer) / 2 + u,     u, inner_state = inner.update(g, inner_state, v)

    ``update(grads, state, params)`` needs ``params`` (``v``) and returns
    ``(v_peer - v) / 2 + u``, so ``optax.apply_updates`` gives the averaged model plus
    the local update. ``u`` is computed on the model before averaging, as in the thesis.

    Peer selection: at step ``t`` (``state.step``, 0-based) worker ``r`` sends its model
    to ``perm_t[r]`` and receives from ``perm_t^{-1}[r]``; ``perm_t`` is a permutation
    without fixed points, so every worker sends and receives exactly one model.
    `peer_permutation` returns ``perm_t`` on the host.

    * ``"round_robin"``: the shift ``k = 1 + (t mod (N - 1))`` cycles through ``1..N-1``
      and ``perm_t[r] = (r + k) mod N``, so in ``N - 1`` steps every worker hears from
      every other one.
    * ``"random"``: ``ppermute`` needs static permutations, so the host draws a pool of
      ``min(64, D_N)`` distinct derangements (``D_N`` = their number; rejection sampling
      of uniform permutations from ``numpy.random.default_rng(seed)``). Step ``t`` uses
      pool entry ``jax.random.randint(fold_in(key(seed), t), (), 0, len(pool))``, the
      same on every worker. For ``N <= 5`` the pool holds every derangement, so the
      choice is uniform over all of them; for larger ``N`` it is uniform over the pool.

    The thesis's workers pick their peers independently (random or round-robin
    requests); here every step is a permutation so that the exchange is one collective
    and each model is requested exactly once per step.

    Staleness: with ``staleness = s > 0`` a worker averages with the model its peer held
    before the peer's update ``s`` steps earlier (the initial model while ``t < s``),
    ``v_t <- (v_t + v_peer_{t-s}) / 2 + u_t``. This models the asynchronous variant
    (APMA), where a prefetched model is served from a model store a few steps behind, but
    deterministically: the delay is fixed, not whatever the network produced. Each
    worker keeps its own last ``s`` models in ``state.history`` (``s`` times the param
    memory) and sends the oldest.

    Wire: ``n`` bytes sent and ``n`` received per step (``n`` = param bytes).

    Start every worker from the same model (e.g. ``collective.broadcast(params, 0)``),
    as Algorithm 4 does; averaging also works from different models. See
    `shoal.optim.helpers.same_model_check`, which checks it (``shoal-run`` does).

    Args:
      inner: the local optimizer, any optax transformation.
      collective: the workers (`shoal.comms.Collective`), at least 2.
      strategy: ``"round_robin"`` or ``"random"``.
      staleness: ``s >= 0``, how many steps old the peer's model is.
      seed: int ``>= 0``, the shared seed of the ``"random"`` strategy.

    With ``optax.inject_hyperparams``, pass ``static_args=("strategy", "staleness",
    "seed")``.

    Returns:
      a `shoal.optim.PrefetchingTransformation` (an
      ``optax.GradientTransformationExtraArgs``) whose ``init(params)`` returns
      a `PeerAveragingState` and whose ``update(updates, state, params=None)``
      returns ``(updates, new_state)``; ``optax.apply_updates(params, updates)``
      is the averaged model plus the local update. Its ``prefetch(state, params)`` is
      the step's exchange alone (it reads no gradient), which `skip_nonfinite` with
      ``in_place="apply"`` makes before its in-place branch and hands to ``update`` as
      ``prefetched`` (`shoal.optim._prefetch`).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from shoal.comms import AxisCollective
      >>> coll = AxisCollective("workers", 2)
      >>> from shoal.optim import peer_averaging
      >>> coll = AxisCollective("workers", 3)
      >>> tx = peer_averaging(optax.sgd(0.0), collective=coll)  # lr 0: averaging alone
      >>> def step(params):
      ...     updates, _ = tx.update(jnp.zeros_like(params), tx.init(params), params)
      ...     return optax.apply_updates(params, updates)
      >>> print(jax.vmap(step, axis_name="workers")(jnp.array([[0.0], [3.0], [6.0]]))[:, 0])
      [3.  1.5 4.5]

    References:
      Brabete, "Kungfu", MEng thesis, Imperial College London, 2019, section 3.4.3 and
      Algorithm 4.
    """
    check_collective(collective)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    check_int("staleness", staleness, 0)
    check_int("seed", seed, 0)
    size = collective.size
    if size < 2:
        raise ValueError(
            f"collective: peer averaging needs at least 2 workers, got collective.size={size}"
        )
    inner = optax.with_extra_args_support(inner)
    staleness = int(staleness)
    perms = _static_perms(strategy, size, int(seed))
    pick = functools.partial(_perm_index, strategy, size, int(seed))

    def init_fn(params):
        check_same_structure(params, collective)
        check_floating_leaves("params", params)
        history = None
        if staleness:
            history = jax.tree.map(
                lambda p: jnp.broadcast_to(jnp.asarray(p), (staleness, *jnp.shape(p))), params
            )
        return PeerAveragingState(
            inner_state=inner.init(params),
            step=jnp.zeros((), jnp.int32),
            history=history,
            wire=WireMeter.zero(),
        )

    def exchange(state, params):
        """The model this worker receives at ``state.step``: its peer's ``params``, or
        with staleness the model its peer kept ``staleness`` steps ago."""
        t = collective.uniform(state.step)  # the same on every worker: a real switch
        sent = params
        if staleness:
            slot = t % staleness
            sent = jax.tree.map(
                lambda h: lax.dynamic_index_in_dim(h, slot, 0, False), state.history
            )
        index = pick(t)
        return jax.tree.map(lambda x: ppermute_switch(collective, x, perms, index), sent)

    def update_fn(updates, state, params=None, **extra_args):
        require_params("peer_averaging", params)
        received = extra_args.pop(PREFETCHED, None)
        if received is None:
            received = exchange(state, params)
        else:
            check_tree_like("peer_averaging", PREFETCHED, received, params, "params")
        inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        t = collective.uniform(state.step)
        history = state.history
        if staleness:
            history = jax.tree.map(
                lambda h, p: lax.dynamic_update_index_in_dim(
                    h, p.astype(h.dtype), t % staleness, 0
                ),
                history,
                params,
            )
        out = jax.tree.map(
            lambda q, p, u: ((q - p) / 2 + u).astype(u.dtype), received, params, inner_updates
        )
        n = tree_nbytes(params)
        wire = state.wire.record(WireCount.of(n, n))
        return out, PeerAveragingState(inner_state, t + 1, history, wire)

    tx = optax.GradientTransformationExtraArgs(
        init_fn, checked("peer_averaging", PeerAveragingState, update_fn)
    )
    return prefetching(tx, exchange)


def peer_permutation(strategy: str, size: int, step: int, seed: int = 0) -> tuple[int, ...]:
    """The permutation `peer_averaging` uses at 0-based step ``step`` (host-side).

    ``perm[r]`` is the rank that worker ``r`` sends its model to; for ``"round_robin"``
    ``perm[r] = (r + 1 + (step mod (size - 1))) mod size``.

    Args:
      strategy: ``"round_robin"`` or ``"random"``, as given to `peer_averaging`.
      size: the number of workers (int >= 2).
      step: the 0-based step (int >= 0).
      seed: the ``"random"`` strategy's shared seed (int >= 0).

    Returns:
      a tuple of ``size`` ints, ``perm[r]`` the rank worker ``r`` sends to.

    Example:
      >>> from shoal.optim.helpers import peer_permutation
      >>> peer_permutation("round_robin", 4, 0), peer_permutation("round_robin", 4, 1)
      ((1, 2, 3, 0), (2, 3, 0, 1))

    References:
      Brabete, "Kungfu", MEng thesis, Imperial College London, 2019, section
      3.4.3.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    check_int("size", size, 2)
    check_int("step", step, 0)
    check_int("seed", seed, 0)
    perms = _static_perms(strategy, int(size), int(seed))
    return perms[int(_perm_index(strategy, int(size), int(seed), jnp.int32(step)))]


def _perm_index(strategy: str, size: int, seed: int, t: jax.Array) -> jax.Array:
    """Index into `_static_perms` at step ``t``: identical on every worker."""
    t = jnp.asarray(t, jnp.int32)
    if strategy == "round_robin":
        return t % (size - 1)
    pool = len(_derangement_pool(size, seed))
    return jax.random.randint(jax.random.fold_in(jax.random.key(seed), t), (), 0, pool)


def _static_perms(strategy: str, size: int, seed: int) -> tuple[tuple[int, ...], ...]:
    if strategy == "round_robin":
        return tuple(tuple((r + k) % size for r in range(size)) for k in range(1, size))
    return _derangement_pool(size, seed)


@functools.cache
def _derangement_pool(size: int, seed: int) -> tuple[tuple[int, ...], ...]:
    # Distinct draws: with fewer derangements than MAX_POOL (N <= 5) the pool is all of
    # them, so the per-step choice is exactly uniform over derangements.
    rng = np.random.default_rng(seed)
    target = min(MAX_POOL, _count_derangements(size))
    pool: dict[tuple[int, ...], None] = {}
    identity = np.arange(size)
    while len(pool) < target:
        p = rng.permutation(size)
        if not np.any(p == identity):
            pool.setdefault(tuple(int(d) for d in p), None)
    return tuple(pool)


def _count_derangements(size: int) -> int:
    """``D_n = (n - 1) (D_{n-1} + D_{n-2})``, stopping once it exceeds `MAX_POOL`."""
    d_prev, d = 1, 0  # D_0, D_1
    for n in range(2, size + 1):
        d_prev, d = d, (n - 1) * (d + d_prev)
        if d > MAX_POOL:
            return d
    return d
