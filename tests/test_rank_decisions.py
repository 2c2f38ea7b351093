"""Every process decides together: a check that refuses on some MPI ranks only, or an
exception during set-up on one rank, ends every rank within seconds with a non-zero exit
code and one message, instead of leaving the others waiting in a collective for ever.

Each job runs under ``mpiexec`` with a timeout (a hang fails the test), and every rank
writes its own exit code to a file (``sh -c '...; echo $? > rc.$PMI_RANK'``), so the test
sees each rank's code, not only mpiexec's. This file starts its own jobs, so it runs in
the single-process suite."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import QUICKSTART, UNDER_MPI, mpiexec

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="starts its own mpiexec jobs")

S40 = ["--set", "steps=40", "algorithms=ssgd", "checkpoint_every=10", "project_workers=0",
       "eval_every=10"]  # fmt: skip
PREFIX = "shoal-run: error:"
LIMIT = 60  # seconds: a refusal takes one start-up of JAX; a hang takes for ever


def runner(*args: str) -> list[str]:
    return [sys.executable, "-m", "shoal.experiments.runner.cli", *args, "--no-progress"]


def per_rank(cmd: list[str], codes: Path) -> list[str]:
    """``cmd`` in a shell that writes the rank's exit code to ``codes/rc.<rank>``."""
    line = f"{shlex.join(cmd)}; echo $? > {shlex.quote(str(codes))}/rc.$PMI_RANK"
    return ["sh", "-c", line]


def launch(groups: list[tuple[int, list[str], Path | None]], tmp: Path, timeout: int = LIMIT):
    """Run ``mpiexec`` with one ``-n N [-wdir W] cmd`` group per entry of ``groups``;
    returns (mpiexec's exit code, stdout + stderr, each rank's exit code, seconds)."""
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    codes = tmp / "codes"
    shutil.rmtree(codes, ignore_errors=True)
    codes.mkdir(parents=True)
    cmd = [exe]
    for i, (n, args, wdir) in enumerate(groups):
        cmd += [":"] if i else []
        cmd += ["-n", str(n), *(["-wdir", str(wdir)] if wdir else []), *per_rank(args, codes)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() + (e.stderr or b"").decode()
        pytest.fail(f"the job hangs (no end within {timeout} s):\n{out[-3000:]}")
    seconds = time.monotonic() - start
    ranks = sum(n for n, _, _ in groups)
    rcs = [int((codes / f"rc.{r}").read_text()) if (codes / f"rc.{r}").exists() else None
           for r in range(ranks)]  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr, rcs, seconds


def assert_refused(result, *words: str) -> None:
    """Every rank exited 2 and the job printed exactly one error line, with ``words``."""
    code, out, rcs, seconds = result
    assert rcs == [2] * len(rcs), (rcs, out[-3000:])
    errors = [line for line in out.splitlines() if line.startswith(PREFIX)]
    assert len(errors) == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    for w in words:
        assert w in errors[0], errors[0]
    assert seconds < LIMIT


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory) -> Path:
    """An MPI run of 2 ranks stopped at step 25, checkpoints at 10, 20 and 25 (the last
    two kept)."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    cmd = runner(str(QUICKSTART), "--backend", "mpi", *S40, "--out", str(out),
                 "--stop-after", "25")  # fmt: skip
    code, text, rcs, _ = launch([(2, cmd, None)], out.parent, timeout=240)
    assert rcs == [0, 0], text[-3000:]
    return out


def resume(out: Path, *extra: str) -> list[str]:
    return runner(str(QUICKSTART), "--backend", "mpi", *S40, *extra, "--out", str(out),
                  "--resume")  # fmt: skip


def test_resume_with_more_ranks_than_the_checkpoint(two_rank_checkpoint, tmp_path):
    # Rank 2 has no checkpoint of its own: every rank reads both saved ranks' (elastic).
    out = tmp_path / "run"
    shutil.copytree(two_rank_checkpoint, out)
    code, text, rcs, _ = launch([(3, resume(out), None)], tmp_path, timeout=240)
    assert rcs == [0, 0, 0], text[-3000:]
    assert "resuming ssgd on 3 ranks from a checkpoint of 2 (step 25" in text


def test_a_damaged_saved_rank_refuses_an_elastic_resume(two_rank_checkpoint, tmp_path):
    # Rank 1's newest step cut short: the 3 ranks resume from the step both saved ranks
    # hold (20), as one; without rank 1's folder there is none, on every rank alike.
    out = tmp_path / "run"
    shutil.copytree(two_rank_checkpoint, out)
    meta = out / "checkpoints" / "ssgd" / "rank_1" / "step_25" / "meta" / "meta.json"
    os.truncate(meta, 100)
    code, text, rcs, _ = launch([(3, resume(out), None)], tmp_path, timeout=240)
    assert rcs == [0, 0, 0], text[-3000:]
    assert "resuming ssgd on 3 ranks from a checkpoint of 2 (step 20" in text
    out = tmp_path / "again"
    shutil.copytree(two_rank_checkpoint, out)
    shutil.rmtree(out / "checkpoints" / "ssgd" / "rank_1")
    result = launch([(3, resume(out), None)], tmp_path)
    assert_refused(result, "no good checkpoint of all 2 saved ranks")


def test_simulated_checkpoint_resumed_under_mpi(tmp_path):
    out = tmp_path / "run"
    sim = runner(str(QUICKSTART), "--workers", "2", *S40, "--out", str(out), "--stop-after", "15")
    subprocess.run(sim, check=True, capture_output=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    for ranks in (2, 3):  # the same rank count, or another (elastic): the backend differs
        result = launch([(ranks, resume(out), None)], tmp_path)
        assert_refused(result, "cannot resume ssgd", "'sim'")


def test_one_ranks_unreadable_newest_checkpoint_and_a_changed_field(two_rank_checkpoint, tmp_path):
    # Rank 1's newest meta.json is cut short: it resumes from step 20, whose config must
    # still be compared (ssgd.local.learning_rate changed), on that rank as on the other.
    out = tmp_path / "run"
    shutil.copytree(two_rank_checkpoint, out)
    meta = out / "checkpoints" / "ssgd" / "rank_1" / "step_25" / "meta" / "meta.json"
    os.truncate(meta, 100)
    result = launch([(2, resume(out, "--set", "ssgd.local.learning_rate=0.1"), None)], tmp_path)
    assert_refused(result, "'ssgd.local.learning_rate'", "0.1 now but 0.05")


def test_a_config_file_missing_on_one_node(tmp_path):
    # Rank 0 finds my.py in its folder, rank 1 (another node's folder) does not.
    a, b = tmp_path / "A", tmp_path / "B"
    a.mkdir()
    b.mkdir()
    shutil.copy(QUICKSTART, a / "my.py")
    cmd = runner("my.py", "--backend", "mpi", "--set", "steps=10", "algorithms=ssgd",
                 "--out", str(tmp_path / "n"))  # fmt: skip
    result = launch([(1, cmd, a), (1, cmd, b)], tmp_path)
    assert_refused(result, "process 1:", "my.py")


def test_an_exception_on_one_rank_during_set_up_ends_every_rank(tmp_path):
    # Not a ConfigError: a config file that fails on rank 1 only. The traceback is printed
    # once and MPI_Abort ends the others, which were waiting for rank 1.
    config = tmp_path / "flaky.py"
    config.write_text(
        "import os\n"
        f"exec(open({str(QUICKSTART)!r}).read())\n"
        "if os.environ.get('PMI_RANK') == '1':\n"
        "    raise RuntimeError('rank 1 cannot read its data')\n"
    )
    cmd = runner(str(config), "--backend", "mpi", "--set", "steps=10", "algorithms=ssgd",
                 "--out", str(tmp_path / "n"))  # fmt: skip
    code, out, rcs, seconds = launch([(2, cmd, None)], tmp_path)
    assert code != 0 and all(rc != 0 for rc in rcs if rc is not None), (rcs, out[-3000:])
    assert out.count("RuntimeError: rank 1 cannot read its data") == 1, out[-3000:]
    assert seconds < LIMIT


def test_as_many_servers_as_ranks_is_refused_by_name(tmp_path):
    cmd = runner(str(QUICKSTART), "--backend", "mpi", "--servers", "2", "--set", "steps=10",
                 "algorithms=bfb_allreduce", "--out", str(tmp_path / "n"))  # fmt: skip
    result = launch([(2, cmd, None)], tmp_path)
    assert_refused(result, "num_servers", "2 ranks")
