"""Progress on stderr: a tqdm bar on a terminal, plain lines (no carriage return) when
stderr is a file, nothing with ``--no-progress``."""

from __future__ import annotations

import doctest
import io
import os
import re
import subprocess
import sys

import harness
import pytest
from harness import QUICKSTART

from shoal.experiments.runner import progress
from shoal.experiments.runner.progress import PlainProgress, due, progress_bar, shows_bar

SETS = ["algorithms=ssgd", "steps=20", "eval_every=10", "project_workers=0",
        "train_size=256", "test_size=128", "batch_size=16"]  # fmt: skip


def test_docstring_examples_run():
    result = doctest.testmod(progress, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted >= 2


def test_due_steps():
    # About every tenth of the run, on multiples of 10 steps, and the last step.
    assert [s for s in range(1, 201) if due(s, 200)] == list(range(20, 201, 20))
    assert [s for s in range(1, 1001) if due(s, 1000)] == list(range(100, 1001, 100))
    assert [s for s in range(1, 26) if due(s, 25)] == [10, 20, 25]
    assert [s for s in range(1, 8) if due(s, 7)] == [7]
    assert [s for s in range(1, 151) if due(s, 150)] == [*range(20, 141, 20), 150]


def test_plain_lines(monkeypatch):
    clock = iter([100.0, 101.5, 103.0, 104.3])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    bar = PlainProgress(total=25, initial=0, desc="gtc", file=out)
    for step in range(1, 26):
        bar.update(1)
        if step % 10 == 0 or step == 25:
            bar.set_postfix({"loss": f"{1 / step:.4f}", "MB sent": f"{step / 100:.2f}"})
    bar.close()  # nothing more: step 25 has its line
    assert out.getvalue().splitlines() == [
        "gtc: step 10/25, loss=0.1000, MB sent=0.10, 1.5 s",
        "gtc: step 20/25, loss=0.0500, MB sent=0.20, 3.0 s",
        "gtc: step 25/25, loss=0.0400, MB sent=0.25, 4.3 s",
    ]


def test_stopped_early_writes_its_step_without_a_stale_loss():
    out = io.StringIO()
    bar = PlainProgress(total=200, initial=4, desc="ssgd", file=out)  # resumed at step 5
    for step in range(5, 14):
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix({"loss": "0.5000"})
    bar.close()  # --stop-after stopped it at step 13
    (line,) = out.getvalue().splitlines()
    assert re.fullmatch(r"ssgd: step 13/200, \d+\.\d s", line), line


def test_the_bar_only_on_a_terminal(monkeypatch):
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as tty, os.fdopen(leader, "rb"):
        assert shows_bar(tty)
        monkeypatch.setattr(sys, "stderr", tty)
        bar = progress_bar(10, 0, "ssgd", True)
        assert not isinstance(bar, PlainProgress) and not bar.disable
        bar.close()
        assert progress_bar(10, 0, "ssgd", False).disable  # --no-progress
    file = io.StringIO()
    assert not shows_bar(file)
    monkeypatch.setattr(sys, "stderr", file)
    assert isinstance(progress_bar(10, 0, "ssgd", True), PlainProgress)
    hidden = progress_bar(10, 0, "ssgd", False)
    assert not isinstance(hidden, PlainProgress) and hidden.disable
    hidden.update(1)
    hidden.close()
    assert file.getvalue() == ""


@pytest.mark.skipif(harness.UNDER_MPI, reason="the runner starts its own workers")
def test_runner_to_a_file_writes_lines(tmp_path):
    log = tmp_path / "stderr.txt"
    argv = [sys.executable, "-m", "shoal.experiments.runner.cli", str(QUICKSTART),
            "--workers", "2", "--out", str(tmp_path / "run"), "--set", *SETS]  # fmt: skip
    with open(log, "w") as err:
        proc = subprocess.run(argv, stderr=err, stdout=subprocess.PIPE, text=True, timeout=300)
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "\r" not in text
    lines = [line for line in text.splitlines() if line.startswith("ssgd: ")]
    assert len(lines) == 2, text
    records = harness.read_jsonl(tmp_path / "run" / "metrics.jsonl")
    for line, r in zip(lines, (records[9], records[19])):
        want = f"ssgd: step {r['step']}/20, loss={r['loss']:.4f}, MB sent={r['mb_sent']:.2f}, "
        assert line.startswith(want) and re.fullmatch(r"\d+\.\d s", line[len(want) :]), line
