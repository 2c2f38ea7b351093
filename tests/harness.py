"""Rank-agnostic test harness.

In one process, ``run_workers`` simulates N workers with ``jax.vmap`` and an
`AxisCollective`; under ``mpiexec -n N`` each rank runs its own worker with an
`MPICollective`. Either way it returns ``{rank: output}`` for the workers this
process can see, so a test checks every worker it has against its oracle.
"""

from __future__ import annotations

import functools
import os

import jax

from shoal.comms import AxisCollective, two_tier

N_WORKERS = 4


def mpi_size() -> int:
    # Hydra (MPICH) and Open MPI both export the world size to every rank.
    return int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))


UNDER_MPI = mpi_size() > 1


@functools.cache
def world():
    """The collective of all workers: MPI world (under mpiexec) or a simulated axis."""
    if UNDER_MPI:
        from shoal.comms import MPICollective

        return MPICollective()
    return AxisCollective("workers", N_WORKERS)


def n_workers() -> int:
    return mpi_size() if UNDER_MPI else N_WORKERS


def my_ranks() -> list[int]:
    return [world()._rank] if UNDER_MPI else list(range(N_WORKERS))


def run_workers(fn, *stacked_args, collective=None):
    """Run ``fn(collective, *args_of_one_worker)`` on every worker, jitted.

    ``stacked_args`` are pytrees with a leading axis of size ``n_workers()``.
    Returns ``{rank: output of that worker}``.
    """
    coll = collective or world()
    f = functools.partial(fn, coll)
    if UNDER_MPI:
        r = coll._rank
        mine = jax.tree.map(lambda a: a[r], stacked_args)
        return {r: jax.jit(f)(*mine)}
    out = jax.jit(jax.vmap(f, axis_name=coll.axis_name))(*stacked_args)
    return {r: jax.tree.map(lambda a, r=r: a[r], out) for r in range(coll.size)}


@functools.cache
def tiers(group_size):
    """``(intra, inter)`` of `world` for groups of ``group_size``; cached, since
    ``comm.Split`` is collective: every rank splits once per group size, in order."""
    return two_tier(world(), group_size)


def run_two_tier(fn, group_size, *stacked_args):
    """``fn(intra, inter, *args_of_one_worker)`` on every worker; ``{rank: output}``."""
    intra, inter = tiers(group_size)
    f = functools.partial(fn, intra, inter)
    if UNDER_MPI:
        r = my_ranks()[0]
        return {r: jax.jit(f)(*jax.tree.map(lambda a: a[r], stacked_args))}
    n = n_workers()
    groups = n // group_size
    nested = jax.vmap(jax.vmap(f, axis_name=intra.axis_name), axis_name=inter.axis_name)
    grouped = jax.tree.map(lambda a: a.reshape(groups, group_size, *a.shape[1:]), stacked_args)
    y = jax.jit(nested)(*grouped)
    return {w: jax.tree.map(lambda a, w=w: a[w // group_size, w % group_size], y) for w in range(n)}
