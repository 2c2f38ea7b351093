"""``--seeds`` and ``--sweep``: every entry once per seed on the same data; a sweep that
tunes on a validation split held out of the training set and picks by its loss."""

from __future__ import annotations

import dataclasses
import math

import harness
import jax
import numpy as np
import pytest
from harness import QUICKSTART, read_jsonl

from shoal.experiments import algorithms
from shoal.experiments.config import Config, ConfigError
from shoal.experiments.overrides import apply_overrides, load_config
from shoal.experiments.runner import sweep
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.cli import main
from shoal.experiments.runner.train import train
from shoal.experiments.tasks import make_task

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="in-process runner runs")

SMALL = ["--workers", "2", "--no-progress", "--set", "steps=8", "eval_every=4",
         "batch_size=8", "train_size=512", "test_size=128", "project_workers=0"]  # fmt: skip


def run(tmp_path, name, *args):
    out = tmp_path / name
    assert main([str(QUICKSTART), *SMALL, *args, "--out", str(out)]) == 0
    return out


def test_seeded_keeps_the_data_and_changes_the_model_and_batches():
    cfg = Config(seed=5, train_size=256, test_size=64, workers=2, batch_size=8)
    a, b = make_task(cfg.seeded(5)), make_task(cfg.seeded(6))
    assert (cfg.seeded(6).seed, cfg.seeded(6).data_seed) == (6, 5)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.x_test, b.x_test)
    assert not np.array_equal(a.batch(0, 2)[0], b.batch(0, 2)[0])
    same = jax.tree.map(np.array_equal, a.init_params(), b.init_params())
    assert not all(jax.tree.leaves(same))  # the kernels differ (the biases start at 0)
    # The config's own seed is the same run as the config itself.
    np.testing.assert_array_equal(make_task(cfg).batch(3, 2)[0], a.batch(3, 2)[0])


def test_seeds_run_every_entry_per_seed_and_seed_0_is_the_plain_run(tmp_path):
    plain = read_jsonl(run(tmp_path, "plain", "--set", "algorithms=ssgd,bmuf",
                           "bmuf.block_size=4") / "metrics.jsonl")  # fmt: skip
    both = read_jsonl(run(tmp_path, "seeds", "--seeds", "0,1", "--set", "algorithms=ssgd,bmuf",
                          "bmuf.block_size=4") / "metrics.jsonl")  # fmt: skip
    assert {(r["algorithm"], r["seed"]) for r in both} == {
        (a, s) for a in ("ssgd", "bmuf") for s in (0, 1)
    }
    # Seed 0 is the config's seed: the same records, bit for bit.
    assert [r for r in both if r["seed"] == 0] == plain
    one = [r["loss"] for r in both if r["seed"] == 1 and r["algorithm"] == "ssgd"]
    zero = [r["loss"] for r in plain if r["algorithm"] == "ssgd"]
    assert one != zero and len(one) == len(zero) == 8


def test_swept_path_finds_each_entrys_own_learning_rate():
    cfg = Config(workers=4, steps=40, algorithms=tuple(algorithms.ALGORITHMS))
    found = {}
    for e in algorithms.resolve_all(cfg):
        try:
            found[e.name] = sweep.swept_path(e, "learning_rate")
        except ConfigError as err:
            found[e.name] = str(err)
    assert found["ssgd"] == found["gtc"] == found["bmuf"] == "local.learning_rate"
    assert found["diloco"] == found["streaming_diloco"] == "inner.adamw.learning_rate"
    assert found["ssgd_adamw"] == "adamw.learning_rate"
    assert found["lamb"] == found["onebit_lamb"] == "learning_rate"
    assert found["muloco"] == "inner.learning_rate"
    assert found["demo"] == "learning_rate"
    # Every registered entry has exactly one: the sweep's key works for all of them.
    assert all(v.endswith("learning_rate") and " " not in v for v in found.values()), found
    diloco_sgd = algorithms.resolve("diloco[inner.use=sgd]", cfg)
    assert sweep.swept_path(diloco_sgd, "learning_rate") == "inner.sgd.learning_rate"
    assert sweep.swept_path(diloco_sgd, "outer.learning_rate") == "outer.learning_rate"
    with pytest.raises(ConfigError, match="ssgd has no 'outer.momentum'"):
        sweep.swept_path(algorithms.resolve("ssgd", cfg), "outer.momentum")


def test_with_value_adds_to_the_entrys_brackets():
    assert sweep.with_value("gtc", "local.learning_rate", "0.1") == "gtc[local.learning_rate=0.1]"
    assert (
        sweep.with_value("gtc[threshold=0.02;local.learning_rate=1]", "local.learning_rate", "3")
        == "gtc[threshold=0.02;local.learning_rate=3]"
    )


def test_choose_takes_the_lowest_finite_loss():
    values = ("0.01", "0.1", "1")
    assert sweep.choose({"0.01": 2.0, "0.1": 1.5, "1": math.nan}, values) == ("0.1", True)
    assert sweep.choose({"0.01": 2.0, "0.1": math.inf, "1": 1.0}, values) == ("1", True)
    # Diverged everywhere: the smallest value, flagged.
    assert sweep.choose(dict.fromkeys(values, math.nan), values) == ("0.01", False)


def test_tuning_horizon_is_one_every_entry_accepts():
    cfg = Config(
        workers=2, steps=40, algorithms=("ssgd", "bmuf"), params={"bmuf": {"block_size": 10}}
    )
    tune = sweep.tuning_config(cfg, 0.3, algorithms.resolve_all(cfg))  # 12 -> 10: BMUF blocks
    assert (tune.steps, tune.eval_every, tune.validation_size) == (10, 10, 2048)
    with pytest.raises(ConfigError, match="no horizon"):
        sweep.tuning_config(cfg, 0.2, algorithms.resolve_all(cfg))  # 8 steps: no whole block


def test_the_validation_split_is_held_out_of_the_training_set():
    cfg = Config(train_size=512, test_size=128, workers=2, batch_size=8)
    full = make_task(cfg)
    held = make_task(dataclasses.replace(cfg, validation_size=100))
    np.testing.assert_array_equal(held.x_train, full.x_train[:412])
    np.testing.assert_array_equal(held.validation[0], full.x_train[412:])
    # Every training batch comes from the 412 rows left; evaluation reads the held-out rows.
    seen = np.concatenate([held.batch(s, 2)[0].reshape(-1, cfg.num_features) for s in range(80)])
    rows = {r.tobytes() for r in held.x_train}
    assert all(r.tobytes() in rows for r in seen)
    params = held.init_params()
    loss, acc = held._eval(params, *held.validation)
    assert held.evaluate(params) == (float(loss), float(acc))
    assert held.evaluate(params) != full.evaluate(params)


def test_sweep_picks_by_validation_loss_and_trains_the_choice_over_the_seeds(tmp_path):
    out = run(tmp_path, "sweep", "--seeds", "0,1", "--sweep", "learning_rate=0.01,0.3",
              "--sweep-fraction", "0.5", "--set", "algorithms=ssgd,diloco",
              "diloco.sync_every=4", "validation_size=64")  # fmt: skip
    (ssgd, diloco) = read_jsonl(out / "sweep.jsonl")
    for row in (ssgd, diloco):
        best = min(row["losses"], key=row["losses"].get)
        assert row["chosen"] == best and row["finite"]
    chosen = {f"ssgd[local.learning_rate={ssgd['chosen']}]",
              f"diloco[inner.adamw.learning_rate={diloco['chosen']}]"}  # fmt: skip
    records = read_jsonl(out / "metrics.jsonl")
    assert {r["algorithm"] for r in records} == chosen
    assert {r["seed"] for r in records} == {0, 1}
    summary = (out / "summary.md").read_text()
    assert "## Tuning" in summary and "4 of the 8 steps" in summary and "64 rows" in summary
    # The tuning run's loss is the chosen entry's validation loss at step 4, retrained.
    cfg = apply_overrides(load_config(QUICKSTART), [
        "workers=2", "steps=4", "eval_every=4", "batch_size=8", "train_size=512",
        "test_size=128", "validation_size=64", "algorithms=ssgd", "project_workers=0"])  # fmt: skip
    task = make_task(cfg)
    entry = algorithms.resolve(f"ssgd[local.learning_rate={ssgd['chosen']}]", cfg)
    result = train(cfg, task, SimBackend(2), entry, progress=False)
    assert result.summary["test_loss"] == ssgd["losses"][ssgd["chosen"]]


def test_factors_scale_each_entrys_own_rate():
    assert sweep.parse_sweep("learning_rate=x0.5, x2") == ("learning_rate", ("x0.5", "x2"))
    for bad in ("learning_rate=x0.5,0.1", "learning_rate=x0,x1", "learning_rate=xa"):
        with pytest.raises(Exception, match="--sweep learning_rate"):
            sweep.parse_sweep(bad)
    cfg = Config(workers=2, steps=20, algorithms=("ssgd", "diloco"))
    ssgd, diloco = algorithms.resolve_all(cfg)
    assert sweep.resolved_value(ssgd, "local.learning_rate", "x2") == "0.1"
    assert (
        sweep.resolved_value(ssgd, "local.learning_rate", "x6") == "0.3"
    )  # not 0.30000000000000004
    assert sweep.resolved_value(diloco, "inner.adamw.learning_rate", "x0.5") == "0.0005"
    assert sweep.resolved_value(ssgd, "local.learning_rate", "0.3") == "0.3"
    assert sweep.choose({"x0.5": math.nan, "x2": math.nan}, ("x2", "x0.5")) == ("x0.5", False)
