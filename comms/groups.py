"""Two-tier worker groups: ``intra`` (inside a group) and ``inter`` (across groups)."""

from __future__ import annotations

from typing import Any

from shoal.checks import check_int


def check_group_size(world_size: int, group_size: Any) -> int:
    """Return the number of groups; ``group_size`` must be a positive divisor of ``world_size``."""
    group_size = check_int("group_size", group_size, 1)
    if world_size % group_size:
        raise ValueError(f"group_size={group_size} must divide the number of workers {world_size}")
    return world_size // group_size


def two_tier(collective: Any, group_size: int, **axis_names: str) -> tuple[Any, Any]:
    """``(intra, inter)`` collectives for groups of ``group_size`` consecutive workers.

    Worker ``w`` is member ``w mod group_size`` of group ``w // group_size``; ``intra``
    spans the members of its group, ``inter`` the workers with its member index in
    every group.

    * `MPICollective`: sub-communicators from ``comm.Split``.
    * `AxisCollective`: two nested named axes (``intra_axis="member"``,
      ``inter_axis="group"`` by default); run the per-worker function under
      ``jax.vmap(jax.vmap(f, axis_name=intra_axis), axis_name=inter_axis)``.

    Args:
      collective: all the workers; its size must be a multiple of ``group_size``.
      group_size: workers per group (``P``).
      **axis_names: for `AxisCollective`, ``intra_axis`` and ``inter_axis``.

    Returns:
      ``(intra, inter)``, collectives of sizes ``group_size`` and
      ``size / group_size``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective, two_tier
      >>> intra, inter = two_tier(AxisCollective("workers", 4), group_size=2)
      >>> def sums(x):
      ...     return intra.all_reduce(x, op="sum"), inter.all_reduce(x, op="sum")
      >>> x = jnp.array([[0.0, 1.0], [2.0, 3.0]])  # [group, member]: workers 0..3
      >>> in_group, across = jax.vmap(jax.vmap(sums, axis_name="member"),
      ...                             axis_name="group")(x)
      >>> print(in_group)
      [[1. 1.]
       [5. 5.]]
      >>> print(across)
      [[2. 4.]
       [2. 4.]]

    References:
      P. Ladkat et al., "Two Tiered Distributed Training Algorithm for Acoustic
      Modeling" (groups of workers and a second tier across them).
    """
    return collective.split(group_size, **axis_names)
