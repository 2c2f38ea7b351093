"""The run's plots are readable: legends outside the axes and inside the figure, every
line labelled, one colour per algorithm (the same in every panel and file, no two alike),
coincident curves told apart, bytes on a log axis, each family in its own panels of at
most 8 curves beside ssgd, accuracy in percent, several seeds as mean curves in a band of
± one std; the report's wording of ratios near 1; the optional TensorBoard event files."""

from __future__ import annotations

import dataclasses
import json
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import harness
import numpy as np
import pytest
from harness import QUICKSTART
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from shoal.experiments import algorithms
from shoal.experiments import reports as report
from shoal.experiments.config import Config, ConfigError
from shoal.experiments.overrides import apply_overrides, load_config
from shoal.experiments.runner.cli import main

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="the runner starts its own workers")

# ssgd and bfb_allreduce reduce the same gradient (identical curves); bmuf with nonfinite=off sends
# no bytes between its syncs; adaptive switches once (adaptive.threshold=0).
ALGORITHMS = ("ssgd", "bmuf", "bfb_allreduce", "adaptive")
SETS = [
    "steps=8",
    "eval_every=4",
    "algorithms=" + ",".join(ALGORITHMS),
    "bmuf.block_size=4",
    "adaptive.every=4",
    "adaptive.threshold=0",
    "adaptive.after=0",
    "project_workers=0",
    "nonfinite=off",
    "train_size=512",
    "test_size=256",
    "batch_size=16",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("plots") / "run"  # a fresh folder
    args = [str(QUICKSTART), "--workers", "4", "--no-progress", "--out", str(out)]
    assert main([*args[:1], "--set", *SETS, *args[1:]]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, records


def legends(fig: Figure) -> list:
    """The figure's legends: one per row of panels, on the row's last axes."""
    return [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]


def check_readable(fig: Figure) -> dict[str, str]:
    """Asserts the layout properties; returns {label: colour} of every legend entry."""
    FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    figure_box = fig.bbox
    assert not fig.legends  # one legend per row instead, beside its panels
    entries = {}
    found = legends(fig)
    assert found
    for legend in found:
        box = legend.get_window_extent(renderer)
        assert box.x0 >= figure_box.x0 - 1 and box.x1 <= figure_box.x1 + 1
        assert box.y0 >= figure_box.y0 - 1 and box.y1 <= figure_box.y1 + 1
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), "legend covers an axes"
        for other in found:
            if other is not legend:
                assert not box.overlaps(other.get_window_extent(renderer)), "legends overlap"
        texts = [t.get_text() for t in legend.get_texts()]
        colors = [h.get_color() for h in legend.legend_handles]
        for text, color in zip(texts, colors, strict=True):
            assert entries.setdefault(text, color) == color, f"{text}: two colours"
    for ax in fig.axes:
        tight = ax.get_tightbbox(renderer)  # labels and titles too: nothing clipped
        assert tight.x0 >= -1 and tight.y0 >= -1
        assert tight.x1 <= figure_box.x1 + 1 and tight.y1 <= figure_box.y1 + 1
        for line in ax.get_lines():
            assert line.get_label() and not line.get_label().startswith("_"), line
    return entries


def row_entries(fig: Figure) -> list[list[str]]:
    """Each row's legend entries, in order."""
    return [[t.get_text() for t in legend.get_texts()] for legend in legends(fig)]


def one_colour_per_algorithm(fig: Figure, entries: dict[str, str], names=ALGORITHMS) -> None:
    by_name = {label.split(" ")[0]: color for label, color in entries.items()}
    assert set(by_name) >= set(names)
    assert len({by_name[a] for a in names}) == len(names)
    for ax in fig.axes:
        for line in ax.get_lines():
            name = line.get_label().split(" ")[0]
            assert line.get_color() == by_name[name], line.get_label()


def test_run_writes_and_embeds_every_plot(run):
    out, _ = run
    text = (out / "report.md").read_text()
    for name in report.PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in text


@pytest.mark.parametrize("x", ["step", "mb_sent"])
def test_loss_plots(run, tmp_path, x):
    _, records = run
    assert any(r["mb_sent"] == 0 for r in records)  # bmuf before its first sync
    fig = report.plot_loss(tmp_path / "loss.png", records, x, x)
    entries = check_readable(fig)
    one_colour_per_algorithm(fig, entries)
    # One legend entry per algorithm (not train and test twice), the twin named; a row
    # per family, ssgd in each.
    assert row_entries(fig) == [
        ["ssgd", "bfb_allreduce (same curve as ssgd)", "adaptive"],
        ["ssgd", "bmuf"],
    ]
    assert entries["ssgd"] == "#000000"
    scales = {ax.get_xscale() for ax in fig.axes}
    assert scales == ({"log"} if x == "mb_sent" else {"linear"})
    if x == "mb_sent":  # no line passes a 0 to the log axis
        for ax in fig.axes:
            assert all(min(line.get_xdata(), default=1) > 0 for line in ax.get_lines())
        assert "0 bytes not shown" in fig.axes[-1].get_xlabel()
    # The twin is drawn on top in another style, so both curves show.
    lines = {line.get_label(): line for line in fig.axes[1].get_lines()}
    assert (
        lines["bfb_allreduce test loss"].get_linestyle() != lines["ssgd test loss"].get_linestyle()
    )
    assert lines["bfb_allreduce test loss"].get_zorder() > lines["ssgd test loss"].get_zorder()


def test_accuracy_plot_labels_the_switch_and_the_twin(run, tmp_path):
    _, records = run
    fig = report.plot_accuracy(tmp_path / "acc.png", records)
    entries = check_readable(fig)
    one_colour_per_algorithm(fig, entries)
    (switch,) = [label for label in entries if "switches" in label]
    change = next(r for r in records if "policy" in r)
    assert switch.startswith(f"adaptive switches after step {change['step']}: ")
    # (In so short a run adaptive may well be one of ssgd's twins too.)
    (adaptive,) = [x for x in entries if x.split(" ")[0] == "adaptive" and x != switch]
    assert entries[switch] == entries[adaptive]
    assert "bfb_allreduce (same curve as ssgd)" in entries
    dense, local = fig.axes  # a panel per family, the switch in adaptive's
    markers = {line.get_label(): line.get_marker() for line in dense.get_lines()}
    assert markers["bfb_allreduce (same curve as ssgd)"] != markers["ssgd"]
    assert not any("switches" in line.get_label() for line in local.get_lines())
    # percent, as in the tables
    assert "%" in dense.get_ylabel()
    (ssgd,) = [line for line in dense.get_lines() if line.get_label() == "ssgd"]
    want = [100 * r["test_accuracy"] for r in records
            if r["algorithm"] == "ssgd" and "test_accuracy" in r]  # fmt: skip
    np.testing.assert_allclose(ssgd.get_ydata(), want)


def test_facets_keep_each_family_to_panels_of_eight_beside_ssgd():
    names = list(algorithms.ALGORITHMS)  # all 27, ssgd among them
    panels = report.facets(names)
    for title, entries in panels:
        assert entries[0] == "ssgd" and 2 <= len(entries) <= report.PER_PANEL
        families = {algorithms.ALGORITHMS[n].family for n in entries[1:]}
        assert len(families) == 1 and title.startswith(families.pop())
    # every other entry in exactly one panel, in the registry's family order
    shown = [n for _, entries in panels for n in entries[1:]]
    assert sorted(shown) == sorted(set(names) - {"ssgd"})
    assert [t.split(":")[0] for t, _ in panels] == ["dense", "compressed", "local (1/3)",
                                                    "local (2/3)", "local (3/3)"]  # fmt: skip
    # 15 local entries do not fit beside ssgd in 8 curves: three panels of 5
    assert [len(e) for t, e in panels if t.startswith("local")] == [6, 6, 6]
    # bracketed entries go with their algorithm; 15 GTC variants make 3 panels of 5 + ssgd
    variants = [f"gtc[threshold={i / 100}]" for i in range(1, 16)]
    split = report.facets(["ssgd", *variants])
    assert [len(e) for _, e in split] == [6, 6, 6]
    assert [n for _, e in split for n in e[1:]] == variants
    # without ssgd: 8 per panel; ssgd alone: one panel
    assert [len(e) for _, e in report.facets(variants[:9])] == [5, 4]
    assert report.facets(["ssgd"]) == [("", ["ssgd"])]


def test_colours_are_distinct_across_a_run():
    from shoal.experiments.reports.panels import lab

    names = [*algorithms.ALGORITHMS, *(f"topk[fraction={i / 100}]" for i in range(1, 11))]
    colors = report.algorithm_colors(names)
    assert colors["ssgd"] == "#000000"
    assert len(set(colors.values())) == len(names) == len(algorithms.ALGORITHMS) + 10 == 37
    # no two alike (delta E in CIELAB) among the first 24, whatever the panel
    rgb = np.array([[int(c[i : i + 2], 16) / 255 for i in (1, 3, 5)]
                    for c in report.palette(24)])  # fmt: skip
    points = lab(rgb)
    gaps = np.linalg.norm(points[:, None] - points[None], axis=-1) + 1e9 * np.eye(24)
    assert gaps.min() > 25
    # CIELAB by hand: white is L = 100, a = b = 0; pure red L = 53.24, a = 80.09, b = 67.20
    np.testing.assert_allclose(lab(np.array([1.0, 1.0, 1.0])), [100, 0, 0], atol=0.05)
    np.testing.assert_allclose(lab(np.array([1.0, 0.0, 0.0])), [53.24, 80.09, 67.20], atol=0.1)


SEEDS = (0, 1, 2)
# 11 entries in 3 families: dense 3, compressed 5, local 3 (with ssgd in each)
SEEDED = ("ssgd", "gtc", "topk", "powersgd", "demo", "onebit_lamb", "bmuf", "diloco",
          "sma", "lamb", "bfb_allreduce")  # fmt: skip


def test_bytes_plot_of_runs_that_sent_nothing(tmp_path):
    """One worker sends no byte: the bytes plot is drawn on a linear axis at 0 and says
    why (a log axis with no positive value failed to draw: `shoal-run --workers 1`)."""
    records = [
        {**r, "mb_sent": 0.0} for r in seeded_records(names=("diloco", "muloco"), seeds=(0,))
    ]
    fig = report.plot_loss(tmp_path / "loss.png", records, "mb_sent", "MB sent")
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert {ax.get_xscale() for ax in fig.axes} == {"linear"}
    assert "no run sent any bytes" in fig.axes[-1].get_xlabel()


def seeded_records(names=SEEDED, seeds=SEEDS, steps=12, every=4) -> list[dict]:
    """Records of every entry and seed: loss (2 + i) / step times (1 + 0.05 seed),
    accuracy 0.5 + 0.02 i + 0.01 seed at every ``every`` steps, bfb_allreduce equal to
    ssgd (a twin)."""
    out = []
    for seed in seeds:
        for i, name in enumerate(names):
            k = 0 if name == "bfb_allreduce" else i
            for step in range(1, steps + 1):
                loss = (2 + k) / step * (1 + 0.05 * seed)
                r = {"algorithm": name, "seed": seed, "step": step, "loss": loss,
                     "mb_sent": 0.1 * step * (1 + k)}  # fmt: skip
                if step % every == 0:
                    r["test_loss"] = (1 + k) / step * (1 + 0.05 * seed)
                    r["test_accuracy"] = 0.5 + 0.02 * k + 0.01 * seed
                out.append(r)
    return out


def band_edges(ax, x: float) -> set[float]:
    """The y values of the shaded bands' outlines at ``x``."""
    ys = set()
    for coll in ax.collections:
        for path in coll.get_paths():
            v = path.vertices
            ys |= {round(float(y), 9) for y in v[np.isclose(v[:, 0], x), 1]}
    return ys


@pytest.mark.parametrize("x", ["step", "mb_sent"])
def test_seeds_are_mean_curves_in_bands(tmp_path, x):
    records = seeded_records()
    fig = report.plot_loss(tmp_path / "loss.png", records, x, x)
    entries = check_readable(fig)
    one_colour_per_algorithm(fig, entries, SEEDED)
    rows = row_entries(fig)
    assert [len(r) for r in rows] == [3, 6, 4]  # 8 at most, ssgd first in each
    assert all(r[0] == "ssgd" for r in rows)
    assert "bfb_allreduce (same curve as ssgd)" in rows[0]
    for legend in legends(fig):
        assert legend.get_title().get_text().endswith("(mean ± std over 3 seeds)")
    # test loss of gtc (i = 1) at step 8: (1 + 1) / 8 * (1, 1.05, 1.1) -> mean ± std
    values = np.array([2 / 8 * (1 + 0.05 * s) for s in SEEDS])
    ax_test = fig.axes[3]  # second row (compressed), test loss
    (line,) = [ln for ln in ax_test.get_lines() if ln.get_label() == "gtc test loss"]
    at = 8 if x == "step" else 0.1 * 8 * 2
    i = int(np.flatnonzero(np.isclose(line.get_xdata(), at))[0])
    assert line.get_ydata()[i] == pytest.approx(values.mean())
    std = values.std(ddof=1)
    assert {round(values.mean() - std, 9), round(values.mean() + std, 9)} <= band_edges(ax_test, at)
    # lines drawn per panel: each entry's mean, train and test (and the faint raw train)
    for ax in fig.axes:
        means = [ln for ln in ax.get_lines() if ln.get_zorder() > 1]
        assert len(means) <= report.PER_PANEL
    # the same colour in the accuracy plot, in percent, with bands
    acc = report.plot_accuracy(tmp_path / "acc.png", records)
    acc_entries = check_readable(acc)
    assert all(acc_entries[k] == entries[k] for k in SEEDED if k in acc_entries)
    (gtc,) = [ln for ln in acc.axes[1].get_lines() if ln.get_label() == "gtc"]
    np.testing.assert_allclose(gtc.get_ydata(), 100 * np.mean([0.52 + 0.01 * s for s in SEEDS]))
    assert acc.axes[1].collections  # the band


def test_one_seed_draws_no_band(tmp_path):
    records = seeded_records(seeds=(0,))
    fig = report.plot_loss(tmp_path / "loss.png", records, "step", "step")
    check_readable(fig)
    assert not any(ax.collections for ax in fig.axes)
    assert all(lg.get_title().get_text().endswith("(1 seed)") for lg in legends(fig))


def test_samples_plot_shows_lamb_and_onebit_lamb_only(tmp_path):
    records = seeded_records()
    cfg = Config(algorithms=SEEDED, workers=4, batch_size=8, steps=12)
    pair = ("lamb", SimpleNamespace(label="onebit_lamb", warmup=lambda: 3))
    fig = report.plot_test_vs_samples(tmp_path / "s.png", cfg, records, pair)
    entries = check_readable(fig)
    assert list(entries) == ["lamb", "onebit_lamb", "1-bit LAMB freeze step (3)"]
    colors = report.algorithm_colors(list(dict.fromkeys(r["algorithm"] for r in records)))
    assert entries["lamb"] == colors["lamb"] and entries["onebit_lamb"] == colors["onebit_lamb"]
    (lamb,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == "lamb"]
    np.testing.assert_allclose(lamb.get_xdata(), [4 * 4 * 8, 8 * 4 * 8, 12 * 4 * 8])


def test_twins_need_every_panel_to_coincide():
    a = ([1, 2, 3], [1.0, 0.5, 0.25])
    b = ([1, 2, 3], [1.0, 0.5, 0.3])
    assert report.twins({"x": a, "y": a, "z": b}) == {"y": "x"}
    assert report.twins({"x": a, "y": a}, {"x": a, "y": b}) == {}
    assert report.twins({"x": a, "y": a, "z": a}) == {"y": "x", "z": "x"}


@pytest.mark.parametrize(
    ("ratio", "words"),
    [
        (5.6, "5.6x fewer bytes"),
        (1.5, "1.50x fewer bytes"),
        (1.0009, "same bytes"),
        (0.996, "same bytes"),
        (1 / 1.01, "1.01x more bytes"),
        (0.25, "4.0x more bytes"),
        (float("inf"), "infinitely fewer bytes"),
    ],
)
def test_ratio_phrase(ratio, words):
    assert report.ratio_phrase(ratio, "fewer bytes", "more bytes", "same bytes") == words


def test_guide_phrases_ratios_near_one():
    base = {"algorithm": "ssgd", "test_accuracy": 0.84, "mb_sent": 9.692, "projected_ms": 8.0}
    bfb = {"algorithm": "bfb_allreduce", "test_accuracy": 0.84, "mb_sent": 9.701,
           "projected_ms": 8.06}  # fmt: skip
    text = report.guide([base, bfb])
    assert (
        "`bfb_allreduce`: +0.0 points of accuracy, same bytes, 1.01x slower projected step" in text
    )
    assert "1.0x" not in text and "0.99x" not in text


def test_log_field_is_validated():
    cfg = load_config(QUICKSTART)
    with pytest.raises(ConfigError, match="bad value for log: 'mlflow'"):
        apply_overrides(cfg, ["log=mlflow"])
    with pytest.raises(ConfigError, match="'log' must be"):
        dataclasses.replace(cfg, log="mlflow")


def test_log_tensorboard_without_the_package_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if not installed
    with pytest.raises(
        ConfigError,
        match=r"tensorboardX \(from shoal's clone: pip install -e '\.\[tensorboard\]'\)",
    ):
        apply_overrides(load_config(QUICKSTART), ["log=tensorboard"])
    with pytest.raises(ImportError, match=r"pip install tensorboardX"):
        report.write_tensorboard(tmp_path, [])


def read_events(path: Path):
    """The records of a TFRecord file: u64 length, u32 crc, data, u32 crc."""
    from tensorboardX.proto import event_pb2

    data, events, i = path.read_bytes(), [], 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i : i + 8])
        events.append(event_pb2.Event.FromString(data[i + 12 : i + 12 + n]))
        i += 12 + n + 4
    return events


def test_tensorboard_events(run, tmp_path):
    pytest.importorskip("tensorboardX")
    _, records = run
    report.write_tensorboard(tmp_path / "tb", records)
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == sorted(ALGORITHMS)
    for name in ALGORITHMS:
        (path,) = (tmp_path / "tb" / name).glob("events.out.tfevents.*")
        scalars = {}
        for e in read_events(path):
            for v in e.summary.value:
                if v.HasField("simple_value"):
                    scalars.setdefault(v.tag, []).append((e.step, v.simple_value))
        rows = [r for r in records if r["algorithm"] == name]
        want = [(r["step"], r["loss"]) for r in rows]
        got = scalars["loss/train"]
        assert [s for s, _ in got] == [s for s, _ in want]
        np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-6)
        assert [s for s, _ in scalars["accuracy/test"]] == [4, 8]
        assert scalars["wire/mb_sent"][-1][1] == pytest.approx(rows[-1]["mb_sent"], rel=1e-6)
