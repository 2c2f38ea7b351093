"""The shaped multi-host network (`benchmarks/cluster`): namespaces joined by a bridge, tbf
on every link, MPI ranks placed in them; and `run.py --tiny` end to end. Needs root, ``ip``,
``tc`` and ``unshare``: skipped with the reason where namespaces cannot be made."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import harness
import pytest

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "benchmarks" / "cluster"
sys.path.insert(0, str(CLUSTER))

import netns  # noqa: E402

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="these tests build their own MPI jobs")


@pytest.fixture(scope="module")
def available():
    try:
        netns.check_available()
    except netns.Unavailable as e:
        pytest.skip(f"cannot build network namespaces: {e}")
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.skip("mpiexec not found next to python")
    return mpiexec


def test_probe_two_hosts(available):
    env = {**os.environ, **netns.MPICH_ENV, "JAX_PLATFORMS": "cpu"}
    with netns.ShapedNetwork(hosts=2, rate_mbit=200) as net:
        cmd = [str(available), *net.mpiexec_args(), "-n", "2", sys.executable,
               str(CLUSTER / "probe.py"), "--mbytes", "3", "--reps", "5"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    ranks = found["ranks"]
    assert len(ranks) == 2
    assert ranks[0]["netns"] != ranks[1]["netns"]
    assert ranks[0]["netns"] != os.stat("/proc/self/ns/net").st_ino
    for r in ranks:
        assert r["addresses"], r
        assert all(ipaddress.ip_address(a) in netns.RANGE for a in r["addresses"]), r
    assert abs(found["rate_mbit"] - 200) <= 0.2 * 200, found["rate_mbit"]


def test_run_tiny(available, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(CLUSTER / "run.py"), "--tiny", "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ssgd |")]
    assert rows and " mpi " in rows[0], proc.stdout
    assert "| algorithm | backend | ms/step measured |" in proc.stdout


def test_no_leftovers(available):
    # After the tests above (pytest runs a file's tests in order): everything was removed.
    assert netns.leftovers() == []
