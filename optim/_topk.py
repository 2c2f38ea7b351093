"""Top-k gradient sparsification with error feedback (Stich et al.; SparseLoCo's sparsifier)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from shoal.comms.agreement import check_same_structure
from shoal.comms.codecs import TopK
from shoal.comms.collective import Collective
from shoal.comms.wire import WireCount, WireMeter
from shoal.optim._validation import check_collective, checked


class TopKState(NamedTuple):
    """State of `topk`.

    Attributes:
      error: the error feedback: one float32 vector of every leaf padded to whole chunks
        (with ``chunk_size``), or a tree like the params of one flat float32 vector per
        leaf (without). A zero-size leaf has none (nothing of it is ever sent).
      wire: bytes of the most recent update and since init.
    """

    error: Any
    wire: WireMeter

    ERROR_FEEDBACK = ("error",)  # `shoal.optim.helpers.error_feedback_mask`


def topk(
    fraction: float,
    *,
    collective: Collective,
    chunk_size: int | None = None,
    value_bits: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Top-k sparsification with error feedback: each worker sends its largest entries.

    Per worker, with ``e`` the error feedback (zero at init) and ``S`` the indices of the
    ``k = ceil(fraction L)`` largest ``|v|`` of each chunk of ``L`` values::

        v = g + e          sent = v on S (0 elsewhere)          e <- v - sent
        g <- (1/N) sum_i sent_i                                  (one all-gather)

    With ``chunk_size = L`` every leaf is cut into chunks of ``L`` (its last chunk
    zero-padded; chunks never span two leaves) and all leaves travel in one all-gather;
    with None each leaf is one chunk and travels in its own all-gather. A zero-size leaf
    sends nothing, and a tree without values no message at all. ``value_bits``
    quantizes the sent values to a sign and ``2^(b-1)`` magnitudes per chunk
    (`shoal.comms.TopK`), the quantization error joining ``e``. Nothing is dropped:
    what was sent plus ``e`` is what came in. ``topk(1.0)`` is S-SGD.

    Wire: per chunk ``k`` values (float32, or ``b``-bit codes and one float32 scale) and
    ``k`` indices (uint16 for chunks up to 65536), all-gathered from the ``N - 1`` others:
    ``(N - 1)`` times the payload each way (`shoal.comms.TopK.wire_bytes`).

    Args:
      fraction: the share of each chunk sent, in (0, 1].
      collective: the workers (`shoal.comms.Collective`).
      chunk_size: ``L``, a positive int, or None (one chunk per leaf).
      value_bits: None (float32 values) or 2, 4 or 8.

    Returns:
      an ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` returns a
      `TopKState` and whose ``update(updates, state, params=None)`` returns the mean of
      the workers' sparse gradients, the same on every worker. Chain an optimizer after
      it: ``optax.chain(topk(0.01, collective=c), optax.sgd(0.1))``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import topk
      >>> coll = AxisCollective("workers", 2)
      >>> tx = topk(0.5, collective=coll)  # the larger half of each leaf
      >>> def step(g):
      ...     updates, state = tx.update(g, tx.init(g))
      ...     return updates, state.error
      >>> updates, error = jax.vmap(step, axis_name="workers")(
      ...     jnp.array([[1.0, -3.0, 2.0, 0.5], [1.0, 1.0, 4.0, 0.0]]))
      >>> print(updates[0])
      [ 0.5 -1.5  3.   0. ]
      >>> print(error)
      [[1.  0.  0.  0.5]
       [0.  1.  0.  0. ]]

    References:
      S. Stich, J.-B. Cordonnier, M. Jaggi, "Sparsified SGD with Memory", NeurIPS 2018.
      A. Sarfi, B. Therien, J. Lidin, E. Belilovsky, "Communication Efficient LLM
      Pre-training with SparseLoCo", arXiv:2508.15706 (2025).
    """
    check_collective(collective)
    codec = TopK(fraction=fraction, chunk_size=chunk_size, value_bits=value_bits)
    size = collective.size

    def padded(leaf) -> int:
        # A zero-size leaf has nothing to send: no chunk, no error, no bytes.
        return codec.padded_size(leaf.size, size) if leaf.size else 0

    def init_fn(params: Any) -> TopKState:
        check_same_structure(params, collective)
        leaves = jax.tree.leaves(params)
        if chunk_size is None:
            error = jax.tree.map(lambda x: jnp.zeros(padded(x), jnp.float32), params)
        else:
            error = jnp.zeros(sum(padded(x) for x in leaves), jnp.float32)
        return TopKState(error=error, wire=WireMeter.zero())

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, treedef = jax.tree.flatten(updates)
        flat = [jnp.ravel(x).astype(jnp.float32) for x in leaves]
        if chunk_size is None:
            means, error, sent, received = [], [], 0, 0
            for v, e in zip(flat, treedef.flatten_up_to(state.error)):
                if not v.size:  # the same on every worker (one tree structure)
                    means.append(v)
                    error.append(e)
                    continue
                y, (e,) = codec.mean(v, (e,), collective=collective)
                means.append(y)
                error.append(e)
                s, r = codec.wire_bytes(v.size, size)
                sent, received = sent + s, received + r
            error = jax.tree.unflatten(treedef, error)
        elif not state.error.size:  # no leaf holds a value: nothing to exchange
            means, error, sent, received = flat, state.error, 0, 0
        else:
            # Each leaf padded to whole chunks, so no chunk spans two leaves.
            buffer = jnp.concatenate([jnp.pad(v, (0, padded(v) - v.size)) for v in flat])
            y, (error,) = codec.mean(buffer, (state.error,), collective=collective)
            sent, received = codec.wire_bytes(buffer.size, size)
            offsets = [0]
            for v in flat:
                offsets.append(offsets[-1] + padded(v))
            means = [y[o : o + v.size] for o, v in zip(offsets, flat)]
        out = [m.reshape(x.shape).astype(x.dtype) for m, x in zip(means, leaves)]
        wire = WireCount.of(sent, received)
        new_state = state._replace(error=error, wire=state.wire.record(wire))
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, checked("topk", TopKState, update_fn))
