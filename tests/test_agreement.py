"""Workers whose parameter pytrees differ are refused when the optimizer is initialised,
with the first differing leaf named, on every rank (an mpiexec -n 2 job)."""

import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from harness import UNDER_MPI, mpiexec

from shoal.comms import AxisCollective, check_same_structure

JOB = Path(__file__).parent / "jobs" / "mismatch.py"


@pytest.mark.skipif(UNDER_MPI, reason="starts its own mpiexec job")
def test_mismatched_workers_are_refused_at_init(tmp_path):
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [str(exe), "-n", "2", sys.executable, str(JOB), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for rank in (0, 1):
        line = (tmp_path / f"refused.{rank}").read_text()
        want = "leaf 1 ['b']: worker 0 has shape (3,) float32, worker 1 has shape (3,) float16"
        assert want in line, line


class Gather:
    """A collective's host side for the check: every worker's description is ``obj``, but
    worker 1's, which is ``worker_1`` when given; the descriptions seen are kept."""

    def __init__(self, worker_1=None):
        self.worker_1, self.seen = worker_1, []

    def host_allgather(self, obj):
        self.seen.append(obj)
        return [obj, obj if self.worker_1 is None else self.worker_1]


TREE = {"a": jnp.zeros(3), "b": jnp.zeros((2, 1), jnp.float16)}


def test_simulated_workers_share_one_trace():
    # Simulated workers run one trace: every worker's description is worker 0's, nothing
    # is sent, and the check passes whatever the tree.
    coll = AxisCollective("workers", 4)
    assert coll.host_allgather(("described",)) == [("described",)] * 4
    assert check_same_structure(TREE, coll) is None


def test_a_differing_leaf_is_named():
    # The comparison the MPI job relies on, in one process: worker 1's "b" is float32.
    other = Gather()
    check_same_structure({"a": jnp.zeros(3), "b": jnp.zeros((2, 1))}, other)
    same = Gather()
    check_same_structure(TREE, same)
    assert same.seen != other.seen
    want = r"params differ between workers at leaf 1 \['b'\]: worker 0 has shape \(2, 1\) float16, "
    want += r"worker 1 has shape \(2, 1\) float32"
    with pytest.raises(ValueError, match=want):
        check_same_structure(TREE, Gather(worker_1=other.seen[0]))
