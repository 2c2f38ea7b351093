"""GTC: gradient threshold compression (Strom 2015) with a fused 1+31-bit exchange.

Per worker ``i`` and element, with the residual ``r_i`` starting at 0::

    a   = g_i + r_i
    q_i = +tau where a > tau, -tau where a < -tau, 0 elsewhere
    r_i <- a - q_i
    update = (1/N) sum_j q_j   (average=True)   or   sum_j q_j   (average=False)

References:
  Strom, "Scalable distributed DNN training using commodity GPU cloud computing",
  Interspeech 2015. Ladkat et al., "Two Tiered Distributed Training Algorithm for
  Acoustic Modeling", section 2.1.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from shoal.comms.agreement import check_same_structure
from shoal.comms.collective import Collective
from shoal.comms.shards import check_sharded_alike
from shoal.comms.wire import WireCount, WireMeter, all_gather_bytes
from shoal.kernels import gtc_pack_parts, gtc_unpack
from shoal.optim._validation import check_collective, check_floating_leaves, check_positive, checked
from shoal.trees import find_instances

MAX_BUFFER_ELEMENTS = 2**31 - 1  # 31 index bits per word


class GTCState(NamedTuple):
    """State of `gtc`.

    Attributes:
      residual: everything not sent yet, a float32 tree like the params. The exchanged
        buffer is its leaves raveled and concatenated in ``jax.tree.leaves`` order; it is
        never materialised (`shoal.kernels.gtc_pack_parts`), so each leaf is updated in
        place.
      offset: int32 start of the cyclic selection window for the next step.
      sent: int32 elements this worker sent in the most recent update (its density is
        ``sent / n``; the wire always carries the full ``capacity`` buffer).
      wire: bytes of the most recent update and since init.
    """

    residual: Any
    offset: jax.Array
    sent: jax.Array
    wire: WireMeter

    ERROR_FEEDBACK = ("residual",)  # `shoal.optim.helpers.error_feedback_mask`


def resolve_capacity(capacity: int | float, n: int) -> int:
    """Words per buffer for ``n`` elements: a fraction of ``n`` (float in (0, 1], rounded,
    at least 1) or an absolute count (int >= 1, clipped to ``n``)."""
    if isinstance(capacity, bool) or not isinstance(capacity, (int, float)):
        raise ValueError(f"capacity must be a float in (0, 1] or an int >= 1, got {capacity!r}")
    if isinstance(capacity, float):
        if not 0.0 < capacity <= 1.0:
            raise ValueError(f"capacity as a fraction must lie in (0, 1], got {capacity}")
        return max(1, min(n, round(capacity * n)))
    if capacity < 1:
        raise ValueError(f"capacity as a count must be >= 1, got {capacity}")
    return min(n, capacity)


def gtc(
    threshold: float,
    *,
    collective: Collective,
    capacity: int | float = 0.02,
    average: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Strom's threshold compression: send ``+-threshold`` where ``|g + r| > threshold``.

    Maps each worker's local gradient to the aggregated update (identical on every
    worker); chain it before ``optax.sgd``/``optax.momentum``. All leaves are fused
    into one float32 buffer, so a step is a single all-gather of ``capacity + 1``
    int32 words per worker: a header (the count of sent words) and the words
    (bit 31 = sign, 1 meaning ``-tau``; bits 0-30 = flat index in the buffer).

    Capacity rule: when more elements qualify than fit, the first ``capacity``
    qualifying elements in cyclic index order from ``offset`` are sent; ``offset``
    advances by ``capacity`` (mod the buffer size) every step, so any element that
    keeps qualifying is sent within ``ceil(n / capacity)`` steps. Unsent elements
    stay in the residual: no gradient mass is lost.

    Non-finite gradients: a NaN is never sent (``|NaN| > tau`` is false) and an Inf is
    sent as ``+-tau`` and stays Inf, so either stays in the residual for ever. Wrap the
    chain in `shoal.optim.skip_nonfinite`, which skips such a step on every worker and
    keeps the residual as it was.

    Use with ``optax.inject_hyperparams`` via ``static_args=("capacity",)``; the
    threshold may then be scheduled.

    Args:
      threshold: ``tau > 0``.
      collective: the workers that exchange (`shoal.comms.Collective`).
      capacity: words per worker per step, a fraction of the elements (float in
        (0, 1]) or an absolute count (int >= 1, clipped to the element count).
      average: divide the sum of the workers' ``q`` by the number of workers.

    Returns:
      an ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` returns
      a `GTCState` and whose ``update(updates, state, params=None)`` returns
      ``(updates, new_state)``; the updates are the aggregated quantised gradient,
      identical on every worker.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from shoal.comms import AxisCollective
      >>> coll = AxisCollective("workers", 2)
      >>> from shoal.optim import gtc
      >>> tx = gtc(0.5, collective=coll, capacity=2)
      >>> def step(g):
      ...     updates, state = tx.update(g, tx.init(g))
      ...     return updates, state.residual
      >>> grads = jnp.array([[0.9, 0.2], [0.1, -0.7]])
      >>> updates, residual = jax.vmap(step, axis_name="workers")(grads)
      >>> print(updates)
      [[ 0.25 -0.25]
       [ 0.25 -0.25]]
      >>> print(residual.round(3))
      [[ 0.4  0.2]
       [ 0.1 -0.2]]

    References:
      Strom, "Scalable distributed DNN training using commodity GPU cloud
      computing", Interspeech 2015. Ladkat et al., "Two Tiered Distributed
      Training Algorithm for Acoustic Modeling", section 2.1.
    """
    check_collective(collective)
    check_positive("threshold", threshold)
    resolve_capacity(capacity, 1)  # type and range checks before any data is seen
    n_workers = collective.size
    inits: set = set()  # (treedef, leaf shapes) of the params given to init

    def layout(tree):
        sizes = [int(math.prod(x.shape)) for x in jax.tree.leaves(tree)]
        n = sum(sizes)
        if n > MAX_BUFFER_ELEMENTS:
            raise ValueError(
                f"gtc fuses all leaves into one buffer of at most 2**31 - 1 elements "
                f"(31 index bits); got {n}"
            )
        return sizes, n

    def init_fn(params):
        check_same_structure(params, collective)
        check_floating_leaves("params", params)
        layout(params)
        leaves, treedef = jax.tree.flatten(params)
        inits.add((treedef, tuple(jnp.shape(x) for x in leaves)))
        return GTCState(
            residual=jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), params),
            offset=jnp.zeros((), jnp.int32),
            sent=jnp.zeros((), jnp.int32),
            wire=WireMeter.zero(),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, treedef = jax.tree.flatten(updates)
        sizes, n = layout(updates)
        shapes = (treedef, tuple(jnp.shape(x) for x in leaves))
        r_leaves, r_treedef = jax.tree.flatten(state.residual)
        r_shapes = (r_treedef, tuple(jnp.shape(r) for r in r_leaves))
        if (inits and shapes not in inits) or shapes != r_shapes:
            show = lambda d, sh: str(jax.tree.unflatten(d, [tuple(x) for x in sh]))
            expected = " or ".join(show(*i) for i in inits) or "the params given to init"
            raise ValueError(
                f"gtc: the gradient (updates) must have the tree structure and leaf shapes "
                f"of the params given to init, {expected}; got {show(*shapes)} ({n} elements)"
            )
        if n == 0:
            return updates, state
        cap = resolve_capacity(capacity, n)
        tau = jnp.asarray(threshold, jnp.float32)

        check_sharded_alike("gtc", leaves, collective)
        # a = g + r, leaf by leaf, added where the pack reads it and where each leaf's
        # remainder is written in place of its residual: no buffer of the whole model.
        grads = [x.astype(jnp.float32) for x in leaves]
        words, count, remainders = gtc_pack_parts(grads, tau, cap, state.offset, residuals=r_leaves)
        residual = jax.tree.unflatten(r_treedef, remainders)

        header = count.astype(jnp.int32)
        gathered = collective.all_gather(jnp.concatenate([header[None], words]))
        total = gtc_unpack(gathered[:, 1:], gathered[:, 0], tau, n)
        if average:
            total = total / n_workers
        # (cap words + 1 header) int32 per worker, all-gathered.
        wire = WireCount.of(*all_gather_bytes(4 * (cap + 1), n_workers))
        offset = ((state.offset.astype(jnp.uint32) + cap) % n).astype(jnp.int32)
        new_state = GTCState(residual, offset, header, state.wire.record(wire))
        return jax.tree.unflatten(treedef, _split_like(total, sizes, leaves)), new_state

    return optax.GradientTransformationExtraArgs(init_fn, checked("gtc", GTCState, update_fn))


def _split(flat, sizes):
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return [flat[..., lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]


def _split_like(flat, sizes, leaves):
    return [p.reshape(x.shape).astype(x.dtype) for p, x in zip(_split(flat, sizes), leaves)]


def residual_tree(state: GTCState, params: Any) -> Any:
    """``state.residual`` with the tree structure and leaf shapes of ``params``.

    The residual is kept as such a tree; a flat one (the float32[n] buffer of states made
    before the residual was kept leaf by leaf) is split and reshaped.

    Args:
      state: a `GTCState` (of one worker, or stacked over leading worker dimensions).
      params: the params (or gradient) tree given to ``init``, or their shapes.

    Returns:
      a float32 tree like ``params``; stacked states keep their leading dimensions.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import gtc
      >>> from shoal.optim._gtc import residual_tree
      >>> params = {"b": jnp.zeros(2), "w": jnp.zeros((2, 3))}
      >>> state = gtc(0.5, collective=AxisCollective("w", 1)).init(params)
      >>> jax.tree.map(jnp.shape, residual_tree(state, params))
      {'b': (2,), 'w': (2, 3)}
    """
    leaves, treedef = jax.tree.flatten(params)
    if jax.tree.structure(state.residual) == treedef:
        return state.residual
    sizes = [int(math.prod(jnp.shape(x))) for x in leaves]
    lead = state.residual.shape[:-1]
    parts = [p.reshape(*lead, *jnp.shape(x)) for p, x in zip(_split(state.residual, sizes), leaves)]
    return jax.tree.unflatten(treedef, parts)


def sent_fraction(opt_state: Any) -> jax.Array | None:
    """Elements sent in the most recent update over elements compressed, summed over every
    `gtc` inside ``opt_state``; None when there is none."""
    states = find_instances(opt_state, GTCState)
    if not states:
        return None
    sent = sum(s.sent for s in states)
    # A state stacked over workers (outside vmap) has a leading axis on ``sent`` and on
    # every residual: those axes are the workers', not elements compressed.
    batch = jnp.ndim(states[0].sent)
    total = sum(
        sum(math.prod(x.shape[batch:]) for x in jax.tree.leaves(s.residual)) for s in states
    )
    return sent / max(total, 1)
