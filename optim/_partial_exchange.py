"""KungFu's partial gradient exchange (PGX): all-reduce one partition of the leaves per step.

The gradient leaves are packed once into ``P`` bins of at most
``C = floor(f * total gradient bytes)`` bytes each (first-fit decreasing), and at step
``t`` only bin ``t mod P`` is averaged over the ``N`` workers; every other leaf keeps the
worker's own gradient::

    g_l <- (1/N) sum_i g_{i,l}    if leaf l is in bin (t mod P)
    g_l <- g_{i,l}                otherwise (worker i's local gradient)

A schedule ``{s_0: f_0, s_1: f_1, ...}`` re-partitions at step ``s_k`` with fraction
``f_k`` and restarts the round robin there: in segment ``k`` the exchanged bin is
``(t - s_k) mod P_k``.

References:
  Brabete, "KungFu: a novel distributed training system for TensorFlow using flexible
  synchronisation", MEng thesis, Imperial College London, 2019: section 3.4.2 (partial
  gradient exchange, Algorithm 3, bin packing), section 4.4 (schedule-based dynamic
  partitioning). Watcharapichat et al., "Ako: Decentralised Deep Learning with Partial
  Gradient Exchange", SoCC 2016.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shoal.checks import check_int
from shoal.comms.agreement import check_same_structure
from shoal.comms.collective import Collective
from shoal.comms.wire import WireCount, WireMeter, all_reduce_bytes, tree_nbytes
from shoal.optim._inplace import switch_inplace
from shoal.optim._validation import check_collective, checked

__all__ = ["PartialExchangeState", "partial_exchange", "partial_exchange_bins"]


class PartialExchangeState(NamedTuple):
    """State of `partial_exchange`.

    Attributes:
      step: int32 count of updates done; the next update is step ``t = step``.
      bin: int32 flat index of the (segment, bin) pair exchanged by the most recent update,
        -1 after init. Segments are numbered in order of their start step (the implicit
        ``budget_fraction`` segment first when the schedule has no key 0) and bin ``b`` of
        segment ``k`` is ``P_0 + ... + P_{k-1} + b``; with no schedule it is just the bin.
        `partial_exchange_bins` gives each segment's bins.
      fraction: float32 budget fraction active at the most recent update (after init: the
        one step 0 will use).
      wire: bytes of the most recent update (the exchanged bin's ring all-reduce) and
        since init.
    """

    step: jax.Array
    bin: jax.Array
    fraction: jax.Array
    wire: WireMeter


def partial_exchange(
    budget_fraction: float,
    *,
    collective: Collective,
    schedule: Mapping[int, float] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Partial gradient exchange: each step, average one bin of leaves over the workers.

    The leaves of the gradient pytree are packed, from their static shapes and dtypes, into
    bins of capacity ``C = floor(budget_fraction * B)`` bytes, ``B`` the total gradient
    bytes, by first-fit decreasing: leaves sorted by bytes, largest first (ties in
    ``jax.tree.leaves`` order), each put into the first bin with room, else into a new bin.
    Step ``t`` all-reduces bin ``t mod P`` (one ``collective.all_reduce(..., op="mean")``
    of its leaves) and leaves the rest local. `partial_exchange_bins` shows the layout.

    We average (``op="mean"``), so an exchanged leaf is on the scale of the local ones
    and any optax optimizer chained after sees gradients of one magnitude; the thesis's
    implementation summed the exchanged partition. With ``budget_fraction = 1`` there is
    one bin and this is exactly `shoal.optim.allreduce_gradients` (same call, same bits,
    same wire bytes). The local leaves differ between workers, so the models drift apart
    as in the thesis: nothing re-synchronises them.

    ``schedule`` re-partitions during training, e.g. ``{0: 1.0, 6000: 0.1}`` (S-SGD,
    then bins of a tenth of the bytes from step 6000): segment ``k`` starts at step
    ``s_k`` with its own packing of ``P_k`` bins and exchanges bin ``(t - s_k) mod P_k``,
    so every switch restarts at bin 0. Steps before the first key use
    ``budget_fraction``; with a key 0 it is unused (but still validated). All packings
    are made at trace time and one in-place switch (`switch_inplace`) on the step counter
    picks the (segment, bin) branch, so a schedule never retraces. Each branch counts only its own
    bytes: ``2 (N - 1) / N`` times the bin's bytes each way. The branch follows the
    state's step counter, so every worker must init together and make every update (on
    MPI, workers on different steps would join different all-reduces).
    `shoal.optim.skip_nonfinite` around the chain checks every leaf, exchanged or not
    (the local leaves are applied too), and keeps the step counter on a skipped step.

    Use with ``optax.inject_hyperparams`` via ``static_args=("budget_fraction",)``: the
    packing is static, so the fraction cannot be a traced value.

    Args:
      budget_fraction: bin capacity as a fraction of the gradient bytes, in ``(0, 1]``.
        Must be at least ``largest leaf bytes / B``, else the first update raises a
        ValueError naming the smallest fraction that works.
      collective: the workers to average over (`shoal.comms.Collective`).
      schedule: optional mapping from step (int >= 0) to fraction in ``(0, 1]``.

    Returns:
      an ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` returns
      a `PartialExchangeState` and whose ``update(updates, state, params=None)``
      returns ``(updates, new_state)``; the exchanged bin's leaves are the mean
      over workers, the others this worker's own.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from shoal.comms import AxisCollective
      >>> coll = AxisCollective("workers", 2)
      >>> from shoal.optim import partial_exchange
      >>> tx = partial_exchange(0.5, collective=coll)
      >>> def two_steps(g):
      ...     state = tx.init(g)
      ...     first, state = tx.update(g, state)
      ...     second, state = tx.update(g, state)
      ...     return first, second
      >>> a, b = jnp.array([[1.0, 1.0], [3.0, 3.0]]), jnp.array([[1.0, 1.0], [5.0, 5.0]])
      >>> grads = {"a": a, "b": b}
      >>> first, second = jax.vmap(two_steps, axis_name="workers")(grads)
      >>> print(first["a"][:, 0], first["b"][:, 0], second["a"][:, 0], second["b"][:, 0])
      [2. 2.] [1. 5.] [1. 3.] [3. 3.]

    References:
      Brabete, "Kungfu", MEng thesis, Imperial College London, 2019, section 3.4.2
      (partial gradient exchange).
    """
    check_collective(collective)
    f0 = _check_fraction("budget_fraction", budget_fraction)
    segments = _segments(f0, schedule)  # ((start, fraction, name), ...), ascending
    n_workers = collective.size

    def init_fn(params):
        check_same_structure(params, collective)
        del params
        return PartialExchangeState(
            step=jnp.zeros((), jnp.int32),
            bin=jnp.full((), -1, jnp.int32),
            fraction=jnp.asarray(segments[0][1], jnp.float32),
            wire=WireMeter.zero(),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(updates)
        leaves = [x for _, x in with_paths]
        nbytes = [tree_nbytes(x) for x in leaves]
        paths = [jax.tree_util.keystr(p) for p, _ in with_paths]

        def branch(bin_leaves):
            sent = all_reduce_bytes(sum(nbytes[i] for i in bin_leaves), n_workers)
            if len(bin_leaves) == len(leaves):

                def run(carry):
                    return collective.all_reduce(carry[0], op="mean"), WireCount.of(*sent)

                return run

            def run(carry):
                flat = jax.tree.leaves(carry[0])
                mean = collective.all_reduce([flat[i] for i in bin_leaves], op="mean")
                for i, m in zip(bin_leaves, mean):
                    flat[i] = m
                return jax.tree.unflatten(treedef, flat), WireCount.of(*sent)

            return run

        starts, fractions, n_bins, branches = [], [], [], []
        for start, fraction, name in segments:
            bins = _first_fit_decreasing(nbytes, paths, fraction, name)
            starts.append(start)
            fractions.append(fraction)
            n_bins.append(max(len(bins), 1))
            branches.extend(branch(b) for b in bins)

        # The step is the same on every worker: a real switch (an empty tree has no peers).
        t = collective.uniform(state.step) if leaves else state.step
        k = jnp.sum(t >= jnp.asarray(starts[1:], jnp.int32), dtype=jnp.int32)
        offsets = np.cumsum([0, *n_bins[:-1]])
        local = (t - jnp.asarray(starts, jnp.int32)[k]) % jnp.asarray(n_bins, jnp.int32)[k]
        flat_bin = (jnp.asarray(offsets, jnp.int32)[k] + local).astype(jnp.int32)
        fraction = jnp.asarray(fractions, jnp.float32)[k]

        if not leaves:
            out, wire, flat_bin = updates, WireCount.zero(), jnp.full((), -1, jnp.int32)
        elif len(branches) == 1:
            out, wire = branches[0]((updates, None))
        else:
            # In place: the bin's leaves are rewritten, the others are not copied.
            out, wire = switch_inplace(flat_bin, branches, (updates, WireCount.zero()))
        wire = state.wire.record(wire)
        return out, PartialExchangeState(t + 1, flat_bin, fraction, wire)

    return optax.GradientTransformationExtraArgs(
        init_fn, checked("partial_exchange", PartialExchangeState, update_fn)
    )


def partial_exchange_bins(tree: Any, budget_fraction: float) -> tuple[tuple[str, ...], ...]:
    """The bins `partial_exchange` packs ``tree``'s leaves into at ``budget_fraction``.

    Bin ``b`` is exchanged at steps ``t`` with ``t mod P == b`` (``P`` the number of bins);
    bins are in the order first-fit decreasing opens them (bin 0 holds the largest leaf),
    and each lists its leaves' ``jax.tree_util.keystr`` paths in ``jax.tree.leaves``
    order. ``tree`` may hold arrays or ``jax.ShapeDtypeStruct`` (only shapes and dtypes
    matter).

    Args:
      tree: the gradient (or params) pytree, arrays or ``jax.ShapeDtypeStruct``.
      budget_fraction: bin capacity as a fraction of the tree's bytes, in ``(0, 1]``.

    Returns:
      a tuple of bins, each a tuple of leaf paths (``jax.tree_util.keystr``).

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.optim.helpers import partial_exchange_bins
      >>> tree = {"w": jnp.zeros((6,)), "b": jnp.zeros((2,)), "c": jnp.zeros((4,))}
      >>> partial_exchange_bins(tree, 0.5)
      (("['w']",), ("['b']", "['c']"))

    References:
      Brabete, "Kungfu", MEng thesis, Imperial College London, 2019, section
      3.4.2.
    """
    fraction = _check_fraction("budget_fraction", budget_fraction)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    sizes = [tree_nbytes(x) for _, x in flat]
    bins = _first_fit_decreasing(sizes, paths, fraction, "budget_fraction")
    return tuple(tuple(paths[i] for i in b) for b in bins)


def _first_fit_decreasing(
    nbytes: list[int], paths: list[str], fraction: float, name: str
) -> list[list[int]]:
    """Leaf indices per bin, bins in opening order, indices ascending within a bin."""
    total = sum(nbytes)
    capacity = math.floor(fraction * total)
    # sorted() is stable: equal sizes keep their jax.tree.leaves order.
    order = sorted(range(len(nbytes)), key=lambda i: -nbytes[i])
    if order and nbytes[order[0]] > capacity:
        big = nbytes[order[0]]
        raise ValueError(
            f"{name}={fraction!r} gives bins of floor({fraction!r} * {total}) = {capacity} "
            f"bytes, but leaf {paths[order[0]]} has {big} bytes: the smallest fraction that "
            f"fits it is {_smallest_fraction(big, total)!r} ({big} / {total} bytes)"
        )
    bins: list[list[int]] = []
    used: list[int] = []
    for i in order:
        for b in range(len(bins)):
            if used[b] + nbytes[i] <= capacity:
                bins[b].append(i)
                used[b] += nbytes[i]
                break
        else:
            bins.append([i])
            used.append(nbytes[i])
    return [sorted(b) for b in bins]


def _smallest_fraction(leaf_bytes: int, total: int) -> float:
    """The smallest float ``f`` with ``floor(f * total) >= leaf_bytes``."""
    f = leaf_bytes / total
    while math.floor(f * total) < leaf_bytes:  # guard the rounding of the division
        f = math.nextafter(f, math.inf)
    while f > 0 and math.floor(math.nextafter(f, 0.0) * total) >= leaf_bytes:
        f = math.nextafter(f, 0.0)
    return f


def _check_fraction(name: str, value: Any) -> float:
    if isinstance(value, jax.core.Tracer):
        raise ValueError(
            f"{name} must be a concrete number, not a traced value: the packing is fixed at "
            f"trace time (with optax.inject_hyperparams pass static_args=('budget_fraction',))"
        )
    is_number = isinstance(value, (numbers.Real, np.ndarray, jax.Array))
    if not is_number or isinstance(value, (bool, np.bool_)) or np.ndim(value) != 0:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    v = float(value)
    if not 0.0 < v <= 1.0:
        raise ValueError(f"{name} must lie in (0, 1], got {value!r}")
    return v


def _segments(
    budget_fraction: float, schedule: Mapping[int, float] | None
) -> tuple[tuple[int, float, str], ...]:
    if schedule is None:
        return ((0, budget_fraction, "budget_fraction"),)
    if not isinstance(schedule, Mapping) or not schedule:
        raise ValueError(
            f"schedule must be a non-empty mapping from step (int >= 0) to fraction in "
            f"(0, 1], got {schedule!r}"
        )
    segments = {}
    for step, fraction in schedule.items():
        step = check_int("schedule key", step, 0, why=" (a step)")
        segments[step] = (step, _check_fraction(f"schedule[{step}]", fraction), f"schedule[{step}]")
    if 0 not in segments:
        segments[0] = (0, budget_fraction, "budget_fraction")
    return tuple(segments[s] for s in sorted(segments))
