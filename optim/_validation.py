"""Construction-time checks shared by shoal's transformations."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shoal.checks import check_real
from shoal.comms.collective import missing_members


def check_collective(collective: Any) -> None:
    """A collective must be a Collective value, never a callable (optax would call it as a
    schedule inside ``inject_hyperparams``)."""
    if callable(collective):
        raise TypeError("collective must be a shoal Collective object, not a callable")
    missing = missing_members(collective)
    if missing:
        raise TypeError(
            f"collective must be a shoal Collective (missing "
            f"{', '.join('.' + m for m in missing)}), got {type(collective).__name__}"
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


def check_hyper(name: str, value: Any, low: Any = None, high: Any = None, **bounds: Any) -> Any:
    """`shoal.checks.check_real` for a hyper-parameter that `optax.inject_hyperparams` may
    feed in as an array: a traced one passes unchecked (nothing is known of it here), a
    concrete scalar array is checked by its value. Returns a float, or the traced array."""
    if isinstance(value, jax.core.Tracer):
        return value
    if isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0:
        check_real(name, value.item(), low, high, **bounds)
        return value
    return check_real(name, value, low, high, **bounds)


def check_positive(name: str, value: Any) -> None:
    """A finite number > 0 (bools refused), or an injected array (`check_hyper`)."""
    check_hyper(name, value, 0, open_low=True)


def check_floating_leaves(name: str, tree: Any) -> None:
    """Gradients must be floating point: an integer gradient is a bug upstream."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = jnp.result_type(leaf)  # no copy of a NumPy leaf to the device, as asarray
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{name} must be floating point; leaf {jax.tree_util.keystr(path)} has "
                f"dtype {dtype}"
            )


def require_params(name: str, params: Any) -> None:
    """Transformations whose update reads the model refuse a missing ``params``."""
    if params is None:
        raise ValueError(f"{name} needs params: call update(grads, state, params)")


def _describe(treedef: Any) -> str:
    text = str(treedef)
    return text if len(text) <= 200 else text[:197] + "..."


def check_tree_like(name: str, what: str, tree: Any, reference: Any, expected: str) -> None:
    """Static check: ``tree`` has ``reference``'s structure and leaf shapes (dtypes may
    differ). ``what`` names ``tree`` ("the gradient", "params") and ``expected`` says
    where ``reference`` came from; the error names ``name`` and the first leaf that
    differs, with what was expected and what was got."""
    got, got_def = jax.tree_util.tree_flatten_with_path(tree)
    want, want_def = jax.tree_util.tree_flatten_with_path(reference)
    if got_def != want_def:
        got_keys = {jax.tree_util.keystr(p) for p, _ in got}
        want_keys = {jax.tree_util.keystr(p) for p, _ in want}
        missing, extra = sorted(want_keys - got_keys), sorted(got_keys - want_keys)
        detail = ""
        if missing:
            detail += f"; missing leaves {', '.join(missing[:5])}"
        if extra:
            detail += f"; unexpected leaves {', '.join(extra[:5])}"
        raise ValueError(
            f"{name}: {what} does not have the tree structure of {expected}{detail}. "
            f"Expected {_describe(want_def)}, got {_describe(got_def)}"
        )
    for (path, leaf), (_, ref) in zip(got, want):
        if np.shape(leaf) != np.shape(ref):
            raise ValueError(
                f"{name}: {what} leaf {jax.tree_util.keystr(path) or '(root)'} has shape "
                f"{tuple(np.shape(leaf))}, expected {tuple(np.shape(ref))} (its shape in "
                f"{expected})"
            )


def check_update_args(
    name: str,
    state: Any,
    state_type: type,
    updates: Any,
    params: Any = None,
    reference: Any = None,
) -> None:
    """Cheap trace-time checks at the top of a transformation's ``update``.

    ``state`` must be a ``state_type`` (the result of this transformation's ``init``);
    ``updates`` must match ``reference`` (a params-shaped tree from the state, when the
    state holds one) and, when given, ``params``, and be floating point.
    """
    if not isinstance(state, state_type):
        got = f"a {type(state).__name__}"
        if isinstance(state, tuple) and not state:
            got = "an empty tuple ()"
        raise TypeError(
            f"{name}: update got {got} as its state, expected a {state_type.__name__}: "
            f"pass the state returned by this {name}(...) transformation's init(params) "
            f"(and the one its previous update returned), not another transformation's"
        )
    if reference is not None:
        check_tree_like(
            name, "the gradient (updates)", updates, reference, "the params given to init"
        )
    if params is not None:
        check_tree_like(name, "the gradient (updates)", updates, params, "params")
    # Here, not in each update: an integer gradient would otherwise come back as an
    # integer update (a mean of 3.5 as 3) from any transformation that forgot the check.
    check_floating_leaves(f"{name}: updates", updates)


def checked(name: str, state_type: type, update_fn: Any, reference: Any = None) -> Any:
    """``update_fn`` preceded by `check_update_args`; ``reference(state)`` returns the
    state's params-shaped tree (None: the state holds none)."""

    def update(updates, state, params=None, **extra_args):
        ref = reference(state) if reference is not None and isinstance(state, state_type) else None
        check_update_args(name, state, state_type, updates, params, ref)
        return update_fn(updates, state, params, **extra_args)

    return update
