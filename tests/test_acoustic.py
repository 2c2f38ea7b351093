"""The acoustic-modelling task (HMM sequences, LSTM frame classifier) against NumPy
checks, and the study driver on a tiny study."""

from __future__ import annotations

import dataclasses
import itertools
import json

import harness
import numpy as np
import pytest

from shoal.experiments.config import Config, ConfigError
from shoal.experiments.overrides import load_file
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.cli import main
from shoal.experiments.runner.study import Row, relative_reduction
from shoal.experiments.runner.train import train
from shoal.experiments.tasks import GaussianMixtureTask, make_task
from shoal.experiments.tasks.acoustic import HMM, HMMFrameTask, random_hmm

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="single-process tests")

K, F = 6, 3
TINY = Config(
    task="hmm", num_classes=K, num_features=F, class_sep=1.0, seq_len=8, hmm_successors=2,
    train_size=64, test_size=32, hidden=(16,), batch_size=4, workers=2, steps=8,
    eval_every=4,
    params={"ssgd": {"local": {"learning_rate": 0.1, "momentum": 0.9}}, "bmuf": {"block_size": 2},
            "bmuf_gtc": {"block_size": 2, "group_size": 2}},
)  # fmt: skip


def small_hmm(seed=0, self_loop=0.6):
    return random_hmm(states=K, features=F, self_loop=self_loop, successors=2, sep=2.0, seed=seed)


def test_hmm_structure():
    hmm = small_hmm()
    a = hmm.transitions
    np.testing.assert_allclose(a.sum(1), 1.0)
    np.testing.assert_allclose(np.diag(a), 0.6)
    # Each state moves to exactly `successors` other states.
    assert ((a > 0).sum(1) == 3).all()
    np.testing.assert_allclose(hmm.initial, 1.0 / K)


def test_samples_match_the_model():
    hmm = small_hmm()
    n, length = 4000, 20
    x, s = hmm.sample(n, length, np.random.default_rng(7))
    assert x.shape == (n, length, F) and x.dtype == np.float32
    assert s.shape == (n, length) and s.dtype == np.int32
    # Empirical transition frequencies, counted independently of the sampler.
    counts = np.zeros((K, K))
    np.add.at(counts, (s[:, :-1].ravel(), s[:, 1:].ravel()), 1)
    rows = counts.sum(1, keepdims=True)
    a = hmm.transitions
    # Binomial counts per row: within 5 standard deviations.
    assert np.all(np.abs(counts / rows - a) <= 5 * np.sqrt(a * (1 - a) / rows) + 1e-12)
    assert counts[a == 0].sum() == 0
    # First states are uniform; emissions are unit Gaussians around the state's mean.
    np.testing.assert_allclose(np.bincount(s[:, 0], minlength=K) / n, 1.0 / K, atol=0.025)
    for k in range(K):
        frames = x[s == k]
        np.testing.assert_allclose(frames.mean(0), hmm.means[k], atol=5 / np.sqrt(len(frames)))
        np.testing.assert_allclose(frames.var(0), 1.0, atol=5 * np.sqrt(2 / len(frames)))


def test_generation_is_deterministic_under_a_seed():
    a = HMMFrameTask(TINY)
    b = HMMFrameTask(TINY)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    np.testing.assert_array_equal(a.hmm.transitions, b.hmm.transitions)
    c = HMMFrameTask(dataclasses.replace(TINY, seed=1))
    assert not np.array_equal(a.x_train, c.x_train)
    assert not np.array_equal(a.hmm.means, c.hmm.means)


def test_filter_error_is_the_causal_bayes_classifier():
    # Brute force: p(s_t | x_1..t) by summing over all state paths up to t.
    hmm = HMM(
        initial=np.array([0.5, 0.3, 0.2]),
        transitions=np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.0, 0.7]]),
        means=np.array([[0.0, 0.0], [0.8, 0.0], [0.0, 0.8]]),
    )
    x, s = hmm.sample(40, 4, np.random.default_rng(3))
    wrong = 0
    for xi, si in zip(x.astype(np.float64), s):
        lik = np.exp(-0.5 * ((xi[:, None, :] - hmm.means) ** 2).sum(-1))  # [T, K]
        for t in range(4):
            post = np.zeros(3)
            for path in itertools.product(range(3), repeat=t + 1):
                p = hmm.initial[path[0]] * lik[0, path[0]]
                for u in range(1, t + 1):
                    p *= hmm.transitions[path[u - 1], path[u]] * lik[u, path[u]]
                post[path[-1]] += p
            wrong += post.argmax() != si[t]
    assert hmm.filter_error(x, s) == pytest.approx(wrong / s.size, abs=1e-12)
    frame = np.mean([np.argmax(-((f - hmm.means) ** 2).sum(-1)) != y for f, y in
                     zip(x.reshape(-1, 2), s.ravel())])  # fmt: skip
    assert hmm.frame_ml_error(x, s) == pytest.approx(frame)


def test_context_matters_on_the_acoustic_settings():
    # The bundled settings: one frame alone is a poor guess, the sequence context is not.
    cfg = Config(task="hmm", num_classes=64, num_features=40, class_sep=0.35, workers=1,
                 batch_size=1, train_size=8, test_size=256)  # fmt: skip
    task = HMMFrameTask(cfg)
    refs = list(task.references().values())
    assert refs[0] < 0.25 < 0.45 < refs[1]


def test_task_is_selected_by_config():
    assert isinstance(make_task(TINY), HMMFrameTask)
    assert isinstance(make_task(Config(train_size=256, test_size=8)), GaussianMixtureTask)
    with pytest.raises(ConfigError, match="hmm_successors"):
        Config(task="hmm", num_classes=4, hmm_successors=4)


def test_lstm_loss_decreases_under_ssgd():
    task = HMMFrameTask(TINY)
    x, y = task.batch(0, 2)
    assert x.shape == (2, 4, 8, F) and y.shape == (2, 4, 8)
    cfg = dataclasses.replace(TINY, steps=30, eval_every=30)
    init_loss, _ = task.evaluate(task.init_params())
    result = train(cfg, task, SimBackend(2), "ssgd", progress=False)
    losses = [r["loss"] for r in result.records]
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
    assert result.summary["test_loss"] < init_loss
    assert result.summary["test_error"] == pytest.approx(1 - result.summary["test_accuracy"])


STUDY_FILE = """
from shoal.experiments.config import Config
from shoal.experiments.runner.study import Row, Study, Table


def get_config():
    # The driver does not care about the task: the MLP compiles faster than the LSTM.
    cfg = Config(name="tiny_study", train_size=32, test_size=16, num_features=4, hidden=(8,),
                 workers=2, batch_size=4, params={"bmuf": {"block_size": 2}})
    t1 = Table("T1", ("method", "workers"), [Row(("SSGD", "2"), 2, "ssgd"),
                                              Row(("BMUF", "4"), 4, "bmuf")])
    t2 = Table("T2", ("method",), [Row(("BMUF",), 4, "bmuf")], note="a note")
    return Study(config=cfg, tables=(t1, t2), epochs=1)
"""


@pytest.fixture
def study_file(tmp_path):
    path = tmp_path / "tiny_study.py"
    path.write_text(STUDY_FILE)
    return path


def test_study_runs_each_row_once_and_writes_tables(study_file, tmp_path, capsys):
    study = load_file(study_file)
    assert [r.key for r in study.runs()] == [(1, "ssgd"), (2, "ssgd"), (4, "bmuf")]
    # Same data budget: 32 examples, 4 per worker and step.
    assert [study.run_config(r).steps for r in study.runs()] == [8, 4, 2]
    out = tmp_path / "out"
    assert main([str(study_file), "--no-progress", "--out", str(out)]) == 0
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["workers"], r["algorithm"]) for r in results] == [r.key for r in study.runs()]
    summaries = {(r["workers"], r["algorithm"]): r for r in results}
    base = summaries[(1, "ssgd")]["test_error"]
    bmuf = summaries[(4, "bmuf")]
    text = (out / "summary.md").read_text()
    assert "## T1" in text and "## T2" in text and "a note" in text
    assert "| method | workers | steps | test error | rel. reduction (%) |" in text
    rel = relative_reduction(bmuf["test_error"], base)
    row = f"| BMUF | 4 | 2 | {bmuf['test_error']:.2%} | {rel:+.1f} | {bmuf['mb_sent']:.2f} |"
    assert row in text and row in capsys.readouterr().out
    assert relative_reduction(0.3, 0.25) == pytest.approx(-20.0)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 8 + 4 + 2


def test_study_over_seeds_shows_mean_and_std(study_file, tmp_path):
    out = tmp_path / "out"
    assert main([str(study_file), "--no-progress", "--seeds", "0,3", "--out", str(out)]) == 0
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["workers"], r["algorithm"], r["seed"]) for r in results] == [
        (1, "ssgd", 0), (1, "ssgd", 3), (2, "ssgd", 0), (2, "ssgd", 3), (4, "bmuf", 0),
        (4, "bmuf", 3)]  # fmt: skip
    errors = {}
    for r in results:
        errors.setdefault((r["workers"], r["algorithm"]), []).append(r["test_error"])
    bmuf, base = np.array(errors[(4, "bmuf")]), np.mean(errors[(1, "ssgd")])
    rel = relative_reduction(bmuf.mean(), base)
    mb = np.mean([r["mb_sent"] for r in results if r["algorithm"] == "bmuf"])
    row = f"| BMUF | 4 | 2 | {bmuf.mean():.2%} ± {bmuf.std(ddof=1):.2%} | {rel:+.1f} | {mb:.2f} |"
    text = (out / "summary.md").read_text()
    assert row in text and "x 2 seeds (0, 3)" in text, text
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 * (8 + 4 + 2)


def test_study_errors(study_file, capsys):
    assert main([str(study_file), "--workers", "4"]) == 2
    assert "a study runs its own worker counts" in capsys.readouterr().err
    assert main([str(study_file), "--set", "steps=3"]) == 2
    assert "cannot --set steps=3" in capsys.readouterr().err
    # The shared config's overrides are checked against every run before training.
    assert main([str(study_file), "--set", "bmuf.block_size=3"]) == 2
    assert "multiple of block_size = 3" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="not a multiple of workers"):
        load_file(study_file).run_config(Row(("x",), 3, "ssgd"))
