"""Exchanges that read no gradient, made before a step's in-place branch: `prefetching`.

Peer model averaging exchanges models, not gradients: what a worker receives at step
``t`` is its peer's parameters (or, stale, a model its peer kept), never anything of the
gradient of step ``t``. Inside `shoal.optim.skip_nonfinite`'s in-place branch
(``in_place="apply"``) the exchange waits until every worker's gradient has been
checked, and its result is read in the pass that overwrites the parameters: XLA must copy
them first, and on XLA:CPU reads the peer's rows through a gather in that pass. Made
before the branch, the exchange writes a buffer of its own while the backward pass still
runs, and the branch is one element-wise pass over the parameters.

A `PrefetchingTransformation` has a ``prefetch(state, params)`` that returns what its
``update`` would receive, and its ``update`` takes that as the extra argument
``prefetched`` (`PREFETCHED`) instead of exchanging. `skip_nonfinite` calls it before
its branch; both ways take the same step. On a step the branch skips, the exchange has
run and its result is dropped, and the wire meters report an idle step, as they do for
the collectives of ``in_place=False``.
"""

from __future__ import annotations

from collections.abc import Callable

import optax

__all__ = ["PREFETCHED", "PrefetchingTransformation", "prefetching"]

PREFETCHED = "prefetched"  # the extra argument of ``update`` that carries it


class PrefetchingTransformation(optax.GradientTransformationExtraArgs):
    """An optax transformation with a ``prefetch(state, params)`` (module docstring)."""

    prefetch: Callable | None = None  # set on the instance (`prefetching`)


def prefetching(
    tx: optax.GradientTransformationExtraArgs, prefetch: Callable
) -> PrefetchingTransformation:
    """``tx`` with ``prefetch``: ``prefetch(state, params)`` returns what
    ``tx.update(..., prefetched=...)`` takes in place of its own exchange.

    Args:
      tx: the transformation; its ``update`` must accept ``prefetched``.
      prefetch: ``prefetch(state, params) -> received``, reading no gradient.

    Returns:
      a `PrefetchingTransformation` with ``tx``'s ``init`` and ``update``.

    Example:
      >>> import optax
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import peer_averaging
      >>> tx = peer_averaging(optax.sgd(0.1), collective=AxisCollective("workers", 2))
      >>> callable(tx.prefetch)  # skip_nonfinite(tx, ..., in_place="apply") calls it
      True
    """
    out = PrefetchingTransformation(tx.init, tx.update)
    out.prefetch = prefetch
    return out
