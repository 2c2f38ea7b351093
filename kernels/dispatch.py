"""Which implementation a kernel runs: Pallas on GPU, the jnp reference elsewhere."""

from __future__ import annotations

import jax

IMPLS = (None, "reference", "pallas")


def use_pallas(impl: str | None) -> bool:
    """``impl=None`` picks Pallas on a GPU backend; ``"reference"``/``"pallas"`` force one
    (Pallas off GPU then runs in interpret mode, for tests)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be None, 'reference' or 'pallas', got {impl!r}")
    if impl is None:
        return jax.default_backend() == "gpu"
    return impl == "pallas"
