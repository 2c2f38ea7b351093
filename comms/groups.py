"""Two-tier worker groups: ``intra`` (inside a group) and ``inter`` (across groups)."""

from __future__ import annotations

from typing import Any


def check_group_size(world_size: int, group_size: Any) -> int:
    """Return the number of groups; ``group_size`` must be a positive divisor of ``world_size``."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if world_size % group_size:
        raise ValueError(f"group_size={group_size} must divide the number of workers {world_size}")
    return world_size // group_size


def two_tier(collective: Any, group_size: int, **axis_names: str) -> tuple[Any, Any]:
    """``(intra, inter)`` collectives for groups of ``group_size`` consecutive workers.

    * `MPICollective`: sub-communicators from ``comm.Split``.
    * `AxisCollective`: two nested named axes (``intra_axis="member"``,
      ``inter_axis="group"`` by default); run the per-worker function under
      ``jax.vmap(jax.vmap(f, axis_name=intra_axis), axis_name=inter_axis)``.
    """
    return collective.split(group_size, **axis_names)
