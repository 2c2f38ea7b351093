"""`shoal-run` with asynchronous entries (`async_diloco`, `quorum_diloco`): the quorum of
all workers at equal speeds is synchronous DiLoCo (the same test metrics at every
evaluation), a run is the same bit for bit twice, slow workers make stale arrivals, and
what cannot run is refused by name."""

import json
import types

import numpy as np
import pytest
from harness import QUICKSTART, UNDER_MPI

from shoal.experiments.config import Config, ConfigError
from shoal.experiments.runner import async_run
from shoal.experiments.runner.cli import main

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="simulated workers, one process")

BASE = ["--workers", "4", "--no-progress", "--set", "steps=40", "eval_every=10",
        "project_workers=0", "project_cluster=wan-1gbps", "compute_ms=20", "nonfinite=off",
        "diloco.sync_every=10", "quorum_diloco.sync_every=10",
        "async_diloco.sync_every=10"]  # fmt: skip


def run(out, *sets):
    assert main([str(QUICKSTART), *BASE, *sets, "--out", str(out)]) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def evaluations(records, algorithm):
    return [(r["step"], r["test_loss"], r["test_accuracy"])
            for r in records if r["algorithm"] == algorithm and "test_loss" in r]  # fmt: skip


def test_the_quorum_of_all_workers_is_synchronous_diloco(tmp_path):
    records = run(tmp_path / "q", "algorithms=diloco,quorum_diloco[quorum=4]", "speeds=1")
    sync, quorum = evaluations(records, "diloco"), evaluations(records, "quorum_diloco[quorum=4]")
    assert [s for s, *_ in sync] == [s for s, *_ in quorum] == [10, 20, 30, 40]
    np.testing.assert_allclose([q[1:] for q in quorum], [s[1:] for s in sync], rtol=2e-5)
    steps = [r["step"] for r in records if r["algorithm"] == "quorum_diloco[quorum=4]"]
    assert steps == list(range(1, 41))
    times = [r["sim_time_s"] for r in records if r["algorithm"] == "quorum_diloco[quorum=4]"]
    assert times[9] == times[0] > 0  # a round's steps are applied together, at its end
    assert all(a <= b for a, b in zip(times, times[1:]))


def test_async_runs_are_the_same_bit_for_bit_and_slow_workers_arrive_stale(tmp_path):
    sets = ["algorithms=async_diloco,async_diloco[dynamic_steps=false]",
            "speeds=3@0*lognormal:0.3"]  # fmt: skip
    a = run(tmp_path / "a", *sets)
    b = run(tmp_path / "b", *sets)
    assert (tmp_path / "a" / "metrics.jsonl").read_bytes() == (
        tmp_path / "b" / "metrics.jsonl"
    ).read_bytes()
    assert len(a) == len(b) == 80
    text = (tmp_path / "a" / "summary.md").read_text()
    assert "## Simulated time" in text
    section = text.split("## Simulated time")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| async")]
    assert len(rows) == 2


def test_dylu_gives_a_slow_worker_fewer_steps_per_round(tmp_path):
    cfg = Config(workers=4, steps=40, speeds="3@0", compute_ms=20.0, project_workers=0,
                 project_cluster="wan-1gbps",
                 eval_every=10, algorithms=("async_diloco",))  # fmt: skip
    from shoal.experiments import algorithms
    from shoal.experiments.runner.backends import SimBackend
    from shoal.experiments.runner.train import train
    from shoal.experiments.tasks import make_task

    result = train(cfg, make_task(cfg), SimBackend(4), algorithms.resolve("async_diloco", cfg))
    assert result.summary["outer_steps"] > 4 and result.summary["staleness"] > 0
    assert result.records[-1]["step"] == 40 and "test_loss" in result.records[-1]


def test_what_cannot_run_is_refused_by_name(tmp_path, capsys):
    out = tmp_path / "x"
    args = [str(QUICKSTART), *BASE, "algorithms=async_diloco", "checkpoint_every=10"]
    assert main([*args, "--out", str(out)]) == 2
    assert "async_diloco has no checkpoints" in capsys.readouterr().err
    entry = types.SimpleNamespace(label="quorum_diloco")
    with pytest.raises(ConfigError, match=r"simulated workers only \(--backend sim\), not "
                       r"--backend mpi"):  # fmt: skip
        async_run.check(Config(), types.SimpleNamespace(name="mpi"), entry, None, False)
    args = [str(QUICKSTART), *BASE, "algorithms=quorum_diloco[quorum=5]"]
    assert main([*args, "--out", str(tmp_path / "y")]) == 2
    assert "'quorum' must be at most workers = 4, got 5" in capsys.readouterr().err


def test_the_heterogeneous_study_config_resolves():
    from shoal.experiments import algorithms
    from shoal.experiments.runner.arguments import load_argument

    cfg = load_argument("heterogeneous")
    entries = algorithms.resolve_all(cfg)
    assert [e.algorithm.asynchronous is not None for e in entries] == [False] * 3 + [True] * 4
    assert cfg.speeds and cfg.compute_ms and cfg.nonfinite == "off"
