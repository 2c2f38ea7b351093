"""Several seeds of one entry, as the reports aggregate them
(`shoal.experiments.reports.seeds`): mean, sample std (ddof=1) and count per summary
field, mean curves with their spread per step, checked against NumPy and hand-computed
values."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.experiments.reports import seeds
from shoal.experiments.reports.plots import moving_average


def test_spread_by_hand():
    # deviations -0.03, 0, +0.03: sum of squares 0.0018 over n - 1 = 2 -> std 0.03
    s = seeds.spread([0.80, 0.83, 0.86])
    assert s.n == 3
    assert s.mean == pytest.approx(0.83)
    assert s.std == pytest.approx(0.03)
    # one value: no sample std, not 0
    assert seeds.spread([0.5]) == seeds.Spread(0.5, None, 1)
    with pytest.raises(ValueError, match="no values"):
        seeds.spread([])


def test_overlaps_needs_a_spread_on_both_sides():
    a, b = seeds.Spread(0.80, 0.02, 3), seeds.Spread(0.83, 0.015, 3)
    assert a.overlaps(b) and b.overlaps(a)  # 0.03 <= 0.035
    assert not seeds.Spread(0.80, 0.01, 3).overlaps(seeds.Spread(0.83, 0.01, 3))  # 0.03 > 0.02
    assert seeds.Spread(0.80, 0.015, 3).overlaps(seeds.Spread(0.83, 0.015, 3))  # touching
    # one seed: no interval, so no claim either way
    assert not seeds.Spread(0.80, None, 1).overlaps(seeds.Spread(0.80, 0.1, 3))


def test_by_entry_against_numpy():
    rng = np.random.default_rng(0)
    labels, seed_list = ("ssgd", "gtc[threshold=0.05]"), (0, 1, 4)
    values = {(label, s): rng.uniform(0.5, 1.0, 3) for label in labels for s in seed_list}
    summaries = [
        {
            "algorithm": label,
            "seed": s,
            "steps": 20,
            "loss": values[label, s][0],
            "test_accuracy": values[label, s][1],
            "density": values[label, s][2] if label != "ssgd" else None,
            "skipped": 2 if (label, s) == ("ssgd", 1) else None,
            "note": "x",
        }
        for s in seed_list  # seeds outermost: summaries of one entry need not be adjacent
        for label in labels
    ]
    rows = seeds.by_entry(summaries)
    assert [r["algorithm"] for r in rows] == list(labels)
    for row, label in zip(rows, labels, strict=True):
        assert row["seeds"] == list(seed_list)
        for i, key in enumerate(("loss", "test_accuracy")):
            want = np.array([values[label, s][i] for s in seed_list])
            assert row[key].n == 3
            assert row[key].mean == pytest.approx(np.mean(want))
            assert row[key].std == pytest.approx(np.std(want, ddof=1))
        assert row["steps"] == seeds.Spread(20.0, 0.0, 3)
        assert row["note"] == "x"
    assert rows[0]["density"] is None  # no seed of ssgd has one
    assert rows[1]["density"].mean == pytest.approx(np.mean([values["gtc[threshold=0.05]", s][2]
                                                             for s in seed_list]))  # fmt: skip
    # `skipped` None is 0 skipped steps: the mean is over every seed, 2 / 3
    assert rows[0]["skipped"].mean == pytest.approx(2 / 3) and rows[0]["skipped"].n == 3
    assert rows[1]["skipped"] is None


def test_rows_without_a_seed_are_one_seed():
    (row,) = seeds.by_entry([{"algorithm": "ssgd", "loss": 0.25}])
    assert row["seeds"] == [None] and row["loss"] == seeds.Spread(0.25, None, 1)


def records_of(loss: dict[int, list[float]], evals: dict[int, dict[int, float]]):
    """Records of ``ssgd`` for each seed: ``loss[seed][i]`` at step i + 1, ``mb_sent``
    0.5 * step + seed, ``test_loss`` at the steps of ``evals[seed]``."""
    out = []
    for seed, losses in loss.items():
        for i, value in enumerate(losses):
            step = i + 1
            r = {"algorithm": "ssgd", "seed": seed, "step": step, "loss": value,
                 "mb_sent": 0.5 * step + seed}  # fmt: skip
            if step in evals[seed]:
                r["test_loss"] = evals[seed][step]
            out.append(r)
    out.append({"algorithm": "other", "seed": 0, "step": 1, "loss": 99.0, "mb_sent": 1.0})
    return out


def test_band_against_numpy():
    loss = {0: [4.0, 3.0, 2.0, 1.0], 1: [5.0, 3.0, 3.0, 1.0], 2: [3.0, 2.0, 1.0, 0.0]}
    evals = {0: {2: 1.0, 4: 0.5}, 1: {2: 2.0, 4: 0.25}, 2: {2: 3.0}}  # seed 2 misses step 4
    records = records_of(loss, evals)
    b = seeds.band(records, "ssgd", "loss")
    table = np.array(list(loss.values()))
    assert b.n == 3
    np.testing.assert_allclose(b.x, [1, 2, 3, 4])
    np.testing.assert_allclose(b.mean, table.mean(axis=0))
    np.testing.assert_allclose(b.std, table.std(axis=0, ddof=1))
    # x other than the step: its mean over the seeds at that step (0.5 step + 1)
    np.testing.assert_allclose(seeds.band(records, "ssgd", "loss", x="mb_sent").x,
                               [1.5, 2.0, 2.5, 3.0])  # fmt: skip
    # each seed smoothed first, then the spread of the smoothed curves
    smooth = seeds.band(records, "ssgd", "loss", per_seed=lambda ys: moving_average(ys, 2))
    table = np.array([moving_average(v, 2) for v in loss.values()])
    np.testing.assert_allclose(smooth.mean, table.mean(axis=0))
    np.testing.assert_allclose(smooth.std, table.std(axis=0, ddof=1))
    # test loss: at step 2 three seeds (1, 2, 3: mean 2, std 1); at step 4 two (0.5, 0.25)
    t = seeds.band(records, "ssgd", "test_loss")
    np.testing.assert_allclose(t.x, [2, 4])
    np.testing.assert_allclose(t.mean, [2.0, 0.375])
    np.testing.assert_allclose(t.std, [1.0, np.std([0.5, 0.25], ddof=1)])


def test_band_of_one_seed_has_no_spread():
    records = records_of({7: [2.0, 1.0]}, {7: {}})
    b = seeds.band(records, "ssgd", "loss")
    assert b.n == 1 and b.std is None
    np.testing.assert_allclose(b.mean, [2.0, 1.0])
    empty = seeds.band(records, "ssgd", "test_loss")
    assert empty.n == 0 and len(empty.x) == 0
