"""Rank-agnostic test harness.

In one process, ``run_workers`` simulates N workers with ``jax.vmap`` and an
`AxisCollective`; under ``mpiexec -n N`` each rank runs its own worker with an
`MPICollective`. Either way it returns ``{rank: output}`` for the workers this
process can see, so a test checks every worker it has against its oracle.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax

from shoal.comms import AxisCollective, two_tier
from shoal.dtypes import standard_promotion

N_WORKERS = 4
QUICKSTART = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "quickstart.py"


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


def mpiexec() -> str | None:
    """The venv's mpiexec (next to this python), else the one on PATH, else None."""
    venv = Path(sys.executable).parent / "mpiexec"
    return str(venv) if venv.exists() else shutil.which("mpiexec")


def mpiexec_per_rank(
    n: int, args: list[str], out: Path, **kw
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``mpiexec -n n *args`` and return the process and each rank's stdout.

    mpiexec forwards the ranks' stdout unsynchronised: two ranks printing at once can
    arrive interleaved within a line ('1110' for '10' and '11'). Hydra's
    ``-outfile-pattern`` writes each rank's stdout to its own file instead, read back here
    (``out`` is a folder for them). ``kw`` goes to ``subprocess.run``.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [mpiexec(), "-outfile-pattern", str(out / "stdout.%r"), "-n", str(n), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    ranks = [(out / f"stdout.{r}") for r in range(n)]
    return proc, [p.read_text() if p.exists() else "" for p in ranks]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def assert_same_run(other: list[dict], sim: list[dict], runs: int) -> None:
    """Metrics of a multi-process run (MPI, jax.distributed) against the simulated run of
    the same config: ``runs`` algorithms evaluated 3 times each (steps 5, 10 and the last);
    losses and test metrics allclose (the reductions add in another order), steps and
    bytes identical."""
    assert len(other) == len(sim)
    np.testing.assert_allclose([r["loss"] for r in other], [r["loss"] for r in sim], rtol=1e-5)
    for key in ("test_loss", "test_accuracy"):
        s = [r[key] for r in sim if key in r]
        o = [r[key] for r in other if key in r]
        assert len(s) == len(o) == 3 * runs
        np.testing.assert_allclose(o, s, rtol=1e-5, err_msg=key)
    for key in ("algorithm", "step", "bytes_sent", "bytes_received", "mb_sent", "mb_received"):
        assert [r[key] for r in other] == [r[key] for r in sim], key
    np.testing.assert_allclose(
        [r["density"] for r in other if "density" in r],
        [r["density"] for r in sim if "density" in r],
    )


# optax's Adam family under standard promotion (`shoal.dtypes.standard_promotion`): the
# test session is strict (tests/conftest.py) and optax 0.2.8's bias correction is not.
def adam(*args, **kwargs):
    return standard_promotion(optax.adam(*args, **kwargs))


def adamw(*args, **kwargs):
    return standard_promotion(optax.adamw(*args, **kwargs))
