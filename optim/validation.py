"""Construction-time checks shared by shoal's transformations."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def check_collective(collective: Any) -> None:
    """A collective must be a Collective value, never a callable (optax would call it as a
    schedule inside ``inject_hyperparams``)."""
    if callable(collective):
        raise TypeError("collective must be a shoal Collective object, not a callable")
    for member in ("size", "rank", "all_reduce", "all_gather", "all_to_all"):
        if not hasattr(collective, member):
            raise TypeError(
                f"collective must be a shoal Collective (missing .{member}), got "
                f"{type(collective).__name__}"
            )


def concrete_float(value: Any) -> float | None:
    """``value`` as a Python float, or None when it is traced (e.g. a hyper-parameter that
    ``optax.inject_hyperparams`` feeds in inside ``jit``), so it cannot be checked here."""
    if isinstance(value, jax.core.Tracer):
        return None
    try:
        return float(np.asarray(value))
    except (TypeError, ValueError) as e:
        raise TypeError(f"expected a real number, got {value!r}") from e


def check_positive(name: str, value: Any) -> None:
    v = concrete_float(value)
    if v is not None and not (v > 0 and np.isfinite(v)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def check_floating_leaves(name: str, tree: Any) -> None:
    """Gradients must be floating point: an integer gradient is a bug upstream."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating):
            raise ValueError(
                f"{name} must be floating point; leaf {jax.tree_util.keystr(path)} has "
                f"dtype {jnp.asarray(leaf).dtype}"
            )


def require_params(name: str, params: Any) -> None:
    """Transformations whose update reads the model refuse a missing ``params``."""
    if params is None:
        raise ValueError(f"{name} needs params: call update(grads, state, params)")
