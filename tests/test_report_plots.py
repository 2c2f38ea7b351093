"""The run's plots are readable: legends outside the axes and inside the figure, every
line labelled, one colour per algorithm, coincident curves told apart, bytes on a log
axis; the report's wording of ratios near 1; the optional TensorBoard event files."""

from __future__ import annotations

import dataclasses
import json
import struct
import sys
from pathlib import Path

import harness
import numpy as np
import pytest
from harness import QUICKSTART
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from shoal.experiments import reports as report
from shoal.experiments.config import ConfigError
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


def check_readable(fig: Figure) -> dict[str, str]:
    """Asserts the layout properties; returns {label: colour} of the legend's entries."""
    FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    figure_box = fig.bbox
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    assert box.x0 >= figure_box.x0 - 1 and box.x1 <= figure_box.x1 + 1
    assert box.y0 >= figure_box.y0 - 1 and box.y1 <= figure_box.y1 + 1
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent(renderer)), "legend covers an axes"
        tight = ax.get_tightbbox(renderer)  # labels and titles too: nothing clipped
        assert tight.x0 >= -1 and tight.y0 >= -1
        assert tight.x1 <= figure_box.x1 + 1 and tight.y1 <= figure_box.y1 + 1
        for line in ax.get_lines():
            assert line.get_label() and not line.get_label().startswith("_"), line
    texts = [t.get_text() for t in legend.get_texts()]
    colors = [h.get_color() for h in legend.legend_handles]
    return dict(zip(texts, colors, strict=True))


def one_colour_per_algorithm(fig: Figure, entries: dict[str, str]) -> None:
    by_name = {label.split(" ")[0]: color for label, color in entries.items()}
    assert set(by_name) >= set(ALGORITHMS)
    assert len({by_name[a] for a in ALGORITHMS}) == len(ALGORITHMS)
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
    # One legend entry per algorithm (not train and test twice), the twin named.
    assert list(entries) == ["ssgd", "bmuf", "bfb_allreduce (same curve as ssgd)", "adaptive"]
    scales = {ax.get_xscale() for ax in fig.axes}
    assert scales == ({"log"} if x == "mb_sent" else {"linear"})
    if x == "mb_sent":  # no line passes a 0 to the log axis
        assert all(min(line.get_xdata(), default=1) > 0 for line in fig.axes[0].get_lines())
        assert "0 bytes not shown" in fig.axes[0].get_xlabel()
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
    (ax,) = fig.axes
    markers = {line.get_label(): line.get_marker() for line in ax.get_lines()}
    assert markers["bfb_allreduce (same curve as ssgd)"] != markers["ssgd"]


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
