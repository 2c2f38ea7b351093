"""The experiment runner: S-SGD against a single-worker oracle, BMUF and BMUF_GTC wire
bytes against hand counts, sim (one and two vmap tiers) against MPI, the run outputs,
and config errors."""

from __future__ import annotations

import csv
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import harness
import jax
import numpy as np
import optax
import pytest
from harness import QUICKSTART, assert_same_run, mpiexec, mpiexec_per_rank, read_jsonl

from shoal.comms import tree_nbytes
from shoal.comms.wire import all_reduce_bytes
from shoal.experiments import algorithms
from shoal.experiments.algorithms import ssgd as ssgd_module
from shoal.experiments.config import Config, ConfigError
from shoal.experiments.overrides import apply_overrides, load_config, parse_value
from shoal.experiments.reports import PLOTS
from shoal.experiments.runner.arguments import resolve_workers
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.cli import main
from shoal.experiments.runner.train import train
from shoal.experiments.tasks import GaussianMixtureTask
from shoal.optim import BMUFState
from shoal.optim.readouts import evaluation_params

# Each test launches its own workers (and one its own MPI job): no point in every rank
# of an outer mpiexec repeating them.
pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="the runner tests start their own MPI")

WORKERS = 4
STEPS = 12
BLOCK = 4
GROUP = 2  # two groups of two workers
FLAG = all_reduce_bytes(4, WORKERS)[0]  # the non-finite flag's all-reduce, every step
ALGORITHMS = (
    "ssgd",
    "gtc",
    "bmuf",
    "bmuf_gtc",
    "onebit_lamb",
    "bfb_allreduce",
    "partial_exchange",
    "peer_averaging",
    "adaptive",
)
SETS = [
    f"steps={STEPS}",
    "eval_every=5",
    "algorithms=" + ",".join(ALGORITHMS),
    f"bmuf.block_size={BLOCK}",
    f"bmuf_gtc.block_size={BLOCK}",
    f"bmuf_gtc.group_size={GROUP}",
    "adaptive.every=4",
    "adaptive.threshold=0",
    "adaptive.after=0",
    "project_workers=0",
]  # fmt: skip  (tests/test_projection.py covers the projection)
SMALL = ["--workers", str(WORKERS), "--set", *SETS, "--no-progress"]


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
    local = cfg.params["ssgd"].local
    opt = optax.sgd(local.learning_rate, momentum=local.momentum)
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
    # A ring all-reduce of the gradient per step: 2 (P-1)/P of its bytes, each way; and
    # the non-finite flag's (one int32).
    per_step = 2 * (WORKERS - 1) * tree_nbytes(init) // WORKERS + FLAG
    assert all(r["bytes_sent"] == r["bytes_received"] == per_step for r in recs)
    assert recs[-1]["mb_sent"] == pytest.approx(steps * per_step / 1e6, rel=1e-12)
    assert result.summary["mb_sent"] == recs[-1]["mb_sent"]


def test_mpi_backend_matches_sim(sim_run, tmp_path):
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    cmd = [exe, "-n", str(WORKERS), sys.executable, "-m", "shoal.experiments.runner.cli",
           str(QUICKSTART), "--backend", "mpi", *SMALL, "--out", str(tmp_path)]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    sim, mpi = read_jsonl(sim_run / "metrics.jsonl"), read_jsonl(tmp_path / "metrics.jsonl")
    assert len(mpi) == len(sim) == STEPS * len(ALGORITHMS)
    assert_same_run(mpi, sim, len(ALGORITHMS))
    assert "backend `mpi`" in (tmp_path / "summary.md").read_text()


def test_dedicated_parameter_servers(sim_run, tmp_path):
    """mpiexec -n 6 with --servers 2: 4 workers train bfb_allreduce through 2 server ranks; same
    losses as the simulated (colocated) run, each worker sends and receives its gradient
    once per step, each server one shard of it from and to every worker."""
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    servers = 2
    args = [sys.executable, "-m", "shoal.experiments.runner.cli", str(QUICKSTART),
            "--backend", "mpi", "--servers", str(servers), "--no-progress", "--set", *SETS[:2],
            "algorithms=ssgd,bfb_allreduce", "project_workers=0",
            "--out", str(tmp_path / "run")]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc, stdout = mpiexec_per_rank(WORKERS + servers, args, tmp_path / "stdout", timeout=300,
                                    env=env)  # fmt: skip
    said = "".join(stdout)
    assert proc.returncode == 0, said[-2000:] + proc.stderr[-4000:]
    sim = [
        r
        for r in read_jsonl(sim_run / "metrics.jsonl")
        if r["algorithm"] in ("ssgd", "bfb_allreduce")
    ]
    mpi = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [(r["algorithm"], r["step"]) for r in mpi] == [(r["algorithm"], r["step"]) for r in sim]
    np.testing.assert_allclose([r["loss"] for r in mpi], [r["loss"] for r in sim], rtol=1e-5)
    cfg = load_config(QUICKSTART)
    nbytes = tree_nbytes(GaussianMixtureTask(cfg).init_params())
    # One float32 buffer (automatic size), split into 2 shards.
    shard = -(-nbytes // 4 // servers) * 4
    flag = all_reduce_bytes(4, WORKERS)[0]  # among the workers only
    assert all(r["bytes_sent"] == r["bytes_received"] == servers * shard + flag
               for r in mpi if r["algorithm"] == "bfb_allreduce")  # fmt: skip
    per_server = STEPS * WORKERS * shard / 1e6
    for s in range(servers):
        line = f"parameter server {s}: {STEPS} steps, {STEPS} buffers, {per_server:.3f} MB received"
        assert line in said, said[-2000:]


def test_servers_end_when_the_config_is_wrong():
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    cmd = [exe, "-n", "3", sys.executable, "-m", "shoal.experiments.runner.cli", str(QUICKSTART),
           "--backend", "mpi", "--servers", "1", "--set", "no_such_key=1"]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no_such_key" in proc.stderr
    assert "parameter server 0: 0 steps" in proc.stdout


def test_same_config_and_seed_write_identical_metrics(sim_run, tmp_path):
    """Determinism (simulation): a second run of the same config and seed writes the same
    metrics, byte for byte; wall-clock times are kept apart in timing.jsonl. Another seed
    gives other numbers."""
    again = tmp_path / "again"
    assert main([str(QUICKSTART), *SMALL, "--out", str(again)]) == 0
    for name in ("metrics.jsonl", "metrics.csv"):
        assert (again / name).read_bytes() == (sim_run / name).read_bytes(), name
    timing = read_jsonl(sim_run / "timing.jsonl")
    metrics = read_jsonl(sim_run / "metrics.jsonl")
    assert [(t["algorithm"], t["step"]) for t in timing] == [
        (r["algorithm"], r["step"]) for r in metrics
    ]
    assert all(t["time_s"] > 0 for t in timing) and not any("time_s" in r for r in metrics)
    other = tmp_path / "other"
    args = ["--workers", str(WORKERS), "--set", *SETS, "algorithms=ssgd", "seed=1"]
    assert main([str(QUICKSTART), *args, "--no-progress", "--out", str(other)]) == 0
    ssgd = [r["loss"] for r in metrics if r["algorithm"] == "ssgd"]
    assert [r["loss"] for r in read_jsonl(other / "metrics.jsonl")] != ssgd


def test_injected_nan_is_skipped(tmp_path):
    """inject_nonfinite=5:2 puts a NaN into worker 2's gradient at step 5: every worker
    skips the whole update (only the flag is sent), later steps count it, and summary.md
    shows the skipped step."""
    args = ["--workers", str(WORKERS), "--no-progress", "--set", *SETS, "algorithms=ssgd,bmuf",
            "inject_nonfinite=5:2", "--out", str(tmp_path)]  # fmt: skip
    assert main([str(QUICKSTART), *args]) == 0
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    for name in ("ssgd", "bmuf"):
        run = [r for r in recs if r["algorithm"] == name]
        assert [r.get("skipped", 0) for r in run] == [0] * 4 + [1] * (STEPS - 4)
        assert run[4]["bytes_sent"] == FLAG
        assert all(np.isfinite(r["loss"]) for r in run)
        assert np.isfinite(run[-1]["test_loss"])
    # BMUF's blocks shift by the skipped step: its all-reduces come at steps 4, 9, ...
    bmuf = [r["bytes_sent"] > FLAG for r in recs if r["algorithm"] == "bmuf"]
    assert [i + 1 for i, sync in enumerate(bmuf) if sync] == [4, 9]
    assert "| skipped steps |" in (tmp_path / "summary.md").read_text()


def test_outputs_are_consistent(sim_run):
    all_recs = read_jsonl(sim_run / "metrics.jsonl")
    assert [r["algorithm"] for r in all_recs] == [a for a in ALGORITHMS for _ in range(STEPS)]
    # GTC reports how full its fixed-capacity buffer was; S-SGD has no such number.
    assert all(0 < r["density"] <= 0.08 for r in all_recs if "gtc" in r["algorithm"])
    assert not any(
        "density" in r
        for r in all_recs
        if r["algorithm"]
        in ("ssgd", "bmuf", "onebit_lamb", "bfb_allreduce", "partial_exchange", "peer_averaging")
    )
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
    assert (
        "| algorithm | steps | train loss | test loss | test acc | test error | MB sent/worker"
        in summary
    )
    assert f"| ssgd | {STEPS} | {last['loss']:.4f} | {last['test_loss']:.4f} | " in summary
    assert f"| {last['test_accuracy']:.2%} | {1 - last['test_accuracy']:.2%} |" in summary
    assert f"| {last['mb_sent']:.3f} |" in summary
    assert "| `workers` | `4` |" in summary
    assert f"| `algorithms` | `{','.join(ALGORITHMS)}` |" in summary
    # BFB (colocated) moves each buffer like a ring all-reduce: here one buffer holds the
    # whole (small) gradient, padded to a multiple of 4 shards.
    bfb = [r for r in all_recs if r["algorithm"] == "bfb_allreduce"]
    elements = tree_nbytes(GaussianMixtureTask(load_config(QUICKSTART)).init_params()) // 4
    padded = -(-elements // WORKERS) * WORKERS * 4
    assert all(r["bytes_sent"] == 2 * (WORKERS - 1) * padded // WORKERS + FLAG for r in bfb)
    np.testing.assert_allclose([r["loss"] for r in bfb], [r["loss"] for r in recs], rtol=1e-5)


def test_several_algorithms_share_data_and_init(tmp_path, monkeypatch, capsys):
    # A registered algorithm is selectable from the command line.
    def slow(p, ctx):
        local = dataclasses.replace(p.local, learning_rate=p.local.learning_rate / 10)
        return ssgd_module.build(dataclasses.replace(p, local=local), ctx)

    slow_algorithm = algorithms.Algorithm("ssgd_slow", ssgd_module.SSGD, slow, None)
    monkeypatch.setitem(algorithms.ALGORITHMS, "ssgd_slow", slow_algorithm)
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
    sets = ["algorithms=ssgd, x", "ssgd.local.learning_rate=0.5", "steps=7", "hidden=8,4"]
    cfg = apply_overrides(Config(), [*sets, "name=run2"])
    assert cfg.algorithms == ("ssgd", "x") and cfg.hidden == (8, 4)
    assert cfg.params["ssgd"].local.learning_rate == 0.5
    assert cfg.steps == 7 and cfg.name == "run2"
    assert parse_value("off", bool) is False
    assert parse_value("none", float | None) is None and parse_value("2", int | None) == 2
    assert parse_value("b", Literal["a", "b"]) == "b"
    assert parse_value("1,x", tuple[int, str]) == (1, "x")
    cfg = apply_overrides(
        Config(), ["bmuf.block_momentum=none", "bmuf.nbm=chen_huo", "bmuf.nesterov=false"]
    )
    bmuf = cfg.params["bmuf"]
    assert bmuf.block_momentum is None and bmuf.nbm == "chen_huo" and bmuf.nesterov is False


def test_override_errors(capsys):
    with pytest.raises(
        ConfigError, match="unknown config key 'ssgd.local.learning_rat'.*learning_rate"
    ):
        apply_overrides(Config(), ["ssgd.local.learning_rat=0.1"])
    with pytest.raises(ConfigError, match="bad value for steps: 'ten' is not an int"):
        apply_overrides(Config(), ["steps=ten"])
    with pytest.raises(ConfigError, match="momentum"):
        apply_overrides(Config(), ["ssgd.local.momentum=1.5"])
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides(Config(), ["steps"])
    with pytest.raises(ConfigError, match="world size 4"):
        resolve_workers("mpi", 8, 2, 4)
    assert resolve_workers("mpi", 8, None, 4) == 4
    assert resolve_workers("sim", 8, 2, 1) == 2

    assert main([str(QUICKSTART), "--set", "lr=0.1"]) == 2
    assert "unknown config key 'lr'" in capsys.readouterr().err
    assert main([str(QUICKSTART), "--set", "algorithms=ssgd,nope"]) == 2
    assert "unknown algorithm 'nope'" in capsys.readouterr().err
    assert main([str(QUICKSTART), "--workers", "1000"]) == 2
    assert "batch_size" in capsys.readouterr().err
    # An entry's bracketed overrides are checked before any training.
    assert main([str(QUICKSTART), "--set", "algorithms=gtc[threshold=-1]"]) == 2
    assert "threshold" in capsys.readouterr().err
    assert main([str(QUICKSTART), "--set", "algorithms=gtc[threshold=0.1"]) == 2
    assert "expected name[key=value;...]" in capsys.readouterr().err
    # BMUF: the last step must be a BMUF step; BMUF_GTC: groups must tile the workers.
    assert main([str(QUICKSTART), "--set", "steps=15", "algorithms=bmuf"]) == 2
    assert "multiple of block_size = 10" in capsys.readouterr().err
    assert main([str(QUICKSTART), "--workers", "6", "--set", "algorithms=bmuf_gtc"]) == 2
    assert "group_size = 4 must divide the number of workers 6" in capsys.readouterr().err
    # BMUF_GTC has no warm-up: warmup_steps is bmuf's own.
    assert main([str(QUICKSTART), "--set", "algorithms=bmuf_gtc[warmup_steps=10]"]) == 2
    assert "'warmup_steps' is not a hyper-parameter of bmuf_gtc" in capsys.readouterr().err
    argv = [str(QUICKSTART), "--workers", "1", "--set", "algorithms=bmuf", "bmuf.block_lr=2"]
    assert main(argv) == 2
    assert "pass block_momentum explicitly" in capsys.readouterr().err
    # The transformation checks its hyper-parameters: bmuf's message, at resolve time.
    with pytest.raises(ConfigError, match=r"'bmuf'.*block_momentum must lie in \[0, 1\)"):
        algorithms.resolve("bmuf", apply_overrides(Config(steps=20), ["bmuf.block_momentum=1.0"]))


def test_entry_overrides_reach_the_builder():
    cfg = Config()
    assert algorithms.parse_entry("gtc[threshold=0.2;capacity=0.5]") == (
        "gtc",
        ["threshold=0.2", "capacity=0.5"],
    )
    entry = algorithms.resolve("gtc[threshold=0.2;capacity=0.5]", cfg)
    assert (entry.label, entry.name) == ("gtc[threshold=0.2;capacity=0.5]", "gtc")
    assert (entry.params.threshold, entry.params.capacity) == (0.2, 0.5)
    assert entry.cfg == cfg  # the run's config is the run's; the entry's own are its params
    plain = algorithms.resolve("gtc", cfg)
    assert plain.cfg == cfg and plain.params == algorithms.ALGORITHMS["gtc"].params()
    assert algorithms.resolve(entry, cfg) is entry  # resolved once, passed down as is
    # A policy's changes apply on top of the entry's overrides.
    changed = entry.changed({"capacity": 0.25})[1]
    assert (changed.threshold, changed.capacity) == (0.2, 0.25)


def test_two_tier_sim_layout():
    # Worker w is member w % P of group w // P; host arrays keep the flat [N, ...] layout.
    backend = SimBackend(8)
    intra, inter = backend.two_tier(4)

    def ranks(w):
        return w, intra.rank(), inter.rank(), intra.all_reduce(w, "sum"), inter.all_reduce(w, "sum")

    w, member, group, group_sum, across_sum = backend.spmd(ranks, group_size=4)(np.arange(8.0))
    np.testing.assert_array_equal(w, np.arange(8.0))
    np.testing.assert_array_equal(member, np.arange(8) % 4)
    np.testing.assert_array_equal(group, np.arange(8) // 4)
    np.testing.assert_array_equal(group_sum, np.repeat([0 + 1 + 2 + 3, 4 + 5 + 6 + 7], 4))
    np.testing.assert_array_equal(across_sum, np.tile([0 + 4, 1 + 5, 2 + 6, 3 + 7], 2))


def test_bmuf_wire_bytes(sim_run):
    recs = read_jsonl(sim_run / "metrics.jsonl")
    task = GaussianMixtureTask(load_config(QUICKSTART))
    nbytes = tree_nbytes(task.init_params())
    n_elem = nbytes // 4
    sync = [step % BLOCK == 0 for step in range(1, STEPS + 1)]

    # BMUF: only the non-finite flag inside a block; a ring all-reduce of the params among
    # all 4 workers on block steps.
    ring = 2 * (WORKERS - 1) * nbytes // WORKERS
    bmuf = [r for r in recs if r["algorithm"] == "bmuf"]
    assert [r["bytes_sent"] for r in bmuf] == [FLAG + (ring if s else 0) for s in sync]
    assert [r["bytes_received"] for r in bmuf] == [FLAG + (ring if s else 0) for s in sync]

    # BMUF_GTC: every step GTC's all-gather inside the group of 2 (capacity words plus a
    # header, int32); on sync steps the all-reduce of the params between the 2 groups; the
    # flag summed within the group, then across groups.
    cap = round(load_config(QUICKSTART).params["bmuf_gtc"].capacity * n_elem)
    gtc_bytes = (GROUP - 1) * 4 * (cap + 1)
    groups = WORKERS // GROUP
    across = 2 * (groups - 1) * nbytes // groups
    two = [r for r in recs if r["algorithm"] == "bmuf_gtc"]
    flag = all_reduce_bytes(4, GROUP)[0] + all_reduce_bytes(4, groups)[0]
    expect = [flag + gtc_bytes + (across if s else 0) for s in sync]
    assert [r["bytes_sent"] for r in two] == expect
    assert [r["bytes_received"] for r in two] == expect
    assert two[-1]["mb_sent"] == pytest.approx(sum(expect) / 1e6, rel=1e-12)


def test_bmuf_evaluates_the_global_model():
    # The last step is a BMUF step: every worker holds W_g, and the reported test metrics
    # are those of that model.
    cfg = apply_overrides(load_config(QUICKSTART), [*SETS, f"workers={WORKERS}"])
    task = GaussianMixtureTask(cfg)
    for name in ("bmuf", "bmuf_gtc"):
        result = train(cfg, task, SimBackend(WORKERS), name, progress=False)
        for leaf in jax.tree.leaves(result.params):
            np.testing.assert_allclose(leaf, np.broadcast_to(leaf[0], leaf.shape), atol=1e-6)
        mean = jax.tree.map(lambda a: a.mean(0), result.params)
        loss, acc = task.evaluate(mean)
        assert result.summary["test_loss"] == pytest.approx(loss, rel=1e-5)
        assert result.summary["test_accuracy"] == pytest.approx(acc, abs=1e-6)


def test_evaluation_params_picks_the_global_model():
    state = lambda filtered: BMUFState((), "W_g", None, filtered, 0, 0, None)
    assert evaluation_params("params", (optax.EmptyState(),)) == "params"
    assert evaluation_params("params", (optax.EmptyState(), state(None))) == "W_g"
    assert evaluation_params("params", {"bmuf": state("W")}) == "W"  # nbm="chen_huo"


def test_bmuf_degenerate_cases_through_the_runner():
    # Averaging after every plain SGD step, without block momentum, is S-SGD; one group
    # of all workers with eq. 5's block momentum (1 - 1/1 = 0) is GTC.
    no_momentum = [f"{name}.local.momentum=0" for name in ("ssgd", "bmuf", "gtc", "bmuf_gtc")]
    cfg = apply_overrides(
        load_config(QUICKSTART), ["workers=4", "steps=6", "eval_every=6", *no_momentum]
    )
    task = GaussianMixtureTask(cfg)
    backend = SimBackend(4)
    run = lambda name: train(cfg, task, backend, name, progress=False)
    pairs = [
        ("ssgd", "bmuf[block_size=1;block_momentum=0;nesterov=false]"),
        ("gtc", "bmuf_gtc[block_size=2;group_size=4]"),
    ]
    for flat, blocked in pairs:
        a, b = run(flat), run(blocked)
        jax.tree.map(
            lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a.params, b.params
        )
        np.testing.assert_allclose(
            [r["loss"] for r in a.records], [r["loss"] for r in b.records], rtol=1e-5
        )
