"""Which implementation a kernel runs (Pallas on GPU, the jnp reference elsewhere), and the
input check every public kernel starts with."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

IMPLS = (None, "reference", "pallas")


def use_pallas(impl: str | None) -> bool:
    """``impl=None`` picks Pallas on a GPU backend; ``"reference"``/``"pallas"`` force one
    (Pallas off GPU then runs in interpret mode, for tests)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be None, 'reference' or 'pallas', got {impl!r}")
    if impl is None:
        return jax.default_backend() == "gpu"
    return impl == "pallas"


def typed_array(x: Any, dtype: Any, name: str) -> jax.Array:
    """``x`` as an array of exactly ``dtype``; checked before ``jnp.asarray`` too, which
    would silently narrow e.g. float64 to float32 when x64 is off."""
    for value in (x, jnp.asarray(x)):
        got = getattr(value, "dtype", jnp.dtype(dtype))
        if got != dtype:
            raise TypeError(f"{name} must be {jnp.dtype(dtype).name}, got dtype {got}")
    return jnp.asarray(x)


def batched(fn: Any, stacked: Any = None) -> Any:
    """``fn`` with a vmap rule that calls it on the stacked arrays (the Pallas wrappers and
    the GTC reference take leading dimensions natively), instead of pallas_call's generic
    grid batching or plain vmap's; the arguments may be pytrees of arrays.

    ``stacked``: what the rule calls on them instead, when ``fn`` must be told that
    they hold one more batch dimension (a callable returning that function, or None:
    ``fn`` itself)."""
    wrapped = jax.custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        grow = lambda x, b: x if b else jnp.broadcast_to(x, (axis_size, *jnp.shape(x)))
        call = wrapped if stacked is None else stacked()
        out = call(*jax.tree.map(grow, args, tuple(in_batched)))
        return out, jax.tree.map(lambda _: True, out)

    return wrapped
