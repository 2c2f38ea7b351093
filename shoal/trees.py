"""Pytree helpers shared by every layer of shoal (no JAX transformation of their own)."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["find_instances"]


def find_instances(tree: Any, cls: type | tuple[type, ...]) -> list[Any]:
    """Every instance of ``cls`` inside ``tree`` (a state class, a meter), at any nesting:
    chains, wrappers, dicts; outermost first, in ``jax.tree`` order.

    Args:
      tree: any pytree, e.g. an optimizer state.
      cls: the class (or classes) to look for; an instance is not searched further.

    Returns:
      the instances found (empty when there is none).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> state = optax.chain(optax.sgd(0.1, momentum=0.9)).init(jnp.zeros(2))
      >>> [type(s).__name__ for s in find_instances(state, optax.TraceState)]
      ['TraceState']
    """
    is_one = lambda x: isinstance(x, cls)
    return [x for x in jax.tree.leaves(tree, is_leaf=is_one) if is_one(x)]
