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


def test_simulated_workers_share_one_trace():
    # Nothing to compare in one process: the check is a no-op there.
    check_same_structure({"a": jnp.zeros(3)}, AxisCollective("workers", 4))
