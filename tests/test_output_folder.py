"""The output folder: claimed before training (created, checked writable, locked naming its
holder), metrics appended as the run goes, strict JSON, and one line when a write fails
(a file size limit stands in for a full disk: Python ignores SIGXFSZ, so a write past
``RLIMIT_FSIZE`` fails with EFBIG as one past a full disk fails with ENOSPC)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import harness
import pytest

from shoal.experiments.reports.files import json_line
from shoal.experiments.runner.checkpoint_files import COMMITTED
from shoal.experiments.runner.cli import main
from shoal.experiments.runner.output import LOCK, OutputLock, output_problem

QUICKSTART = str(harness.QUICKSTART)
PREFIX = "shoal-run: error:"
SMALL = ["--workers", "2", "--no-progress", "--set", "algorithms=ssgd", "project_workers=0",
         "eval_every=10"]  # fmt: skip


def strict(text: str) -> list[dict]:
    """Each line parsed as strict JSON (``NaN``/``Infinity`` refused, as jq does)."""

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


def errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(PREFIX)]


def test_a_folder_in_use_is_refused_naming_its_holder(tmp_path, capsys):
    out = tmp_path / "run"
    held = OutputLock(out)
    assert held.acquire() is None
    try:
        assert main([QUICKSTART, *SMALL, "--set", "steps=5", "--out", str(out)]) == 2
    finally:
        held.release()
    (line,) = errors(capsys.readouterr().err)
    assert "in use by another shoal-run" in line and f"pid {os.getpid()}" in line
    assert not out.exists()  # the holder made it and released it empty


def test_a_stale_lock_is_taken_over_and_released_at_exit(tmp_path, capsys):
    # A lock file nobody holds (its holder died): the kernel dropped the lock with it.
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK).write_text("host elsewhere, pid 1, since long ago\n")
    assert output_problem(out, resume=False, overwrite=False) is None  # not a result
    assert main([QUICKSTART, *SMALL, "--set", "steps=3", "--out", str(out)]) == 0
    assert not (out / LOCK).exists()
    assert (out / "metrics.jsonl").is_file()


def test_an_output_folder_under_a_file_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "sub"
    assert main([QUICKSTART, *SMALL, "--set", "steps=5", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    (line,) = errors(captured.err)
    assert f"cannot write to output folder {out}" in line and "Not a directory" in line
    assert "ssgd" not in captured.out.split("\n", 1)[1]  # nothing trained


def test_metrics_are_appended_as_the_run_goes(tmp_path, capsys):
    # Stopped after 7 of 20 steps: metrics.jsonl already holds those 7.
    out = tmp_path / "run"
    assert main([QUICKSTART, *SMALL, "--set", "steps=20", "--out", str(out),
                 "--stop-after", "7"]) == 0  # fmt: skip
    assert [r["step"] for r in strict((out / "metrics.jsonl").read_text())] == list(range(1, 8))
    # Resumed: the file is rewritten from the checkpoint's records, then appended, and
    # ends as the finished run's file.
    assert main([QUICKSTART, *SMALL, "--set", "steps=20", "--out", str(out), "--resume"]) == 0
    assert [r["step"] for r in strict((out / "metrics.jsonl").read_text())] == list(range(1, 21))


def test_metrics_are_strict_json(tmp_path, capsys):
    # No non-finite check and a NaN injected at step 2: the loss is NaN from step 3 on.
    out = tmp_path / "run"
    sets = ["--set", "steps=4", "nonfinite=off", "inject_nonfinite=2:0"]
    assert main([QUICKSTART, *SMALL, *sets, "--out", str(out)]) == 0
    records = strict((out / "metrics.jsonl").read_text())
    assert records[3]["loss"] is None and records[3]["test_loss"] is None
    assert (
        json_line({"a": float("inf"), "b": [float("-inf"), 1.5]})
        == '{"a": null, "b": [null, 1.5]}\n'
    )


# Sets the file size limit, then becomes the command (no fork of the multithreaded test
# process with a preexec_fn).
LIMITED = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); os.execv(sys.argv[2], sys.argv[2:])"
)


def run_with_file_limit(args: list[str], limit_bytes: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "shoal.experiments.runner.cli", QUICKSTART, *SMALL, *args]
    # Without the suite's compilation cache, whose writes would fail (and warn) too.
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, "-c", LIMITED, str(limit_bytes), *cmd],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip


def test_a_full_disk_during_the_run_says_so_in_one_line_and_keeps_the_metrics(tmp_path):
    out = tmp_path / "run"
    proc = run_with_file_limit(["--set", "steps=40", "--out", str(out)], 2048)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"{PREFIX} cannot write to output folder {out}: File too large (the file size "
        "limit, ulimit -f)"
    ]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    kept = strict("\n".join(lines[:-1]))  # the last line was cut at the limit
    assert [r["step"] for r in kept] == list(range(1, len(kept) + 1)) and len(kept) >= 10


def test_a_full_disk_during_a_checkpoint_says_so_in_one_line(tmp_path):
    out = tmp_path / "run"
    proc = run_with_file_limit(["--set", "steps=20", "checkpoint_every=10", "--out", str(out)],
                               8_000)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.splitlines()  # orbax's threads logged 32 tracebacks before
    assert line.startswith(f"{PREFIX} cannot write checkpoint {out}/checkpoints/ssgd/")
    assert line.endswith("File too large")


def test_a_stray_uncommitted_step_does_not_push_out_a_good_checkpoint(tmp_path, capsys):
    # A crash between orbax's rename and the commit marker left step 999 without marker.
    out = tmp_path / "run"
    args = [QUICKSTART, *SMALL, "--set", "steps=40", "checkpoint_every=10", "--out", str(out)]
    assert main([*args, "--stop-after", "20"]) == 0
    rank = out / "checkpoints" / "ssgd" / "rank_0"
    shutil.copytree(rank / "step_20", rank / "step_999")
    (rank / "step_999" / COMMITTED).unlink()
    assert main([*args, "--resume"]) == 0
    kept = sorted(p.parent.name for p in rank.glob(f"step_*/{COMMITTED}"))
    assert kept == ["step_30", "step_40"]
    assert not (rank / "step_999").exists()


def test_an_unreadable_newest_checkpoint_does_not_hide_a_changed_field(tmp_path, capsys):
    out = tmp_path / "run"
    args = [QUICKSTART, *SMALL, "--set", "steps=40", "checkpoint_every=10", "--out", str(out)]
    assert main([*args, "--stop-after", "25"]) == 0
    meta = out / "checkpoints" / "ssgd" / "rank_0" / "step_25" / "meta" / "meta.json"
    os.truncate(meta, 100)
    capsys.readouterr()
    assert main([*args, "--set", "ssgd.local.learning_rate=0.1", "--resume"]) == 2
    (line,) = errors(capsys.readouterr().err)
    assert "'ssgd.local.learning_rate' is 0.1 now but 0.05" in line and "step_20" in line


def test_a_label_too_long_for_a_file_name_is_refused_before_training(tmp_path, capsys):
    threshold = "0." + "0" * 300 + "1"
    sets = ["--set", "steps=5", f"algorithms=ssgd,gtc[threshold={threshold}]"]
    assert main([QUICKSTART, *SMALL, *sets, "--out", str(tmp_path / "run")]) == 2
    captured = capsys.readouterr()
    (line,) = errors(captured.err)
    assert "gtc[threshold=0.0000" in line and "more than a file name holds (255)" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf"])
def test_server_timeout_must_be_positive_seconds(value, capsys):
    assert main([QUICKSTART, "--server-timeout", value]) == 2
    (line,) = errors(capsys.readouterr().err)
    assert f"--server-timeout must be a number of seconds > 0, got {float(value)}" in line


def test_output_lock_names_its_holder(tmp_path):
    out = tmp_path / "deep" / "run"
    first = OutputLock(out)
    assert first.acquire() is None
    text = (out / LOCK).read_text()
    assert f"pid {os.getpid()}" in text and "host " in text
    second = OutputLock(out)
    assert text.strip() in second.acquire()
    first.release()
    assert not (tmp_path / "deep").exists()  # made by the lock, removed empty
    assert second.acquire() is None
    second.release()


def test_a_relative_output_folder_checkpoints_and_resumes(tmp_path, monkeypatch, capsys):
    # orbax's writer refuses relative paths: `--out out/run` failed at the first save.
    monkeypatch.chdir(tmp_path)
    args = [QUICKSTART, *SMALL, "--set", "steps=20", "checkpoint_every=10", "--out", "out/run"]
    assert main([*args, "--stop-after", "15"]) == 0
    assert main([*args, "--resume"]) == 0
    assert len(strict((tmp_path / "out/run/metrics.jsonl").read_text())) == 20
