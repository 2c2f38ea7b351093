"""PowerSGD: rank-r compression of each gradient matrix by one step of subspace iteration.

Each worker views every gradient leaf of two or more dimensions as a matrix, adds its
error feedback, and the workers agree on a rank-r approximation of the mean of those
matrices with two small all-reduces (of ``P``, ``n x r``, and ``Q``, ``m x r``)::

    M_i = G_i + E_i
    P   = orth( sum_i M_i Q_0 )            (all-reduce, sum)
    Q   = (1/N) sum_i M_i^T P              (all-reduce, mean)
    U   = P Q^T                            (the update, the same on every worker)
    E_i = M_i - P Q^T

``Q_0`` is the previous step's ``Q`` (warm start). The semantics are those of PyTorch's
``powerSGD_hook``.

References:
  Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
  Distributed Optimization", NeurIPS 2019.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from shoal.checks import check_int, check_real
from shoal.comms.agreement import check_same_structure
from shoal.comms.collective import Collective, uniform_over
from shoal.comms.wire import WireCount, WireMeter, all_reduce_bytes, tree_nbytes
from shoal.dtypes import promote_types
from shoal.optim._inplace import run_if
from shoal.optim._validation import check_collective, check_floating_leaves, checked


class PowerSGDState(NamedTuple):
    """State of `powersgd`.

    Attributes:
      error: the error feedback ``E`` of this worker, a tree like the gradient: for a
        compressed leaf an array of the leaf's shape in its compute dtype (float32 for
        float32 and narrower params; zero at init), for a leaf sent uncompressed an empty
        array of shape ``(0,)`` (it has no error).
      q: the warm-start factor ``Q`` of each compressed leaf, ``(m, r)`` in the leaf's
        compute dtype (float32 for float32 and narrower gradients): the all-reduced mean
        ``Q`` of the most recent compressed update, or the seeded normal draw at init;
        the same on every worker. ``(0,)`` for a leaf sent uncompressed.
      step: int32 count of updates done; the first ``start_step`` are plain all-reduces.
      wire: bytes of this transformation's own collectives in the most recent update and
        since init.
    """

    error: Any
    q: Any
    step: jax.Array
    wire: WireMeter

    ERROR_FEEDBACK = ("error",)  # `shoal.optim.helpers.error_feedback_mask`


class _Leaf(NamedTuple):
    """How one leaf travels: ``rank`` 0 means uncompressed."""

    n: int
    m: int
    rank: int
    compute: np.dtype


def _plan(shape: tuple[int, ...], dtype: Any, rank: int, min_compression: float) -> _Leaf:
    compute = promote_types(dtype, jnp.float32)
    if len(shape) < 2:
        return _Leaf(0, 0, 0, compute)
    n, m = int(shape[0]), int(math.prod(shape[1:]))
    r = min(rank, n, m)
    # Strict, as PyTorch's _should_compress: a leaf that saves exactly min_compression
    # travels uncompressed.
    if r < 1 or not n * m > min_compression * (n + m) * r:
        return _Leaf(n, m, 0, compute)
    return _Leaf(n, m, r, compute)


def powersgd(
    rank: int,
    *,
    collective: Collective,
    start_step: int = 0,
    warm_start: bool = True,
    min_compression: float = 2.0,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """PowerSGD: all-reduce a rank-r approximation of each gradient matrix, with error feedback.

    Every gradient leaf ``G_i`` of ``ndim >= 2`` on worker ``i`` of ``N`` is viewed as an
    ``n x m`` matrix (its first dimension by the product of the others) and compressed
    with rank ``r = min(rank, n, m)`` (clamped per leaf) when it saves enough::

        M_i  = G_i + E_i                       (error feedback; E_i = 0 at init)
        Q_0  = orth(Q_prev)  (warm_start)  or  orth(normal(seed, step))
        P    = orth( sum_i M_i Q_0 )           (all-reduce of P, sum)
        Q    = (1/N) sum_i M_i^T P             (all-reduce of Q, mean)
        U    = P Q^T  =  (1/N) sum_i P P^T M_i (the update, on every worker)
        E_i <- M_i - P Q^T                     (new error, this worker's)
        Q_prev <- Q

    ``orth`` makes the columns orthonormal by classical Gram-Schmidt applied twice per
    column ("twice is enough"), left to right, in plain array operations: deterministic,
    and the same on every worker, whose inputs (the all-reduced ``P``, the state's ``Q``)
    are the same; it equals the ``Q`` of a QR factorisation whose ``R`` has a positive
    diagonal. A column that is exactly zero after the projections (e.g. a zero gradient)
    stays zero: it adds nothing to ``U``. ``P`` is summed,
    not averaged, as ``orth`` removes its scale; ``Q`` is averaged, so ``U`` estimates the
    mean gradient ``(1/N) sum_i G_i``: at full rank, ``r = min(n, m)``, it is the mean
    of the ``M_i`` (S-SGD).

    The error is PyTorch's (``powerSGD_hook``): this worker's ``M_i`` minus the
    decompressed all-reduced approximation ``P Q^T`` (the update itself), so ``U + E_i ==
    M_i`` on every worker. (The paper's Algorithm 2 subtracts the local approximation
    ``P P^T M_i`` instead; both leave the same sum of errors over the workers.)

    A leaf is compressed when ``n m / ((n + m) r) > min_compression`` (strictly, as
    PyTorch's ``_should_compress``: a 4x4 leaf at rank 1 saves exactly 2x and is sent
    uncompressed at the default). The others, and
    every leaf of ``ndim < 2``, are all-reduced exactly (mean), concatenated into one
    all-reduce per dtype; they keep no error. (PyTorch keeps ``G_i - mean`` as their error,
    which cancels in every later mean; shoal keeps none.)

    Before ``start_step`` updates (counted by ``state.step``, the same on every worker)
    each update is the plain all-reduced mean of the whole gradient, and the error and
    ``Q`` stay as they were (zero and the initial draw): a real branch, only its own
    collectives run.

    Wire bytes per update (``state.wire.step``), float32 compute: one ring all-reduce
    each of all leaves' ``P`` (``4 sum n r`` bytes), of all ``Q`` (``4 sum m r``) and of
    the uncompressed leaves (their bytes); ``2 (N - 1) / N`` times each payload, rounded
    down, sent and received. Before ``start_step``: one all-reduce of the whole gradient.
    A NaN/Inf would stay in the error feedback: `shoal.optim.skip_nonfinite` around the
    chain skips such a step (its 4-byte flag is counted in the wrapper's state).

    ``Q`` starts, on every worker alike, from ``jax.random.normal(fold_in(fold_in(
    PRNGKey(seed), j), 0), (m, r))`` for the ``j``-th leaf (``jax.tree.leaves`` order);
    with ``warm_start=False`` update ``t`` (``state.step``) draws ``fold_in(..., t)``
    afresh. The error and the warm-start ``Q`` live in the state, so a checkpoint of it
    resumes exactly.

    Args:
      rank: the approximation rank ``r``, an int >= 1 (clamped to ``min(n, m)`` per leaf).
      collective: the workers to average over (`shoal.comms.Collective`).
      start_step: updates done by plain all-reduce before compression starts, an int >= 0.
      warm_start: reuse the previous update's ``Q`` (True, as the paper and PyTorch do),
        or draw a fresh seeded normal ``Q`` each update (False).
      min_compression: compress a leaf only when ``n m / ((n + m) r)`` exceeds this, a
        number > 0 (PyTorch's ``min_compression_rate``).
      seed: the seed of the initial (and, with ``warm_start=False``, every) ``Q``; the
        same on every worker.

    Returns:
      an ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` returns a
      `PowerSGDState` and whose ``update(updates, state, params=None)`` returns
      ``(updates, new_state)``; the updates are the low-rank estimate of the mean
      gradient, identical on every worker.

    Example:
      Two workers' rank-1 gradients share their column space, so rank 1 recovers their
      mean exactly, and each worker keeps its own gradient minus the mean as its error:

      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import powersgd
      >>> coll = AxisCollective("workers", 2)
      >>> tx = powersgd(1, collective=coll, min_compression=1.0)  # 2x3 saves 6/5 only
      >>> def step(g):
      ...     updates, state = tx.update(g, tx.init(g))
      ...     return updates, state.error
      >>> grads = jnp.array([[[1.0, 2.0, 0.0], [2.0, 4.0, 0.0]],   # worker 0
      ...                    [[0.0, 0.0, 2.0], [0.0, 0.0, 4.0]]])  # worker 1
      >>> updates, error = jax.vmap(step, axis_name="workers")(grads)
      >>> print(updates[0].round(4))
      [[0.5 1.  1. ]
       [1.  2.  2. ]]
      >>> print(error[0].round(4))
      [[ 0.5  1.  -1. ]
       [ 1.   2.  -2. ]]

    References:
      Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression
      for Distributed Optimization", NeurIPS 2019.
    """
    check_collective(collective)
    check_int("rank", rank, 1)
    check_int("start_step", start_step, 0)
    check_int("seed", seed, None)
    if not isinstance(warm_start, (bool, np.bool_)):
        raise ValueError(f"warm_start must be True or False, got {warm_start!r}")
    min_compression = _check_min_compression(min_compression)
    rank, start_step, seed, warm_start = int(rank), int(start_step), int(seed), bool(warm_start)
    size = collective.size

    def plan_of(leaves):
        return [_plan(np.shape(x), jnp.result_type(x), rank, min_compression) for x in leaves]

    def draw(j: int, leaf: _Leaf, step: Any) -> jax.Array:
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), j), step)
        return jax.random.normal(key, (leaf.m, leaf.rank), leaf.compute)

    def init_fn(params):
        check_same_structure(params, collective)
        check_floating_leaves("params", params)
        leaves, treedef = jax.tree.flatten(params)
        plan = plan_of(leaves)
        error, q = [], []
        for j, (x, leaf) in enumerate(zip(leaves, plan)):
            # The error in the compute dtype, not the leaf's: a bfloat16 error would round
            # away a share of what is not sent at every step (mass lost for good).
            if leaf.rank:
                error.append(jnp.zeros(np.shape(x), leaf.compute))
                q.append(draw(j, leaf, 0))
            else:
                error.append(jnp.zeros((0,), leaf.compute))
                q.append(jnp.zeros((0,), leaf.compute))
        return PowerSGDState(
            error=treedef.unflatten(error),
            q=treedef.unflatten(q),
            step=jnp.zeros((), jnp.int32),
            wire=WireMeter.zero(),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, treedef = jax.tree.flatten(updates)
        plan = plan_of(leaves)
        errors, qs = _state_leaves(treedef, leaves, plan, state)
        squeezed = [i for i, leaf in enumerate(plan) if leaf.rank]
        plain = [i for i, leaf in enumerate(plan) if not leaf.rank]
        # Rank-uniform: a real branch under vmap, and the same Q draw on every worker.
        step = uniform_over(collective, state.step)

        def all_reduce(carry):
            _, errors, qs, _ = carry
            mean = collective.all_reduce(leaves, "mean")
            return mean, errors, qs, WireCount.of(*all_reduce_bytes(tree_nbytes(leaves), size))

        def compress(carry):
            _, errors, qs, _ = carry
            out, new_errors, new_qs = list(leaves), list(errors), list(qs)
            mean, wire = _all_reduce_flat(collective, [leaves[i] for i in plain], "mean")
            for i, x in zip(plain, mean):
                out[i] = x
            ms, q0 = [], []
            for i in squeezed:
                leaf = plan[i]
                g = leaves[i].astype(leaf.compute).reshape(leaf.n, leaf.m)
                ms.append(g + errors[i].astype(leaf.compute).reshape(leaf.n, leaf.m))
                q0.append(_orthonormal(qs[i] if warm_start else draw(i, leaf, step)))
            ps, p_wire = _all_reduce_flat(collective, [_dot(m, q) for m, q in zip(ms, q0)], "sum")
            ps = [_orthonormal(p) for p in ps]
            local_q = [_dot(m.T, p) for m, p in zip(ms, ps)]
            new_q, q_wire = _all_reduce_flat(collective, local_q, "mean")
            for i, m, p, q in zip(squeezed, ms, ps, new_q):
                approx = _dot(p, q.T)
                out[i] = approx.reshape(leaves[i].shape).astype(leaves[i].dtype)
                new_errors[i] = (m - approx).reshape(leaves[i].shape).astype(errors[i].dtype)
                new_qs[i] = q.astype(qs[i].dtype)
            return out, new_errors, new_qs, wire + p_wire + q_wire

        carry = (leaves, errors, qs, WireCount.zero())
        if start_step == 0:
            out, errors, qs, wire = compress(carry)
        else:
            warm_up = step < start_step
            out, errors, qs, wire = run_if(~warm_up, compress, run_if(warm_up, all_reduce, carry))
        new_state = PowerSGDState(
            error=treedef.unflatten(errors),
            q=treedef.unflatten(qs),
            step=state.step + 1,
            wire=state.wire.record(wire),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(
        init_fn, checked("powersgd", PowerSGDState, update_fn)
    )


def _check_min_compression(value: Any) -> float:
    return check_real("min_compression", value, 0, open_low=True)


def _state_leaves(treedef, leaves, plan, state):
    """The state's error and Q leaves, checked against what this gradient needs."""
    if jax.tree.structure(state.error) != treedef or jax.tree.structure(state.q) != treedef:
        raise ValueError(
            "powersgd: the gradient (updates) does not have the tree structure of the "
            f"params given to init. Expected {jax.tree.structure(state.error)}, got {treedef}"
        )
    errors, qs = treedef.flatten_up_to(state.error), treedef.flatten_up_to(state.q)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.q)[0]]
    for x, leaf, e, q, path in zip(leaves, plan, errors, qs, paths):
        want_e = np.shape(x) if leaf.rank else (0,)
        want_q = (leaf.m, leaf.rank) if leaf.rank else (0,)
        if np.shape(e) != want_e or np.shape(q) != want_q:
            raise ValueError(
                f"powersgd: the gradient (updates) leaf {path or '(root)'} has shape "
                f"{tuple(np.shape(x))}, which does not match the state built by init "
                f"(error {tuple(np.shape(e))}, Q {tuple(np.shape(q))})"
            )
    return errors, qs


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    # Full precision also on GPUs that would multiply float32 in TF32.
    return jnp.dot(a, b, precision=lax.Precision.HIGHEST)


def _orthonormal(a: jax.Array) -> jax.Array:
    """Columns of ``a`` made orthonormal, left to right: classical Gram-Schmidt applied
    twice per column (one pass leaves errors of the order of the condition number times
    the rounding; two leave the rounding). A column that vanishes stays zero."""
    n, r = a.shape

    def column(i, basis):  # the columns of ``basis`` from i on are still zero
        v = lax.dynamic_index_in_dim(a, i, axis=1, keepdims=False)
        for _ in range(2):
            v = v - _dot(basis, _dot(basis.T, v))
        norm = jnp.sqrt(jnp.sum(v * v))
        v = v / jnp.where(norm > 0, norm, jnp.ones_like(norm))
        return lax.dynamic_update_index_in_dim(basis, v, i, axis=1)

    return lax.fori_loop(0, r, column, jnp.zeros_like(a))


def _all_reduce_flat(
    collective: Collective, arrays: list[jax.Array], op: str
) -> tuple[list[jax.Array], WireCount]:
    """``arrays`` all-reduced as one flat buffer per dtype (one message each, not one per
    array), and the bytes of those all-reduces."""
    out: list[Any] = [None] * len(arrays)
    wire = WireCount.zero()
    by_dtype: dict[np.dtype, list[int]] = {}
    for i, x in enumerate(arrays):
        by_dtype.setdefault(np.dtype(x.dtype), []).append(i)
    for dtype, idx in by_dtype.items():
        flat = jnp.concatenate([arrays[i].reshape(-1) for i in idx])
        if flat.size == 0:
            reduced = flat
        else:
            reduced = collective.all_reduce(flat, op)
            nbytes = flat.size * dtype.itemsize
            wire = wire + WireCount.of(*all_reduce_bytes(nbytes, collective.size))
        start = 0
        for i in idx:
            out[i] = reduced[start : start + arrays[i].size].reshape(arrays[i].shape)
            start += arrays[i].size
    return out, wire
