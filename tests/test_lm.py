"""The byte-level LM task (corpus, model, loss) and LAMB / 1-bit LAMB through the runner:
wire bytes against hand counts, identical warm-up, the summary's volume-reduction section."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import harness
import numpy as np
import pytest

from shoal.comms import OneBit, tree_nbytes
from shoal.experiments import algorithms
from shoal.experiments.config import Config, ConfigError
from shoal.experiments.reports import SAMPLES_PLOT, volume_reduction
from shoal.experiments.runner.cli import main
from shoal.experiments.tasks.lm import ByteLMTask, load_corpus, stdlib_files, windows

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="single-process tests")

WORKERS, STEPS, FREEZE = 4, 8, 3
TINY = Config(
    name="lm_tiny", task="lm", algorithms=("lamb", "onebit_lamb"), workers=WORKERS,
    steps=STEPS, batch_size=2, seq_len=16, train_size=256, test_size=32, eval_every=4,
    lm_width=32, lm_layers=1, lm_heads=2,
    params={"lamb": {"learning_rate": 0.02},
            "onebit_lamb": {"learning_rate": 0.02, "freeze_step": FREEZE}},
)  # fmt: skip


def test_corpus_split_on_synthetic_files(tmp_path):
    names = [f"m{i:02d}.py" for i in range(12)]
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(bytes([65 + i]) * (i + 1))
    (tmp_path / "notes.txt").write_bytes(b"not python")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "inner.py").write_bytes(b"not at the top level")
    c = load_corpus(tmp_path)
    # Sorted position 5 is the only validation file of 12 (positions 5, 15, ...).
    assert c.val_files == ("m05.py",)
    assert c.train_files == tuple(n for n in names if n != "m05.py")
    assert c.val.tobytes() == b"F" * 6
    assert c.train.tobytes() == b"".join(bytes([65 + i]) * (i + 1) for i in range(12) if i != 5)


def test_stdlib_corpus_is_local_and_deterministic():
    root = Path(os.path.dirname(os.__file__))
    files = stdlib_files()
    assert len(files) > 50 and all(f.parent == root and f.suffix == ".py" for f in files)
    assert [f.name for f in files] == sorted(f.name for f in files)
    a, b = load_corpus(), load_corpus()
    assert a.train.tobytes() == b.train.tobytes() and a.val.tobytes() == b.val.tobytes()
    assert len(a.val_files) == len(range(5, len(files), 10))
    assert set(a.train_files).isdisjoint(a.val_files)
    assert len(a.train) + len(a.val) == sum(f.stat().st_size for f in files)
    assert a.train.dtype == np.uint8


def test_windows_are_evenly_spaced_slices():
    stream = np.arange(100, dtype=np.uint8)
    w = windows(stream, 4, 10)
    assert w.shape == (4, 10) and w.dtype == np.int32
    np.testing.assert_array_equal(w[:, 0], [0, 30, 60, 90])
    np.testing.assert_array_equal(w[2], np.arange(60, 70))


def test_batches_and_loss_at_init():
    task = ByteLMTask(TINY)
    x, y = task.batch(0, WORKERS)
    assert x.shape == y.shape == (WORKERS, 2, 16)
    assert 0 <= x.min() and x.max() < 256
    np.testing.assert_array_equal(x[..., 1:], y[..., :-1])  # y is x shifted by one byte
    # Near-uniform predictions at init: about ln(256) nats per byte.
    params = task.init_params()
    loss = float(task.loss(params, x[0], y[0]))
    assert abs(loss - math.log(256)) < 0.05
    val_loss, acc = task.evaluate(params)
    assert abs(val_loss - math.log(256)) < 0.05 and 0 <= acc <= 1


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lm")
    cfg = tmp_path_factory.mktemp("cfg") / "lm_tiny.py"
    # The algorithms' hyper-parameters as dicts of their fields: a config file's spelling.
    values = {**TINY.__dict__, "params": {n: dataclasses.asdict(p) for n, p in TINY.params.items()}}
    fields = ", ".join(f"{k}={v!r}" for k, v in values.items())
    cfg.write_text(
        f"from shoal.experiments.config import Config\n\ndef get_config():\n"
        f"    return Config({fields})\n"
    )
    assert main([str(cfg), "--no-progress", "--out", str(out)]) == 0
    return out


def test_onebit_lamb_wire_bytes(lm_run):
    recs = [json.loads(line) for line in (lm_run / "metrics.jsonl").read_text().splitlines()]
    one = [r for r in recs if r["algorithm"] == "onebit_lamb"]
    lamb = [r for r in recs if r["algorithm"] == "lamb"]
    nbytes = tree_nbytes(ByteLMTask(TINY).init_params())
    n = nbytes // 4
    # Hand counts: a float32 ring all-reduce sends 2 (P-1)/P of the gradient bytes; the
    # compressed all-reduce pads to a multiple of P lcm(P, 8) = 32 elements and sends
    # 2 (P-1) times (n_pad / P / 8 sign bytes + a 4-byte scale).
    ring = 2 * (WORKERS - 1) * nbytes // WORKERS
    n_pad = -(-n // 32) * 32
    compressed = 2 * (WORKERS - 1) * (n_pad // WORKERS // 8 + 4)
    assert OneBit().wire_bytes(n, WORKERS) == (compressed, compressed)
    # Every step first all-reduces the non-finite flag (one int32) over the workers.
    flag = 2 * (WORKERS - 1) * 4 // WORKERS
    expect = [(ring if step <= FREEZE else compressed) + flag for step in range(1, STEPS + 1)]
    assert [r["bytes_sent"] for r in one] == expect
    assert [r["bytes_received"] for r in one] == expect
    assert [r["bytes_sent"] for r in lamb] == [ring + flag] * STEPS
    assert one[-1]["mb_sent"] == pytest.approx(sum(expect) / 1e6, rel=1e-12)

    # Same init, data and rule through the freeze step: the same losses, also at step
    # FREEZE + 1 (computed on the parameters after FREEZE warm-up steps); then they part.
    np.testing.assert_array_equal(
        [r["loss"] for r in one[: FREEZE + 1]], [r["loss"] for r in lamb[: FREEZE + 1]]
    )
    assert one[FREEZE + 1]["loss"] != lamb[FREEZE + 1]["loss"]

    summary = (lm_run / "summary.md").read_text()
    w = FREEZE / STEPS
    measured = lamb[-1]["mb_sent"] / one[-1]["mb_sent"]
    assert measured == pytest.approx(STEPS * (ring + flag) / sum(expect))
    assert "## LAMB vs 1-bit LAMB" in summary
    assert f"measured (LAMB MB / 1-bit LAMB MB): **{measured:.2f}x**" in summary
    assert f"**{1 / (w + (1 - w) / 32):.2f}x**" in summary
    assert f"= {1 / (w + (1 - w) / 16):.2f}x" in summary
    assert "bits per byte" in summary and "## Data" in summary
    assert (lm_run / SAMPLES_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_loss_decreases_under_lamb(lm_run):
    # The runner's own records (one compile for the whole file): mean worker batch loss.
    recs = [json.loads(line) for line in (lm_run / "metrics.jsonl").read_text().splitlines()]
    for name in ("lamb", "onebit_lamb"):
        losses = [r["loss"] for r in recs if r["algorithm"] == name]
        assert abs(losses[0] - math.log(256)) < 0.05
        assert losses[-1] < losses[0] - 0.3, (name, losses)
        val = [r["test_loss"] for r in recs if r["algorithm"] == name and "test_loss" in r]
        assert val[-1] < math.log(256) - 0.3


def test_volume_formula_and_freeze_step():
    assert volume_reduction(0.0, 32) == pytest.approx(32.0)
    assert volume_reduction(1.0, 32) == pytest.approx(1.0)
    assert volume_reduction(0.15, 16) == pytest.approx(1 / (0.15 + 0.85 / 16))
    freeze = lambda p: algorithms.resolve("onebit_lamb", Config(steps=200, params=p)).warmup()
    assert freeze({"onebit_lamb": {"freeze_fraction": 0.15}}) == 30
    assert freeze({"onebit_lamb": {"freeze_step": 7}}) == 7
    with pytest.raises(ConfigError, match="freeze step 200 must be less than steps"):
        freeze({"onebit_lamb": {"freeze_step": 200}})
    with pytest.raises(ConfigError, match="lm_heads"):
        Config(lm_width=30, lm_heads=4)
