"""Streaming DiLoCo: DiLoCo whose outer step syncs one fragment of the model at a time.

The parameter leaves are cut into ``F`` fragments (contiguous runs of leaves in
``jax.tree.leaves`` order, balanced in bytes). Every worker takes an inner step on every
update; fragment ``p`` runs its own outer step every ``H = sync_every`` updates, offset by
``p H // F`` updates from fragment 0, so the workers exchange about ``1/F`` of the model
at a time instead of all of it at once (the peak bandwidth drops ``F``-fold)::

    on update t with (t - p H // F) % H == 0:
        delta_p        = theta_g[p] - (1/N) sum_i theta_i[p]     (fragment p only)
        u, s_p         = outer.update(delta_p, s_p, theta_g[p])
        theta_g[p]    <- theta_g[p] + u

The workers then merge their fragment with the new global one, on the same update
(``overlap = 0``) or, with ``overlap = tau > 0``, after training on their local copy for
``tau`` more updates while the exchange would be in flight::

    on update t + tau:   theta_i[p] <- mix theta_i[p] + (1 - mix) theta_g[p]

(``mix = 0`` restarts the fragment from ``theta_g[p]``, as DiLoCo does.)

The exchange is a float32 all-reduce or any `shoal.comms.Compressor` (e.g. 4-bit
``Quantized("fp4")`` as in the paper), with its error feedback per fragment in the state.

References:
  Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
  Distributed Free Lunch", arXiv:2501.18512, 2025.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shoal.checks import check_int, check_real
from shoal.comms.agreement import check_same_structure
from shoal.comms.codecs import Compressor, tree_mean
from shoal.comms.collective import Collective, uniform_over
from shoal.comms.wire import WireCount, WireMeter, all_reduce_bytes, tree_nbytes
from shoal.dtypes import apply_updates
from shoal.optim._diloco import _cast_like, check_outer_args
from shoal.optim._inplace import run_if
from shoal.optim._validation import (
    check_floating_leaves,
    checked,
    require_params,
)

__all__ = ["StreamingDiLoCoState", "split_fragments", "streaming_diloco"]


class StreamingDiLoCoState(NamedTuple):
    """State of `streaming_diloco`.

    Attributes:
      inner_state: the inner optimizer's state on this worker (never reset).
      outer_states: one outer optimizer state per fragment, ``outer.init`` of the params
        tree whose leaves outside the fragment are ``None`` (the same on every worker).
      global_params: ``theta_g``, every fragment as of its most recent outer step (the
        ``params`` given to ``init`` before the first).
      pending: one int32 per fragment: the update number ``t`` at which its most recent
        outer step is still to be mixed into the local params (``overlap > 0``), 0 when
        none is pending. The global fragment to mix in is ``global_params``' own: it
        cannot change before the merge, since ``overlap < sync_every``.
      exchange_memory: one error-feedback tuple per fragment (``exchange.init``; ``()``
        without ``exchange`` or for a codec without memory).
      step: int32 count of updates done.
      rounds: int32 count of fragment outer steps done (one per fragment sync).
      wire: bytes of this transformation's own collectives in the most recent update and
        since init.
    """

    inner_state: Any
    outer_states: tuple
    global_params: Any
    pending: tuple
    exchange_memory: tuple
    step: jax.Array
    rounds: jax.Array
    wire: WireMeter

    ERROR_FEEDBACK = ("exchange_memory",)  # `shoal.optim.helpers.error_feedback_mask`

    # The same on every worker: simulated workers can hold them once
    # (`shoal.optim.helpers.uniform_axes`).
    RANK_UNIFORM = ("outer_states", "global_params", "pending", "step", "rounds")


def split_fragments(params: Any, num_fragments: int) -> tuple[tuple[int, ...], ...]:
    """The leaves of each fragment: contiguous runs in ``jax.tree.leaves`` order.

    Cut ``k`` (``k = 1 .. F-1``) ends fragment ``k-1`` after the first ``c_k`` leaves, with
    ``c_k`` the count whose cumulative bytes ``C(c_k)`` is nearest ``k * total / F`` (ties:
    the smaller count), among the counts that leave every fragment at least one leaf::

        c_k = argmin_{c_{k-1} < c <= n - (F - k)} |C(c) - k total / F|

    A leaf is never split, so a fragment holds at least one whole leaf.

    Args:
      params: a pytree of arrays (or `jax.ShapeDtypeStruct`).
      num_fragments: ``F``, an int in ``[1, number of leaves]``.

    Returns:
      ``F`` tuples of leaf indices (positions in ``jax.tree.leaves(params)``), in order.

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.optim.helpers import split_fragments
      >>> params = {"a": jnp.zeros(8), "b": jnp.zeros(2), "c": jnp.zeros(4), "d": jnp.zeros(4)}
      >>> split_fragments(params, 3)
      ((0,), (1,), (2, 3))

    References:
      Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
      Distributed Free Lunch", arXiv:2501.18512, 2025 (fragments of whole layers; the
      paper also tries a strided pattern, layer ``l`` in fragment ``l mod F``).
    """
    sizes = [tree_nbytes(x) for x in jax.tree.leaves(params)]
    n = len(sizes)
    num_fragments = check_int("num_fragments", num_fragments, 1)
    if num_fragments > n:
        raise ValueError(
            f"num_fragments must be <= the number of parameter leaves ({n}), got "
            f"{num_fragments}: a leaf is never split"
        )
    cumulative = np.concatenate([[0], np.cumsum(sizes)])
    total = int(cumulative[-1])
    cuts = [0]
    for k in range(1, num_fragments):
        target = k * total / num_fragments
        lo, hi = cuts[-1] + 1, n - (num_fragments - k)
        cuts.append(min(range(lo, hi + 1), key=lambda c: (abs(cumulative[c] - target), c)))
    cuts.append(n)
    return tuple(tuple(range(a, b)) for a, b in zip(cuts[:-1], cuts[1:]))


def streaming_diloco(
    inner: optax.GradientTransformation,
    *,
    collective: Collective,
    sync_every: int,
    outer: optax.GradientTransformation,
    num_fragments: int,
    overlap: int = 0,
    mix: float = 0.5,
    exchange: Compressor | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Streaming DiLoCo: DiLoCo's outer step on one fragment of the model at a time.

    The parameter leaves are split into ``F = num_fragments`` fragments: contiguous runs
    of leaves in ``jax.tree.leaves`` order (the model's layer order), greedily balanced in
    bytes, a leaf never split (`split_fragments`). Each worker ``i`` applies ``inner`` to
    its own gradient at every update ``t = 1, 2, ...`` (``t = state.step + 1``, the
    update's number). Fragment ``p`` syncs on the updates
    with ``(t - p H // F) % H == 0``, ``H = sync_every``: fragment 0 on ``H, 2H, ...``
    (diloco's schedule), fragment ``p`` first after ``p H // F`` updates, then every
    ``H``. After that update's inner step, reaching ``theta_i``, all ``N`` workers run
    fragment ``p``'s own outer step::

        delta_p        = theta_g[p] - (1/N) sum_i theta_i[p]   (one all-reduce, fragment p)
        u, s_p         = outer.update(delta_p, s_p, theta_g[p])
        theta_g[p]    <- theta_g[p] + u

    ``s_p = outer.init(params with the leaves outside p set to None)``, one state per
    fragment, so with ``F = 1`` it is diloco's state and with ``F > 1`` each fragment has
    its own momentum, as in the paper. Every worker then merges its fragment ``p`` with
    the new global one, after the inner step of update ``t + tau``, ``tau = overlap``::

        theta_i[p] <- mix theta_i[p] + (1 - mix) theta_g[p]

    With ``overlap = 0`` the merge is on the syncing update itself; with ``tau > 0`` the
    workers keep training fragment ``p`` locally for ``tau`` updates first (the exchange
    would be in flight). The rule does not depend on the delay, as the paper's merge and
    torchft's ``fragment_update_alpha`` (the same weight on the local params). ``mix = 0``
    replaces the fragment by ``theta_g[p]``: ``num_fragments=1, overlap=0, mix=0,
    exchange=None`` is `shoal.optim.diloco` exactly.
    ``exchange``: None all-reduces the fragment's ``theta_g[p] - theta_i[p]`` leaves in
    float32 (mean); a `shoal.comms.Compressor` averages them flattened into one float32
    vector (``exchange.mean``), with its error feedback per fragment in the state. Only
    syncing updates communicate, each a branch on the rank-uniform step counter, so an
    update pays for the fragments it syncs only: ``2 (N - 1) / N`` times the fragment's
    bytes each way in float32, ``exchange.wire_bytes(n_p, N)`` with a compressor, in
    ``state.wire.step``. With ``F <= H`` the offsets ``p H // F`` differ, so at most one
    fragment syncs per update and the peak is the largest fragment's, about ``1/F`` of
    diloco's; ``H % F != 0`` spaces the fragments' offsets unevenly (floor); ``F > H``
    puts several fragments on one update.

    ``update(grads, state, params)`` needs ``params`` (this worker's model) and returns
    updates with ``optax.apply_updates(params, updates)`` this worker's next model.
    Every worker must init from the same model, e.g. ``collective.broadcast(params, 0)``;
    see `shoal.optim.helpers.same_model_check`, which checks it (``shoal-run`` does).
    `shoal.optim.skip_nonfinite` around it skips steps with a NaN/Inf gradient (its
    4-byte flag is all-reduced every update).

    Args:
      inner: the per-worker optimizer (e.g. ``optax.adamw(...)``), applied every update.
      collective: the workers whose models are averaged (`shoal.comms.Collective`).
      sync_every: ``H``, updates between two syncs of a fragment, an int >= 1.
      outer: the outer optimizer (DiLoCo: ``optax.sgd(0.7, momentum=0.9,
        nesterov=True)``), one state per fragment.
      num_fragments: ``F``, an int in ``[1, number of parameter leaves]``.
      overlap: ``tau``, an int in ``[0, sync_every)``: updates between a fragment's
        outer step and its merge into the local params.
      mix: in ``[0, 1]``, the local params' weight in the merge, at every ``overlap``
        (0: replace by ``theta_g[p]``, as diloco and torchft's default; the paper's 0.5).
      exchange: None (float32 all-reduce) or a `shoal.comms.Compressor` such as
        ``shoal.comms.Quantized("fp4")``.

    Returns:
      an ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` returns a
      `StreamingDiLoCoState` and whose ``update(updates, state, params)`` returns
      ``(updates, new_state)``; ``optax.apply_updates(params, updates)`` is this worker's
      next model.

    Example:
      Two workers, two one-value fragments ``a`` and ``b``, ``sync_every=2``: ``b`` syncs
      on update 1, ``a`` on update 2. Inner SGD (lr 0.5) pulls worker 0 towards 1 and
      worker 1 towards 3; with ``outer = optax.sgd(1.0)`` and ``mix=0`` a sync sets the
      fragment to the workers' mean. ``b``: 0.5 and 1.5 after update 1, synced to 1,
      then one more inner step (1 and 2); ``a``: 0.75 and 2.25 after update 2, synced to
      1.5:

      >>> import jax, jax.numpy as jnp, optax
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import streaming_diloco
      >>> coll = AxisCollective("workers", 2)
      >>> tx = streaming_diloco(optax.sgd(0.5), collective=coll, sync_every=2,
      ...                       outer=optax.sgd(1.0), num_fragments=2, mix=0.0)
      >>> def train(params, target):
      ...     state = tx.init(params)
      ...     for _ in range(2):
      ...         grads = jax.tree.map(lambda p: p - target, params)
      ...         updates, state = tx.update(grads, state, params)
      ...         params = optax.apply_updates(params, updates)
      ...     return params, state.wire.total.sent
      >>> start = {"a": jnp.zeros((2, 1)), "b": jnp.zeros((2, 1))}
      >>> params, sent = jax.vmap(train, axis_name="workers")(start, jnp.array([[1.0], [3.0]]))
      >>> print(params["a"].ravel(), params["b"].ravel())
      [1.5 1.5] [1. 2.]
      >>> sent.numpy()  # 2 syncs of one float32: 2 (N - 1) / N * 4 = 4 bytes each
      array([8, 8])

    References:
      Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
      Distributed Free Lunch", arXiv:2501.18512, 2025.
    """
    sync_every = check_outer_args(collective, inner, outer, sync_every, exchange)
    num_fragments = check_int("num_fragments", num_fragments, 1)
    overlap = check_int(
        "overlap",
        overlap,
        0,
        sync_every - 1,
        why=" (< sync_every: a fragment's merge comes before its next sync)",
    )
    mix = check_real("mix", mix, 0, 1)
    inner = optax.with_extra_args_support(inner)
    n_workers = collective.size

    def merged(local, theta_p, params_p, out_p):
        # The update that takes params_p to the merge of its local step with theta_g[p].
        # mix = 0 takes theta_g[p] itself, bitwise (no 0 * local, whose NaN would stay).
        new = theta_p if mix == 0.0 else [mix * x + (1.0 - mix) * g for x, g in zip(local, theta_p)]
        return [(m - x).astype(o.dtype) for m, x, o in zip(new, params_p, out_p)]

    offsets = [p * sync_every // num_fragments for p in range(num_fragments)]

    def fragment_tree(treedef, n_leaves, indices, values):
        # The params tree with only this fragment's leaves: the outer optimizer sees the
        # model's own structure (paths, masks), the other leaves as None (no state).
        slots = [None] * n_leaves
        for i, v in zip(indices, values):
            slots[i] = v
        return jax.tree.unflatten(treedef, slots)

    def fragment_sizes(params):
        leaves = jax.tree.leaves(params)
        return [sum(int(np.prod(np.shape(leaves[i]))) for i in idx) for idx in frags_of(params)]

    def frags_of(params):
        return split_fragments(params, num_fragments)

    def init_fn(params):
        check_same_structure(params, collective)
        check_floating_leaves("params", params)
        frags = frags_of(params)
        leaves, treedef = jax.tree.flatten(params)
        outer_states = tuple(
            outer.init(fragment_tree(treedef, len(leaves), idx, [leaves[i] for i in idx]))
            for idx in frags
        )
        if exchange is None:
            memory = tuple(() for _ in frags)
        else:
            # A fragment of zero-size leaves sends nothing (`tree_mean`); its memory is
            # that of one value, as a codec holds none for an empty buffer.
            memory = tuple(exchange.init(max(n, 1), n_workers) for n in fragment_sizes(params))
        return StreamingDiLoCoState(
            inner_state=inner.init(params),
            outer_states=outer_states,
            global_params=jax.tree.map(jnp.array, params),
            pending=tuple(jnp.zeros((), jnp.int32) for _ in frags),
            exchange_memory=memory,
            step=jnp.zeros((), jnp.int32),
            rounds=jnp.zeros((), jnp.int32),
            wire=WireMeter.zero(),
        )

    def update_fn(updates, state, params=None, **extra_args):
        require_params("streaming_diloco", params)
        # Branch on the step counter, the same on every worker: under vmap an update then
        # pays for the fragments it syncs only, not a select over all of them.
        t = uniform_over(collective, state.step) + 1
        inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        frags = frags_of(params)
        p_leaves, treedef = jax.tree.flatten(params)
        u_leaves = treedef.flatten_up_to(inner_updates)
        g_leaves = list(treedef.flatten_up_to(state.global_params))
        out_leaves = list(u_leaves)
        n_leaves = len(p_leaves)
        sizes = fragment_sizes(params)

        outer_states = list(state.outer_states)
        memories = list(state.exchange_memory)
        pending = list(state.pending)
        rounds, wire = state.rounds, WireCount.zero()

        for p, idx in enumerate(frags):
            params_p = [p_leaves[i] for i in idx]
            inner_p = [u_leaves[i] for i in idx]
            if exchange is None:
                nbytes = all_reduce_bytes(tree_nbytes(params_p), n_workers)
            else:
                nbytes = exchange.wire_bytes(sizes[p], n_workers) if sizes[p] else (0, 0)

            def sync(carry, idx=idx, params_p=params_p, inner_p=inner_p, nbytes=nbytes):
                out_p, outer_state, theta_p, memory, _, rounds, wire = carry
                local = apply_updates(params_p, inner_p)
                # All-reduce the distances from theta_g, not the models (as diloco).
                diff = [g - x for g, x in zip(theta_p, local)]
                delta, memory, _ = tree_mean(
                    tuple(diff), memory, collective=collective, exchange=exchange
                )
                delta = list(_cast_like(delta, tuple(theta_p)))
                theta_tree = fragment_tree(treedef, n_leaves, idx, theta_p)
                u, new_outer = outer.update(
                    fragment_tree(treedef, n_leaves, idx, delta), outer_state, theta_tree
                )
                theta_p = jax.tree.leaves(apply_updates(theta_tree, u))
                if overlap == 0:
                    out_p = merged(local, theta_p, params_p, out_p)
                    due = jnp.zeros((), jnp.int32)
                else:
                    due = (t + overlap).astype(jnp.int32)
                return (
                    out_p,
                    _cast_like(new_outer, outer_state),
                    theta_p,
                    memory,
                    due,
                    rounds + 1,
                    wire + WireCount.of(*nbytes),
                )

            carry = (
                [out_leaves[i] for i in idx],
                outer_states[p],
                [g_leaves[i] for i in idx],
                memories[p],
                pending[p],
                rounds,
                wire,
            )
            is_sync = (t - offsets[p]) % sync_every == 0
            out_p, outer_states[p], theta_p, memories[p], pending[p], rounds, wire = run_if(
                is_sync, sync, carry
            )
            for i, o, g in zip(idx, out_p, theta_p):
                out_leaves[i], g_leaves[i] = o, g

        if overlap > 0:
            for p, idx in enumerate(frags):
                params_p = [p_leaves[i] for i in idx]
                inner_p = [u_leaves[i] for i in idx]
                theta_p = [g_leaves[i] for i in idx]

                def merge(carry, params_p=params_p, inner_p=inner_p, theta_p=theta_p):
                    out_p, _ = carry
                    local = apply_updates(params_p, inner_p)
                    return merged(local, theta_p, params_p, out_p), jnp.zeros((), jnp.int32)

                since = t - overlap  # the update whose outer step is merged now
                is_merge = (since >= 1) & ((since - offsets[p]) % sync_every == 0)
                out_p, pending[p] = run_if(
                    is_merge, merge, ([out_leaves[i] for i in idx], pending[p])
                )
                for i, o in zip(idx, out_p):
                    out_leaves[i] = o

        new_state = StreamingDiLoCoState(
            inner_state=inner_state,
            outer_states=tuple(outer_states),
            global_params=jax.tree.unflatten(treedef, g_leaves),
            pending=tuple(pending),
            exchange_memory=tuple(memories),
            step=state.step + 1,
            rounds=rounds,
            wire=state.wire.record(wire),
        )
        return jax.tree.unflatten(treedef, out_leaves), new_state

    return optax.GradientTransformationExtraArgs(
        init_fn,
        checked("streaming_diloco", StreamingDiLoCoState, update_fn, lambda s: s.global_params),
    )
