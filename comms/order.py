"""The order in which the backward pass produces the gradients, and its agreement.

`gradient_order` reads, from the jaxpr of ``jax.grad``, which gradient leaf each step of
the backward pass produces first; `broadcast_order` gives every worker worker 0's order.
Herring lays its balanced fusion buffers (`shoal.comms.fusion`) out in this order, so a
buffer can be reduced as soon as its gradients exist.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend


def gradient_order(fun, *args, argnums: int = 0) -> tuple[int, ...]:
    """The order in which ``jax.grad(fun, argnums)(*args)`` produces the gradient leaves.

    The position of a gradient is that of the equation of the gradient's jaxpr that
    produces it, refined inside nested jaxprs (``jit``, ``custom_jvp``/``custom_vjp``,
    ``remat``). The backward pass runs the layers in reverse, so for a feed-forward
    stack this is roughly the reverse of the model's layer order: the last layer's
    gradients come first, the input embedding's last (a tied embedding is finished by
    the add of its two contributions). It is JAX's program order; XLA may schedule
    independent operations differently. Gradients no equation produces (constants,
    e.g. zeros for an unused parameter) go last, in leaf order.

    Args:
      fun: the loss function, differentiated with ``jax.grad``.
      *args: its arguments; arrays or `jax.ShapeDtypeStruct` s (nothing is computed).
      argnums: the position of the parameters in ``args``.

    Returns:
      a tuple of leaf indices (``jax.tree.leaves`` of ``args[argnums]``), first
      produced first.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import gradient_order
      >>> def loss(p, x):
      ...     return jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"])
      >>> params = {"w1": jnp.zeros((2, 3)), "w2": jnp.zeros(3)}
      >>> gradient_order(loss, params, jnp.ones(2))  # w2 (the last layer, leaf 1) first
      (1, 0)

    References:
      A. Thangakrishnan et al., "Herring: Rethinking the Parameter Server at Scale for
      the Cloud", SC 2020, section III (buffers in backward-pass order).
    """
    closed = jax.make_jaxpr(jax.grad(fun, argnums=argnums))(*args)
    n = len(jax.tree.leaves(args[argnums]))
    outvars = closed.jaxpr.outvars
    if len(outvars) != n:  # pragma: no cover - jax.grad returns one output per leaf
        raise ValueError(f"expected {n} gradient outputs, got {len(outvars)}")
    keys = [_position(closed.jaxpr, v) for v in outvars]
    return tuple(sorted(range(n), key=lambda i: (keys[i], i)))


_LAST = (math.inf,)


def _position(jaxpr, var) -> tuple:
    if isinstance(var, jax.extend.core.Literal):
        return _LAST  # a literal
    for i, eqn in enumerate(jaxpr.eqns):
        if any(o is var for o in eqn.outvars):
            inner = _inner_jaxpr(eqn)
            if inner is None:
                return (i,)
            k = next(k for k, o in enumerate(eqn.outvars) if o is var)
            return (i, *_position(inner, inner.outvars[k]))
    return _LAST  # an input passed through


def _inner_jaxpr(eqn):
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(name)
        if sub is None:
            continue
        sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(sub, "eqns") and len(sub.outvars) == len(eqn.outvars):
            return sub
    return None


def broadcast_order(order: Sequence[int], collective: Any) -> tuple[int, ...]:
    """Worker 0's ``order``, on every worker ("BFB without negotiation").

    Host-side (`Collective.host_broadcast`): call it on every worker at the same point,
    outside ``jit``. On MPI this is one ``bcast`` on the communicator; simulated workers
    share this process and its order, which is returned as is.

    Args:
      order: this worker's production order (leaf indices), e.g. from `gradient_order`.
      collective: the workers (`shoal.comms.Collective`).

    Returns:
      worker 0's order as a tuple of ints.

    Example:
      >>> from shoal.comms import AxisCollective, broadcast_order
      >>> broadcast_order([1, 0], AxisCollective("workers", 2))
      (1, 0)

    References:
      A. Thangakrishnan et al., "Herring: Rethinking the Parameter Server at Scale for
      the Cloud", SC 2020, section III.
    """
    return tuple(int(i) for i in collective.host_broadcast([int(i) for i in order], root=0))
