"""The experiment runner: S-SGD against a single-worker oracle, sim against MPI, the
run outputs, and config errors."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Literal

import harness
import jax
import numpy as np
import optax
import pytest

from shoal.comms import tree_nbytes
from shoal.experiments import algorithms
from shoal.experiments.backends import SimBackend
from shoal.experiments.cli import main, resolve_workers
from shoal.experiments.config import (
    Config,
    ConfigError,
    apply_overrides,
    load_config,
    parse_value,
)
from shoal.experiments.report import PLOTS
from shoal.experiments.tasks import GaussianMixtureTask
from shoal.experiments.train import train

# Each test launches its own workers (and one its own MPI job): no point in every rank
# of an outer mpiexec repeating them.
pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="the runner tests start their own MPI")

QUICKSTART = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "quickstart.py"
WORKERS = 4
STEPS = 12
ALGORITHMS = ("ssgd", "gtc")
SMALL = ["--workers", str(WORKERS), "--set", f"steps={STEPS}", "eval_every=5",
         "algorithms=" + ",".join(ALGORITHMS), "--no-progress"]  # fmt: skip


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def mpiexec() -> str | None:
    venv = Path(sys.executable).parent / "mpiexec"
    return str(venv) if venv.exists() else shutil.which("mpiexec")


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sim")
    assert main([str(QUICKSTART), *SMALL, "--out", str(out)]) == 0
    return out


def test_ssgd_equals_one_worker_on_the_concatenated_batch():
    steps = 5
    cfg = apply_overrides(load_config(QUICKSTART), [f"workers={WORKERS}", f"steps={steps}"])
    task = GaussianMixtureTask(cfg)
    result = train(cfg, task, SimBackend(WORKERS), "ssgd", progress=False)

    # Oracle: plain optax in one process on the global batch.
    params = task.init_params()
    init = params
    opt = optax.sgd(cfg.learning_rate, momentum=cfg.momentum)
    state = opt.init(params)
    grad_fn = jax.jit(jax.value_and_grad(task.loss))
    losses = []
    for step in range(steps):
        x, y = task.batch(step, WORKERS)
        loss, g = grad_fn(params, x.reshape(-1, x.shape[-1]), y.reshape(-1))
        losses.append(float(loss))
        updates, state = opt.update(g, state, params)
        params = optax.apply_updates(params, updates)

    moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), params, init))
    assert max(moved) > 1e-3  # the comparison below is not between two initial states
    for r in range(WORKERS):
        jax.tree.map(
            lambda a, b, r=r: np.testing.assert_allclose(a[r], b, rtol=1e-5, atol=1e-6),
            result.params,
            params,
        )
    recs = result.records
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    np.testing.assert_allclose([r["loss"] for r in recs], losses, rtol=1e-5)
    # A ring all-reduce of the gradient per step: 2 (P-1)/P of its bytes, each way.
    per_step = 2 * (WORKERS - 1) * tree_nbytes(init) // WORKERS
    assert all(r["bytes_sent"] == r["bytes_received"] == per_step for r in recs)
    assert recs[-1]["mb_sent"] == pytest.approx(steps * per_step / 1e6, rel=1e-12)
    assert result.summary["mb_sent"] == recs[-1]["mb_sent"]


def test_mpi_backend_matches_sim(sim_run, tmp_path):
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    cmd = [exe, "-n", str(WORKERS), sys.executable, "-m", "shoal.experiments.cli",
           str(QUICKSTART), "--backend", "mpi", *SMALL, "--out", str(tmp_path)]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    sim, mpi = read_jsonl(sim_run / "metrics.jsonl"), read_jsonl(tmp_path / "metrics.jsonl")
    assert len(mpi) == len(sim) == STEPS * len(ALGORITHMS)
    np.testing.assert_allclose([r["loss"] for r in mpi], [r["loss"] for r in sim], rtol=1e-5)
    for key in ("test_loss", "test_accuracy"):
        s = [r[key] for r in sim if key in r]
        m = [r[key] for r in mpi if key in r]
        assert len(s) == len(m) == 3 * len(ALGORITHMS)  # steps 5, 10 and the last
        np.testing.assert_allclose(m, s, rtol=1e-5, err_msg=key)
    for key in ("algorithm", "step", "bytes_sent", "bytes_received", "mb_sent", "mb_received"):
        assert [r[key] for r in mpi] == [r[key] for r in sim], key
    np.testing.assert_allclose(
        [r["density"] for r in mpi if "density" in r], [r["density"] for r in sim if "density" in r]
    )
    assert "backend `mpi`" in (tmp_path / "summary.md").read_text()


def test_outputs_are_consistent(sim_run):
    all_recs = read_jsonl(sim_run / "metrics.jsonl")
    assert [r["algorithm"] for r in all_recs] == [a for a in ALGORITHMS for _ in range(STEPS)]
    # GTC reports how full its fixed-capacity buffer was; S-SGD has no such number.
    assert all(0 < r["density"] <= 0.08 for r in all_recs if r["algorithm"] == "gtc")
    assert not any("density" in r for r in all_recs if r["algorithm"] == "ssgd")
    recs = [r for r in all_recs if r["algorithm"] == "ssgd"]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert [r["step"] for r in recs if "test_loss" in r] == [5, 10, STEPS]
    assert all(0 <= r["test_accuracy"] <= 1 for r in recs if "test_accuracy" in r)
    assert np.all(np.diff([r["mb_sent"] for r in recs]) > 0)

    with open(sim_run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == STEPS * len(ALGORITHMS)
    rows = rows[:STEPS]
    assert [float(r["loss"]) for r in rows] == [r["loss"] for r in recs]
    assert [r["test_loss"] for r in rows][:4] == ["", "", "", ""]
    assert float(rows[4]["test_loss"]) == recs[4]["test_loss"]

    for name in PLOTS:
        assert (sim_run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    summary = (sim_run / "summary.md").read_text()
    last = recs[-1]
    assert "| algorithm | steps | train loss | test loss | test acc | MB sent/worker" in summary
    assert f"| ssgd | {STEPS} | {last['loss']:.4f} | {last['test_loss']:.4f} | " in summary
    assert f"| {last['mb_sent']:.3f} |" in summary
    assert "| `workers` | `4` |" in summary and "| `algorithms` | `ssgd,gtc` |" in summary


def test_several_algorithms_share_data_and_init(tmp_path, monkeypatch, capsys):
    # A registered algorithm is selectable from the command line.
    def slow(cfg, collective):
        return algorithms.ssgd(dataclasses.replace(cfg, learning_rate=cfg.learning_rate / 10),
                               collective)  # fmt: skip

    monkeypatch.setitem(algorithms.ALGORITHMS, "ssgd_slow", slow)
    argv = [str(QUICKSTART), "--workers", "2", "--set", "steps=3", "algorithms=ssgd,ssgd_slow",
            "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["algorithm"], r["step"]) for r in recs] == [
        (a, s) for a in ("ssgd", "ssgd_slow") for s in (1, 2, 3)
    ]
    # Same initial parameters and first batch: the same first loss; then they part.
    assert recs[0]["loss"] == recs[3]["loss"]
    assert recs[1]["loss"] != recs[4]["loss"]
    summary = (tmp_path / "summary.md").read_text()
    assert "| ssgd | 3 |" in summary and "| ssgd_slow | 3 |" in summary
    assert "| ssgd_slow | 3 |" in capsys.readouterr().out


def test_override_types():
    cfg = apply_overrides(
        Config(),
        ["algorithms=ssgd, x", "learning_rate=0.5", "steps=7", "hidden=8,4", "name=run2"],
    )
    assert cfg.algorithms == ("ssgd", "x") and cfg.hidden == (8, 4)
    assert cfg.learning_rate == 0.5 and cfg.steps == 7 and cfg.name == "run2"
    assert parse_value("off", bool) is False
    assert parse_value("none", float | None) is None and parse_value("2", int | None) == 2
    assert parse_value("b", Literal["a", "b"]) == "b"
    assert parse_value("1,x", tuple[int, str]) == (1, "x")


def test_override_errors(capsys):
    with pytest.raises(ConfigError, match="unknown config key 'learning_rat'.*learning_rate"):
        apply_overrides(Config(), ["learning_rat=0.1"])
    with pytest.raises(ConfigError, match="bad value for steps: 'ten' is not an int"):
        apply_overrides(Config(), ["steps=ten"])
    with pytest.raises(ConfigError, match="momentum"):
        apply_overrides(Config(), ["momentum=1.5"])
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides(Config(), ["steps"])
    with pytest.raises(ConfigError, match="world size 4"):
        resolve_workers("mpi", 8, 2, 4)
    assert resolve_workers("mpi", 8, None, 4) == 4
    assert resolve_workers("sim", 8, 2, 1) == 2

    assert main([str(QUICKSTART), "--set", "lr=0.1"]) == 2
    assert "unknown config key 'lr'" in capsys.readouterr().err
    assert main([str(QUICKSTART), "--set", "algorithms=ssgd,nope"]) == 2
    assert "unknown algorithm(s) 'nope'" in capsys.readouterr().err
    assert main([str(QUICKSTART), "--workers", "1000"]) == 2
    assert "batch_size" in capsys.readouterr().err
    # An entry's bracketed overrides are checked before any training.
    assert main([str(QUICKSTART), "--set", "algorithms=gtc[gtc_threshold=-1]"]) == 2
    assert "gtc_threshold" in capsys.readouterr().err
    assert main([str(QUICKSTART), "--set", "algorithms=gtc[gtc_threshold=0.1"]) == 2
    assert "expected name[key=value;...]" in capsys.readouterr().err


def test_entry_overrides_reach_the_builder():
    cfg = Config()
    assert algorithms.parse_entry("gtc[gtc_threshold=0.2;gtc_capacity=0.5]") == (
        "gtc",
        ["gtc_threshold=0.2", "gtc_capacity=0.5"],
    )
    sub = algorithms.entry_config("gtc[gtc_threshold=0.2;gtc_capacity=0.5]", cfg)
    assert (sub.gtc_threshold, sub.gtc_capacity) == (0.2, 0.5)
    assert algorithms.entry_config("gtc", cfg) == cfg
