"""SparseLoCo: DiLoCo whose outer gradient travels as a 2-bit chunked top-k, with decayed
error feedback in place of outer momentum.

After ``H`` inner steps each worker ``r`` of ``R`` adds its pseudo-gradient to an
error-feedback accumulator that decays, sends a quantized top-k of it and keeps the rest;
the global model steps by the mean of what was sent (Sarfi et al. 2025, Algorithm 1)::

    Delta_r  = theta - theta_r                      (after H inner steps)
    A_r     <- beta A_r + Delta_r
    D_r      = Q(TopK(A_r))                         (per chunk; 2-bit values)
    A_r     <- A_r - D_r
    theta   <- theta - alpha (1/R) sum_r D_r

References:
  Sarfi, Therien, Lidin & Belilovsky, "Communication Efficient LLM Pre-training with
  SparseLoCo", arXiv:2508.15706, 2025.
"""

from __future__ import annotations

from collections.abc import Callable

import optax

from shoal.comms.codecs import TopK
from shoal.comms.collective import Collective
from shoal.optim._diloco import diloco_named
from shoal.optim._validation import check_hyper

__all__ = ["sparseloco"]


def sparseloco(
    inner: optax.GradientTransformation,
    *,
    collective: Collective,
    sync_every: int,
    outer_learning_rate: float | Callable = 1.0,
    beta: float = 0.95,
    density: float = 64 / 4096,
    chunk_size: int = 4096,
    value_bits: int | None = 2,
) -> optax.GradientTransformationExtraArgs:
    """SparseLoCo: local inner steps, then a sparse, 2-bit, error-fed outer step.

    Every worker applies ``inner`` to its own gradient at every update. On every
    ``sync_every``-th update (``H``), after that inner step, each worker ``r`` of ``R``
    forms its pseudo-gradient and exchanges a compressed part of its accumulator ``A_r``
    (Algorithm 1 of the paper)::

        Delta_r  = theta_g - theta_r
        A_r     <- beta A_r + Delta_r
        D_r      = Q(TopK_k(A_r))       top ``k = ceil(density L)`` of each chunk of ``L``
        A_r     <- A_r - D_r            (what was not sent, and the rounding of what was)
        theta_g <- theta_g - alpha (1/R) sum_r D_r

    and every worker restarts from ``theta_g``. There is no outer momentum: the decaying
    accumulator stands in for it (the paper's section 3). ``beta = 1`` keeps every unsent
    value; ``beta < 1`` forgets ``(1 - beta)`` of the residual per round, as the paper
    does on purpose.

    This is exactly ``diloco(inner, collective=..., sync_every=H,
    outer=optax.sgd(alpha), exchange=TopK(density, chunk_size=L, value_bits=2,
    error_decay=beta))``, and the state is a `shoal.optim.DiLoCoState` whose
    ``exchange_memory`` holds ``A_r - D_r``. (``diloco(exchange=TopK(...))`` alone, with
    ``error_decay=1`` and DiLoCo's Nesterov outer step, is not SparseLoCo: it keeps an
    undecayed residual and adds outer momentum on top of it.)

    Deliberate differences from the paper: the chunks are contiguous runs of ``L`` values
    of all leaves flattened into one vector (`shoal.comms.TopK`), not 2-D tiles of each
    tensor, and the 2-bit quantizer sends a sign and one of two magnitudes, ``s/2`` or
    ``s``, ``s`` the chunk's largest sent magnitude (exact at the largest value), where the
    paper's sets its range from the values' statistics. Either way the rounding stays in
    ``A_r``.

    Wire bytes: one fixed-size all-gather per outer step (`shoal.comms.TopK.wire_bytes`):
    the 2-bit codes packed four to a byte, then per chunk a float32 scale and ``k`` uint16
    indices, times ``R - 1``, in ``state.wire.step``; inner steps send nothing.
    `shoal.optim.skip_nonfinite` around it skips steps with a NaN/Inf gradient.

    Args:
      inner: the per-worker optimizer (the paper's: AdamW), applied every update.
      collective: the workers (`shoal.comms.Collective`).
      sync_every: ``H``, updates per round, an int >= 1.
      outer_learning_rate: ``alpha``, a number > 0 or an optax schedule over outer steps.
      beta: the accumulator's decay, in (0, 1].
      density: the share of each chunk sent, in (0, 1] (1-3% in the paper).
      chunk_size: ``L``, values per chunk, an int >= 1.
      value_bits: 2 (the paper's), 4, 8, or None for float32 values.

    Returns:
      `shoal.optim.diloco`'s transformation with this outer step and exchange: ``init``
      returns a `shoal.optim.DiLoCoState`, ``update(updates, state, params)`` the updates
      and the new state; ``optax.apply_updates(params, updates)`` is the next model.

    Example:
      Two workers, one round of one inner step (SGD, lr 1) from 0 to their targets, so
      ``Delta_r = -target_r``; one value of the chunk of 4 is sent each. Worker 0 sends
      -4, worker 1 sends -2; the mean ``[-2, 0, -1, 0]`` steps ``theta_g`` to ``[2, 0, 1,
      0]`` and each keeps its unsent -1:

      >>> import jax, jax.numpy as jnp, optax
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim import sparseloco
      >>> coll = AxisCollective("workers", 2)
      >>> tx = sparseloco(optax.sgd(1.0), collective=coll, sync_every=1,
      ...                 density=0.25, chunk_size=4)
      >>> def round_(params, target):
      ...     state = tx.init(params)
      ...     updates, state = tx.update(params - target, state, params)
      ...     return state.global_params, state.exchange_memory[0], state.wire.step.sent
      >>> targets = jnp.array([[4.0, 1.0, 0.0, 0.0], [0.0, 1.0, 2.0, 0.0]])
      >>> theta, residual, sent = jax.vmap(round_, axis_name="workers")(
      ...     jnp.zeros((2, 4)), targets)
      >>> print(theta[0], residual[0])
      [2. 0. 1. 0.] [ 0. -1.  0.  0.]
      >>> int(sent[0])  # a 2-bit code (1 byte), a float32 scale and a uint16 index
      7

    References:
      Sarfi, Therien, Lidin & Belilovsky, "Communication Efficient LLM Pre-training with
      SparseLoCo", arXiv:2508.15706, 2025, Algorithm 1 and section 3.
    """
    if not callable(outer_learning_rate):  # (an injected, traced rate passes: optax takes it)
        check_hyper("outer_learning_rate", outer_learning_rate, 0, open_low=True,
                    why=" or a schedule")  # fmt: skip
    try:  # the codec checks beta and density (its error_decay and fraction)
        exchange = TopK(density, chunk_size=chunk_size, value_bits=value_bits, error_decay=beta)
    except ValueError as e:  # name this factory's parameters, not the codec's
        msg = str(e).replace("error_decay", "beta").replace("fraction", "density")
        raise ValueError(msg) from None
    return diloco_named(
        "sparseloco", inner, collective, sync_every, optax.sgd(outer_learning_rate), exchange
    )
