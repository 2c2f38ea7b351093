"""Construction-time checks shared by shoal's transformations."""

from __future__ import annotations

from typing import Any


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
