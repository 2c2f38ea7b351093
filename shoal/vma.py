"""Which manual mesh axes a value varies over, and branches and loops that agree on it.

``jax.shard_map`` checks by default (``check_vma=True``) that every value's type says
which mesh axes it varies over: a worker's gradient varies over ``"workers"``, an
all-reduced mean does not. A ``lax.cond`` whose branches disagree (one returns the mean,
the other zeros) or a loop whose body changes what its carry varies over fails to trace.
The helpers here make both sides vary over the union of what they vary over, which
is what the values are anyway: ``lax.pcast(x, axes, to="varying")`` only retypes ``x``,
nothing moves. Under ``vmap`` and outside ``shard_map`` nothing varies over a manual axis
and every helper is the identity.

Example::

    y = cond(bad, lambda g: jnp.zeros_like(g), lambda g: lax.pmean(g, "w"), g)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax


def axes_of(x: Any) -> frozenset[str]:
    """The manual mesh axes ``x`` (an array, tracer or ``ShapeDtypeStruct``) varies over."""
    mat = getattr(x, "manual_axis_type", None)
    if mat is None and not isinstance(x, jax.ShapeDtypeStruct):
        mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()))


def vary(x: Any, axes: frozenset[str]) -> Any:
    """``x`` typed as varying over ``axes`` too (a no-op when it already does)."""
    missing = tuple(sorted(set(axes) - axes_of(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def vary_as(tree: Any, axes: Any) -> Any:
    """Each leaf of ``tree`` made to vary over the matching entry of ``axes`` (a tree of
    frozensets with ``tree``'s structure)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([vary(x, a) for x, a in zip(leaves, treedef.flatten_up_to(axes))])


def joint(*trees: Any) -> Any:
    """Leaf by leaf, the union of what the same leaf varies over in each of ``trees`` (trees
    of one structure; arrays or ``ShapeDtypeStruct``s)."""
    leaves = [jax.tree.leaves(t) for t in trees]
    treedef = jax.tree.structure(trees[0])
    return treedef.unflatten([frozenset().union(*map(axes_of, xs)) for xs in zip(*leaves)])


def agreeing(fns: Sequence[Callable[..., Any]], *operands: Any) -> list[Callable[..., Any]]:
    """``fns`` (branches over ``operands``) whose outputs vary over the same axes, leaf
    by leaf: the union over all branches, found by tracing them abstractly."""
    outs = [jax.eval_shape(fn, *operands) for fn in fns]
    if any(jax.tree.structure(o) != jax.tree.structure(outs[0]) for o in outs):
        return list(fns)  # lax.cond raises its own, clearer error
    axes = joint(*outs)
    return [lambda *a, fn=fn: vary_as(fn(*a), axes) for fn in fns]


def cond(pred: Any, true_fn: Callable, false_fn: Callable, *operands: Any) -> Any:
    """``lax.cond`` whose branches may disagree on what varies over a manual axis."""
    return lax.cond(pred, *agreeing([true_fn, false_fn], *operands), *operands)


def switch(index: Any, branches: Sequence[Callable], *operands: Any) -> Any:
    """``lax.switch`` whose branches may disagree on what varies over a manual axis."""
    return lax.switch(index, agreeing(branches, *operands), *operands)


def scan(body: Callable, carry: Any, xs: Any) -> tuple[Any, Any]:
    """``lax.scan(body, carry, xs)`` whose body may change what its carry varies over (a
    step's byte counters start unvarying, a worker's state varies): the carry, in and out,
    varies over the union, found by tracing one iteration abstractly."""
    first = jax.tree.map(lambda x: x[0], xs)
    axes = joint(carry, jax.eval_shape(lambda c, x: body(c, x)[0], carry, first))

    def agreeing_body(c, x):
        c, y = body(c, x)
        return vary_as(c, axes), y

    return lax.scan(agreeing_body, vary_as(carry, axes), xs)
