"""Branches that update their state in place.

An XLA conditional returns fresh buffers: a branch that passes a parameter-sized operand
through unchanged (BMUF's global model on a local step, a whole optimizer state on a
skipped step) still costs a copy of it, and on XLA:CPU the page faults of the fresh
buffer on top. A while loop, by contrast, updates its carry in place. So a branch taken
on a rank-uniform predicate is written as a loop that runs its body 0 or 1 times:

    carry = fn(carry) if pred else carry

costs ``fn`` when ``pred`` holds and nothing otherwise (on a 64 MB state, 4 ms against
53 ms for ``lax.cond`` on 2 CPU cores: ``benchmarks/sim_scale.py``). Under ``vmap`` an
unbatched ``pred`` keeps the loop a real branch; a batched one still gives the right
answer, as a select.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
from jax import lax

from shoal.vma import axes_of, joint, vary, vary_as


def run_if(pred: Any, fn: Callable[[Any], Any], carry: Any) -> Any:
    """``fn(carry)`` if ``pred`` else ``carry``, updating ``carry``'s buffers in place.

    Args:
      pred: a boolean scalar, ideally the same on every worker (`Collective.uniform`).
      fn: maps ``carry`` to a tree of the same structure, shapes and dtypes (checked);
        it may contain collectives, which then run on all workers or on none.
      carry: the tree to update.

    Returns:
      The updated (or untouched) ``carry``.

    Example::

        w = run_if(step % 10 == 9, lambda w: w * 0.5, w)
    """
    carry = jax.tree.map(jnp.asarray, carry)
    out = jax.eval_shape(fn, carry)
    if _shapes(out) != _shapes(carry):
        raise ValueError(
            "run_if: fn must return a tree like its carry (structure, shapes, dtypes); "
            f"carry {_shapes(carry)}, fn returned {_shapes(out)}"
        )
    # Under shard_map's default check the carry must vary over the same mesh axes before
    # and after the body: ``fn`` may return an all-reduced value (varying over fewer axes)
    # or mix in a worker's own (more). Widen the carry until ``fn`` keeps it; under vmap
    # nothing varies over a mesh axis and this costs no trace.
    pred = jnp.asarray(pred, bool)
    axes = joint(carry, out)
    while joint(widened := vary_as(carry, axes)) != joint(carry):
        carry = widened
        axes = joint(carry, jax.eval_shape(fn, carry))

    def body(state):
        _, c = state
        new = jax.tree.map(lambda n, o: n.astype(o.dtype), fn(c), c)  # weak types as carry's
        return vary(jnp.zeros((), bool), axes_of(pred)), vary_as(new, axes)

    _, carry = lax.while_loop(lambda s: s[0], body, (pred, carry))
    return carry


def keeps_shape(fn: Callable[[Any], Any], carry: Any) -> bool:
    """Whether ``fn(carry)`` has ``carry``'s tree structure, shapes and dtypes (traced
    abstractly, nothing runs): the condition for `run_if`."""
    return _shapes(jax.eval_shape(fn, carry)) == _shapes(carry)


def passthrough_bytes(fn: Callable[[Any], Any], carry: Any) -> int:
    """Bytes of ``fn(carry)`` that ``fn`` may return unchanged: outputs that are its inputs,
    or come out of a loop or a branch (which may have passed them through). A
    ``where(pred, fn(carry), carry)`` costs a full pass over those bytes; `run_if` does not.
    """
    jaxpr = jax.make_jaxpr(fn)(carry).jaxpr
    inputs = set(jaxpr.invars)
    made_by = {v: eqn.primitive.name for eqn in jaxpr.eqns for v in eqn.outvars}
    total = 0
    for v in jaxpr.outvars:
        if isinstance(v, jax.extend.core.Literal):
            continue
        if v in inputs or made_by.get(v) in ("while", "cond"):
            total += v.aval.size * v.aval.dtype.itemsize
    return total


def _shapes(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [x if hasattr(x, "dtype") else jnp.asarray(x) for x in leaves]
    return treedef, tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves)


def switch_inplace(index: Any, fns: Sequence[Callable[[Any], Any]], carry: Any) -> Any:
    """``fns[index](carry)``, each candidate a `run_if`: in place, only the taken one runs.

    ``index`` is clamped to ``[0, len(fns) - 1]`` like ``lax.switch``'s.
    """
    index = jnp.clip(jnp.asarray(index, jnp.int32), 0, len(fns) - 1)
    for i, fn in enumerate(fns):
        carry = run_if(index == i, fn, carry)
    return carry
