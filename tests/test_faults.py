"""Faults under MPI: a rank killed with SIGKILL mid-run (a worker, or a dedicated parameter
server) ends the whole job with a non-zero exit within 60 s, leaves the last checkpoint
intact (its checksum matches), and ``--resume`` continues from it. Also the non-finite
policy "raise" stops every rank at the same step. Each test runs ``mpiexec -n 4``
itself, so this file runs in the single-process suite."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import QUICKSTART, UNDER_MPI, mpiexec

from shoal.experiments.runner.checkpoint_files import COMMITTED, read

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="starts its own mpiexec jobs")

RANKS = 4
EVERY = 20  # checkpoint period
# Long enough that the kill always lands mid-run, a few seconds after the first checkpoint.
SETS = ["steps=20000", f"checkpoint_every={EVERY}", "eval_every=20000", "project_workers=0"]


def command(out: Path, *extra: str, servers: int = 0, algorithm: str = "ssgd") -> list[str]:
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    return [exe, "-n", str(RANKS), sys.executable, "-m", "shoal.experiments.runner.cli",
            str(QUICKSTART), "--backend", "mpi", "--servers", str(servers), "--no-progress",
            "--set", *SETS, f"algorithms={algorithm}", "--out", str(out),
            *extra]  # fmt: skip


def env() -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu")


def rank_pid(out: Path, rank: int) -> int | None:
    """The pid of MPI rank ``rank`` of the job writing to ``out`` (Linux /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(out).encode() in cmdline and f"PMI_RANK={rank}".encode() in environ:
            if b"shoal.experiments.runner.cli" in cmdline:
                return int(entry.name)
    return None


def committed(folder: Path) -> dict[int, list[Path]]:
    """step -> its step folders, over all ranks: those `save` marked committed, after
    orbax's rename and an fsync of every file."""
    steps: dict[int, list[Path]] = {}
    for marker in folder.glob(f"rank_*/step_*/{COMMITTED}"):
        step = marker.parent
        steps.setdefault(int(step.name.removeprefix("step_")), []).append(step)
    return steps


def kill_mid_run(out: Path, victim: int, servers: int, workers: int, algorithm: str):
    """Start the job, SIGKILL rank ``victim`` once every worker has a checkpoint, and
    return (exit code, seconds from the kill to the job's end, checkpoint folder, log)."""
    folder = out / "checkpoints" / algorithm
    job = subprocess.Popen(command(out, servers=servers, algorithm=algorithm), env=env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and job.poll() is None:
            if any(len(s) == workers for s in committed(folder).values()):
                break
            time.sleep(0.2)
        assert job.poll() is None, f"the job ended before the kill:\n{job.communicate()[0]}"
        assert committed(folder), "no checkpoint within 240 s"
        time.sleep(1.0)  # well into the training loop, between checkpoints or in one
        pid = rank_pid(out, victim)
        assert pid is not None, f"rank {victim} not found"
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        log, _ = job.communicate(timeout=90)
        return job.returncode, time.monotonic() - killed, folder, log
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()


def check_intact(folder: Path, workers: int) -> int:
    """Every committed checkpoint reads back verified (`read` checks every array's and the
    JSON part's sha256); returns the newest step committed by every worker (the one
    ``--resume`` must pick)."""
    steps = committed(folder)
    for folders in steps.values():
        for step in folders:
            read(step)
    complete = [s for s, folders in steps.items() if len(folders) == workers]
    assert complete and all(s % EVERY == 0 for s in complete)
    return max(complete)


def resume(out: Path, servers: int, algorithm: str) -> str:
    proc = subprocess.run(command(out, "--resume", "--stop-after", "5", servers=servers,
                                  algorithm=algorithm),
                          env=env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize(
    "victim, servers, algorithm",
    [
        (2, 0, "ssgd"),
        (3, 2, "bfb_allreduce"),
    ],  # a worker of 4; a server of 2 (ranks 2, 3) with 2 workers
    ids=["worker", "server"],
)
def test_sigkill_ends_the_job_and_resume_continues(tmp_path, victim, servers, algorithm):
    workers = RANKS - servers
    rc, seconds, folder, log = kill_mid_run(tmp_path, victim, servers, workers, algorithm)
    assert rc != 0, log[-2000:]
    assert seconds < 60, f"{seconds:.1f} s to end the job"
    step = check_intact(folder, workers)
    out = resume(tmp_path, servers, algorithm)
    # --stop-after 5: five steps after the checkpoint it resumed from.
    assert re.search(rf"stopped {algorithm} at step {step + 5} of 20000", out), out


def test_raise_policy_stops_every_rank(tmp_path):
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    cmd = [exe, "-n", str(RANKS), sys.executable, "-m", "shoal.experiments.runner.cli",
           str(QUICKSTART), "--backend", "mpi", "--no-progress", "--set", "steps=20",
           "algorithms=gtc", "project_workers=0", "nonfinite=raise", "inject_nonfinite=7:1",
           "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("shoal-run: error:")]
    assert lines == [
        "shoal-run: error: gtc: step 7: NaN/Inf in the gradient of 1 of 4 workers "
        "(nonfinite='raise'; 'skip' would have skipped the step on every worker)"
    ]
    assert "Traceback" not in proc.stderr
