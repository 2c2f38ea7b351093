"""DeMo: decoupled momentum, of which only the top-k DCT components of every chunk are shared.

Every worker ``i`` keeps its own momentum ``m_i``; each step it extracts the ``k``
largest DCT coefficients of every chunk of ``m_i`` (the "fast components"), removes them
from ``m_i``, and all-gathers them; the update is the sign of the workers' mean::

    m_i <- beta m_i + g_i
    q_i  = top_k(DCT(m_i))                   per chunk
    m_i <- m_i - IDCT(q_i)
    u    = sign((1/N) sum_j IDCT(q_j))

References:
  Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization", arXiv:2411.19870,
  2024; reference code https://github.com/bloc97/DeMo (``demo.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from shoal.checks import check_int
from shoal.comms.agreement import check_same_structure
from shoal.comms.collective import Collective
from shoal.comms.wire import WireCount, WireMeter, all_gather_bytes
from shoal.dtypes import promote_types
from shoal.kernels.dct_reference import chunk_dct, chunk_idct
from shoal.optim._validation import (
    check_collective,
    check_floating_leaves,
    check_hyper,
    checked,
)

# Wire format of one coefficient: its value as float32 and its index in the chunk as int32.
BYTES_PER_COEFFICIENT = 8


class DeMoState(NamedTuple):
    """State of `demo`.

    Attributes:
      momentum: param-shaped tree, this worker's decoupled momentum ``m_i`` after the most
        recent extraction: what it has not sent yet; float32 for float32 and narrower
        params, float64 for float64.
      step: int32 count of updates done.
      wire: bytes of this transformation's own collectives in the most recent update and
        since init.
    """

    momentum: Any
    step: jax.Array
    wire: WireMeter

    ERROR_FEEDBACK = ("momentum",)  # m - what was sent: the residual


class _Plan(NamedTuple):
    """How one leaf is chunked: viewed as a ``[rows, cols]`` matrix of ``[h, w]`` chunks,
    ``k`` coefficients sent per chunk."""

    rows: int
    cols: int
    h: int
    w: int
    k: int

    @property
    def chunks(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w)


def chunk_length(n: int, chunk_size: int) -> int:
    """The chunk length along a dimension of length ``n``: the largest divisor of ``n``
    that is ``<= chunk_size`` (the reference's ``_get_smaller_split``): ``n`` itself when
    ``n <= chunk_size``, 1 when ``n`` is a prime larger than ``chunk_size``."""
    for d in range(min(n, chunk_size), 0, -1):
        if n % d == 0:
            return d
    return 1


def _plan(shape: tuple[int, ...], chunk_size: int, topk: int) -> _Plan | None:
    size = int(np.prod(shape, dtype=np.int64))
    if size == 0:
        return None  # nothing to send
    if len(shape) <= 1:
        rows, cols = 1, size
    else:
        rows, cols = size // shape[-1], shape[-1]
    h, w = chunk_length(rows, chunk_size), chunk_length(cols, chunk_size)
    return _Plan(rows, cols, h, w, min(topk, h * w))


def _decode(vals: jax.Array, idx: jax.Array, plan: _Plan, dtype: Any, scale: float) -> jax.Array:
    """``IDCT(scale * sum_s S_s)`` where ``S_s`` holds ``vals[s]`` at ``idx[s]`` in each
    chunk and zeros elsewhere (``vals``, ``idx``: ``[S, chunks, k]``)."""
    rows = jnp.arange(plan.chunks)[None, :, None]
    dense = jnp.zeros((plan.chunks, plan.h * plan.w), dtype)
    dense = dense.at[rows, idx].add(vals.astype(dtype))
    if scale != 1:
        dense = dense * jnp.asarray(scale, dtype)
    return chunk_idct(dense, plan.rows, plan.cols, plan.h, plan.w)


def _memory_dtype(x: Any) -> Any:
    # At least float32: a bfloat16 momentum would round away part of what is not sent
    # at every step, and that gradient mass would be lost for good.
    return promote_types(jnp.result_type(x), jnp.float32)


# The largest topk: every element of a full 2-D chunk.
_TOPK_WHY = " (chunk_size ** 2, the elements of a full 2-D chunk)"


def demo(
    *,
    collective: Collective,
    momentum: float = 0.999,
    chunk_size: int = 64,
    topk: int = 32,
    sign: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """DeMo: per-worker momentum, of which only the top-k DCT components per chunk are shared.

    Every worker ``i`` of ``N`` keeps its own momentum ``m_i`` (zero at init) and, for
    every leaf, at every update::

        m_i <- beta m_i + g_i                               (beta = momentum)
        c_i  = DCT(m_i)                                     per chunk, orthonormal DCT-II
        q_i  = c_i on the topk largest |c_i| of each chunk, 0 elsewhere
        m_i <- m_i - IDCT(q_i)                              (what was sent leaves m_i)
        Q    = (1/N) sum_j IDCT(q_j)                        after an all-gather of all q_j
        u    = sign(Q)   (sign=True)     or     u = Q   (sign=False)

    ``u`` is returned as the update. It is gradient-like (it points uphill, as ``g``
    does), so chain an optimizer that descends: ``optax.chain(demo(...), optax.sgd(lr))``
    applies ``params <- params - lr u``, the paper's signum step. The reference's
    decoupled weight decay ``params <- (1 - lr wd) params`` is
    ``optax.chain(demo(...), optax.add_decayed_weights(wd), optax.sgd(lr))``.

    Chunking (as the reference's ``TransformDCT``): a leaf of shape ``(n,)`` is cut into
    chunks of ``w`` consecutive elements, a matrix ``[R, C]`` into ``[h, w]`` blocks
    transformed by a separable 2-D DCT, where ``h`` (``w``) is the largest divisor of
    ``R`` (``C``) that is ``<= chunk_size``: the dimension itself when it is shorter, 1 when
    it is a prime larger than ``chunk_size``. So any ``chunk_size`` tiles every leaf and none
    is refused. A scalar is ``(1,)``, and a leaf of more than two dimensions (which the
    reference does not handle) is the matrix ``[prod(shape[:-1]), shape[-1]]``. Each
    chunk sends ``k = min(topk, h w)`` coefficients (the reference clamps ``topk`` too),
    chosen by magnitude, ties to the lower index.

    Wire: one all-gather per update of a fixed-size buffer, per chunk ``k`` float32
    values and ``k`` int32 indices (position ``b w + d`` of frequency ``(b, d)`` in its
    chunk), so with ``n = 8 sum_leaves chunks k`` bytes, ``(N - 1) n`` bytes sent and
    received per worker in ``state.wire.step``. Decoding runs on every worker alike, so
    every worker gets the same ``u``. A NaN/Inf would stay in the momentum:
    `shoal.optim.skip_nonfinite` around the chain skips such a step.

    Differences from the reference, on purpose: the momentum accumulates ``g`` rather
    than ``lr g`` (as in the paper; with a constant ``lr`` and ``sign=True`` the updates
    are the same, since top-k and sign do not see a scale); the gathered components are
    averaged over all ``N`` workers, where the reference averages each coefficient over
    the workers that sent it (a ``scatter_reduce`` mean; the same when all workers send
    the same coefficients, e.g. ``topk >= h w``); indices are int32, not int64; the
    momentum of bfloat16 or float16 params is float32, not the params' dtype.

    Under ``optax.inject_hyperparams`` only ``momentum`` may be injected: pass
    ``static_args=("chunk_size", "topk", "sign")`` (they fix the shapes on the wire).

    Args:
      collective: the workers that share their components (`shoal.comms.Collective`).
      momentum: the decay ``beta`` of the decoupled momentum, in ``[0, 1)`` (the
        reference's ``compression_decay``).
      chunk_size: the target chunk length along each dimension, an int >= 1 (the
        reference's ``compression_chunk``).
      topk: coefficients sent per chunk, an int in ``[1, chunk_size ** 2]`` (the most a
        chunk can hold); clamped to a smaller chunk's ``h w`` (the reference's
        ``compression_topk``).
      sign: return ``sign(Q)`` (DeMo's signum update) or, if False, ``Q`` itself.

    Returns:
      an ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` returns a
      `DeMoState` and whose ``update(updates, state, params=None)`` returns ``(updates,
      new_state)``; the updates are ``u``, identical on every worker.

    Example:
      Worker 0's momentum ``[1, 2, 3, 4]`` sends its DC component (a constant 2.5) and
      keeps the rest; worker 1's ``[3, 3, 3, 3]`` is all DC, sent whole; both workers
      step ``-0.1 sign(2.75)``:

      >>> import jax, jax.numpy as jnp, optax
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import demo
      >>> coll = AxisCollective("workers", 2)
      >>> tx = optax.chain(demo(collective=coll, chunk_size=4, topk=1), optax.sgd(0.1))
      >>> def step(params, grads):
      ...     state = tx.init(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     return optax.apply_updates(params, updates), state[0].momentum
      >>> params = jnp.zeros((2, 4))  # one row per worker
      >>> grads = jnp.array([[1.0, 2.0, 3.0, 4.0], [3.0, 3.0, 3.0, 3.0]])
      >>> params, mom = jax.vmap(step, axis_name="workers")(params, grads)
      >>> print(params)
      [[-0.1 -0.1 -0.1 -0.1]
       [-0.1 -0.1 -0.1 -0.1]]
      >>> print(mom.round(4) + 0.0)
      [[-1.5 -0.5  0.5  1.5]
       [ 0.   0.   0.   0. ]]

    References:
      Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization", arXiv:2411.19870,
      2024; reference code https://github.com/bloc97/DeMo.
    """
    check_collective(collective)
    check_int("chunk_size", chunk_size, 1)
    chunk_size = int(chunk_size)
    check_int("topk", topk, 1, chunk_size * chunk_size, why=_TOPK_WHY)
    topk = int(topk)
    check_hyper("momentum", momentum, 0, 1, open_high=True)
    if not isinstance(sign, (bool, np.bool_)):
        raise ValueError(f"sign must be True or False, got {sign!r}")
    n_workers = collective.size

    def init_fn(params):
        check_same_structure(params, collective)
        check_floating_leaves("params", params)
        return DeMoState(
            momentum=jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), _memory_dtype(x)), params),
            step=jnp.zeros((), jnp.int32),
            wire=WireMeter.zero(),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        grads, treedef = jax.tree.flatten(updates)
        moms = treedef.flatten_up_to(state.momentum)
        plans = [_plan(jnp.shape(g), chunk_size, topk) for g in grads]

        new_moms, sent_vals, sent_idx, accs = list(moms), [], [], []
        for i, (g, m, plan) in enumerate(zip(grads, moms, plans)):
            if plan is None:
                continue
            acc = promote_types(m.dtype, jnp.float32)
            m_acc = momentum * m.astype(acc) + g.astype(acc)
            coeffs = chunk_dct(m_acc.reshape(plan.rows, plan.cols), plan.h, plan.w)
            _, idx = lax.top_k(jnp.abs(coeffs), plan.k)
            vals = jnp.take_along_axis(coeffs, idx, axis=1).astype(jnp.float32)
            # Remove exactly what goes on the wire (the float32 values).
            sent = _decode(vals[None], idx[None], plan, acc, 1)
            new_moms[i] = (m_acc - sent.reshape(m_acc.shape)).astype(m.dtype)
            sent_vals.append(vals.ravel())
            sent_idx.append(idx.astype(jnp.int32).ravel())
            accs.append(acc)

        out = [jnp.zeros_like(g) for g in grads]
        wire = WireCount.zero()
        if sent_vals:
            # One all-gather for the whole tree: values (bitcast) then indices, one row
            # per worker.
            vals = jnp.concatenate(sent_vals)
            buf = jnp.concatenate([lax.bitcast_convert_type(vals, jnp.int32), *sent_idx])
            everyone = collective.all_gather(buf)
            n_sent = vals.shape[0]
            all_vals = lax.bitcast_convert_type(everyone[:, :n_sent], jnp.float32)
            all_idx = everyone[:, n_sent:]
            start, j = 0, 0
            for i, (g, plan) in enumerate(zip(grads, plans)):
                if plan is None:
                    continue
                n = plan.chunks * plan.k
                shape = (n_workers, plan.chunks, plan.k)
                v = all_vals[:, start : start + n].reshape(shape)
                ix = all_idx[:, start : start + n].reshape(shape)
                mean = _decode(v, ix, plan, accs[j], 1 / n_workers).reshape(jnp.shape(g))
                out[i] = (jnp.sign(mean) if sign else mean).astype(g.dtype)
                start, j = start + n, j + 1
            wire = WireCount.of(*all_gather_bytes(BYTES_PER_COEFFICIENT * n_sent, n_workers))

        new_state = DeMoState(
            momentum=treedef.unflatten(new_moms),
            step=state.step + 1,
            wire=state.wire.record(wire),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(
        init_fn, checked("demo", DeMoState, update_fn, lambda s: s.momentum)
    )
