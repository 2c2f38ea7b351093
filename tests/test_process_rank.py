"""`MPICollective.process_rank`: this process's rank as a host ``int``, equal to the traced
``rank()``; checked in the ranks of an ``mpiexec -n 2`` job, and in every rank when the
suite itself runs under mpiexec."""

import os
import sys

import pytest
from harness import UNDER_MPI, mpiexec, mpiexec_per_rank, world

pytestmark = pytest.mark.mpi

CHECK = """
import os
import jax
import pytest
from shoal.comms import MPICollective

def check(coll, expect):
    r = coll.process_rank
    assert type(r) is int and r == expect == coll.comm.Get_rank(), (r, expect)
    assert int(coll.rank()) == r and int(jax.jit(lambda: coll.rank())()) == r
    assert f"rank={r})" in repr(coll)
    with pytest.raises(AttributeError):
        coll.process_rank = 0
    return r
"""


def test_process_rank_is_the_host_rank(tmp_path):
    if UNDER_MPI:
        namespace = {}
        exec(CHECK, namespace)
        coll = world()
        rank = namespace["check"](coll, int(os.environ["PMI_RANK"]))
        intra, inter = coll.split(2)  # groups of 2 consecutive ranks
        namespace["check"](intra, rank % 2)
        namespace["check"](inter, rank // 2)
        return
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    code = (
        CHECK
        + """
coll = MPICollective()
me = check(coll, int(os.environ["PMI_RANK"]))
intra, inter = coll.split(1)
check(intra, 0)
check(inter, me)
x = [10, 11]
print(x[coll.process_rank])
"""
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc, stdout = mpiexec_per_rank(2, [sys.executable, "-c", code], tmp_path, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert stdout == ["10\n", "11\n"]  # each rank picked its own item
