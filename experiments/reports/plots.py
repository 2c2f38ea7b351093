"""The run's plots: loss against steps and bytes, accuracy, and test loss against the
examples seen (with a LAMB / 1-bit LAMB pair)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from shoal.experiments import algorithms

PLOTS = ("loss_vs_step.png", "loss_vs_mb.png", "accuracy_vs_step.png")
SAMPLES_PLOT = "test_loss_vs_samples.png"  # with a LAMB / 1-bit LAMB pair


TWIN_STYLES = (("--", "x"), (":", "+"), ("-.", "s"), ((0, (1, 3)), "^"))
LEGEND = dict(loc="outside right upper", fontsize="small", title="algorithm")


def algorithm_colors(names: Sequence[str]) -> dict[str, str]:
    """One colour per algorithm: tab10's for the first ten, then tab20's light shades
    (cycling past 20)."""
    tab20 = colormaps["tab20"]
    palette = [tab20(2 * i) for i in range(10)] + [tab20(2 * i + 1) for i in range(10)]
    return {name: to_hex(palette[i % 20]) for i, name in enumerate(names)}


Curve = tuple[list[float], list[float]]


def _same(a: Curve, b: Curve) -> bool:
    # Tolerances well below what a plot can show apart.
    return (
        len(a[0]) == len(b[0]) > 0
        and np.allclose(a[0], b[0], rtol=1e-3)
        and np.allclose(a[1], b[1], rtol=1e-3, atol=1e-4)
    )


def twins(*panels: dict[str, Curve]) -> dict[str, str]:
    """For each algorithm whose curves coincide in every panel with those of an earlier
    one, the name of that first algorithm."""
    names = list(panels[0])
    found: dict[str, str] = {}
    for i, name in enumerate(names):
        for first in names[:i]:
            if first not in found and all(_same(p[first], p[name]) for p in panels):
                found[name] = first
                break
    return found


def _styles(names: Sequence[str], found: dict[str, str]) -> dict[str, tuple[Any, Any]]:
    """(linestyle, marker) per algorithm, None for a marker meaning the default."""
    styles, seen = {}, {}
    for name in names:
        if name in found:
            k = seen[found[name]] = seen.get(found[name], 0) + 1
            styles[name] = TWIN_STYLES[(k - 1) % len(TWIN_STYLES)]
        else:
            styles[name] = ("-", None)
    return styles


def _label(name: str, found: dict[str, str]) -> str:
    shown = wrap_entry(name)
    return f"{shown} (same curve as {wrap_entry(found[name])})" if name in found else shown


def wrap_entry(name: str, width: int = 32) -> str:
    """A long registry entry over several lines, one override per line after the first
    (``streaming_diloco[a=1;b=2]`` -> ``streaming_diloco[a=1;`` / ``  b=2]``), so that a
    legend of long entries does not squeeze the axes beside it."""
    if len(name) <= width or "[" not in name:
        return name
    head, _, rest = name.partition("[")
    parts = rest.removesuffix("]").split(";")
    lines = [f"{head}[{parts[0]}"] + [f"  {p}" for p in parts[1:]]
    return ";\n".join(lines) + "]"


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    sums = np.cumsum(np.concatenate([[0.0], np.asarray(values, float)]))
    lo = np.maximum(np.arange(1, len(values) + 1) - window, 0)
    return list((sums[1:] - sums[lo]) / (np.arange(1, len(values) + 1) - lo))


# Decades of bytes shown on a log axis, below the largest count: per-step control bytes
# (e.g. BMUF's non-finite flag between its syncs) would otherwise stretch it to 1e-5 MB.
BYTE_DECADES = 3


def plot_loss(path: Path, records: Sequence[dict[str, Any]], x: str, xlabel: str) -> Figure:
    """Two panels against ``x``: train loss (a moving average over about a twentieth of
    the run, every step faint behind it) and test loss at every evaluation, one colour per
    algorithm, the legend outside the axes. Bytes (``x`` other than ``step``) are on a log
    axis spanning `BYTE_DECADES` decades: steps at 0 bytes cannot be shown there and are
    left out, the axis label says so."""
    names = list(dict.fromkeys(r["algorithm"] for r in records))
    colors = algorithm_colors(names)
    log_x = x != "step"
    train: dict[str, Curve] = {}
    raw: dict[str, Curve] = {}
    test: dict[str, Curve] = {}
    zero = False
    longest = max(sum(r["algorithm"] == n for r in records) for n in names)
    window = max(1, round(longest / 20))
    for name in names:
        rows = [r for r in records if r["algorithm"] == name]
        smooth = moving_average([r["loss"] for r in rows], window)
        keep = [i for i, r in enumerate(rows) if not log_x or r[x] > 0]
        zero |= len(keep) < len(rows)
        raw[name] = ([rows[i][x] for i in keep], [rows[i]["loss"] for i in keep])
        train[name] = (raw[name][0], [smooth[i] for i in keep])
        ev = [rows[i] for i in keep if "test_loss" in rows[i]]
        test[name] = ([r[x] for r in ev], [r["test_loss"] for r in ev])
    found = twins(train, test)
    styles = _styles(names, found)
    # A diverged run (loss far above every run's start) would flatten all the others
    # against the bottom: cap the axis at twice the highest starting loss, and say so.
    start = max((c[1][0] for c in train.values() if c[1]), default=1.0)
    cap = 2 * start
    off = {n for n in names if max(raw[n][1] + test[n][1], default=0) > cap}
    fig = Figure(figsize=(10.5, 4.4), layout="constrained")
    ax_train, ax_test = fig.subplots(1, 2, sharey=True, sharex=log_x)
    for name in names:
        ls, marker = styles[name]
        z = 3 if name in found else 2
        label = _label(name, found)
        if name in off:
            label += f"\n  (diverged, off the scale: max {max(raw[name][1] + test[name][1]):.3g})"
        if log_x and not train[name][0]:
            label += " (no bytes sent: not shown)"
        ax_train.plot(*raw[name], color=colors[name], lw=0.6, alpha=0.15, zorder=1,
                      label=f"{name} train loss, every step")  # fmt: skip
        ax_train.plot(*train[name], color=colors[name], ls=ls, lw=1.4, zorder=z,
                      marker=marker, markevery=max(1, len(train[name][0]) // 12), ms=5,
                      label=label)  # fmt: skip
        ax_test.plot(*test[name], color=colors[name], ls=ls, lw=1.2, zorder=z,
                     marker=marker or "o", ms=5 if marker else 3.5,
                     label=f"{name} test loss")  # fmt: skip
    unit = "steps" if window > 1 else "step"
    ax_train.set_title(f"train loss (mean of the last {window} {unit})", fontsize="medium")
    ax_test.set_title("test loss (averaged model, every evaluation)", fontsize="medium")
    note = ""
    if log_x:
        top = max((max(c[0]) for c in raw.values() if c[0]), default=1.0)
        low = min((min(c[0]) for c in raw.values() if c[0]), default=top)
        left = 10 ** math.ceil(math.log10(top) - BYTE_DECADES)
        # ... but every run's last decade stays in view, however few bytes it sent
        least = min((max(c[0]) for c in raw.values() if c[0]), default=top)
        left = min(left, 10 ** math.floor(math.log10(least)))
        if low < left:
            ax_test.set_xlim(left=left)
            note = f"\n(log scale from {left:g} MB"
            note += "; 0 bytes not shown)" if zero else ")"
        elif zero:
            note = "\n(log scale: steps at 0 bytes not shown)"
    for ax in (ax_train, ax_test):
        ax.set_xlabel(xlabel + note)
        if log_x:
            ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    ax_train.set_ylabel("cross-entropy loss")
    if off:
        ax_train.set_ylim(top=cap)
    handles = [h for h in ax_train.get_lines() if h.get_zorder() > 1]
    fig.legend(handles=handles, **LEGEND)
    fig.savefig(path, dpi=120)
    return fig


def plot_accuracy(path: Path, records: Sequence[dict[str, Any]]) -> Figure:
    """Test accuracy at the evaluated steps, one line per algorithm; a closed-loop
    policy's changes are dotted vertical lines in its colour, labelled in the legend."""
    names = list(dict.fromkeys(r["algorithm"] for r in records))
    colors = algorithm_colors(names)
    curves = {}
    for name in names:
        ev = [r for r in records if r["algorithm"] == name and "test_accuracy" in r]
        curves[name] = ([r["step"] for r in ev], [r["test_accuracy"] for r in ev])
    found = twins(curves)
    styles = _styles(names, found)
    fig = Figure(figsize=(8.4, 4.2), layout="constrained")
    ax = fig.subplots()
    for name in names:
        ls, marker = styles[name]
        ax.plot(*curves[name], color=colors[name], ls=ls, marker=marker or "o",
                ms=5 if marker else 3.5, lw=1.2, zorder=3 if name in found else 2,
                label=_label(name, found))  # fmt: skip
    for r in records:
        if "policy" in r:
            ax.axvline(r["step"], color=colors[r["algorithm"]], ls=":", lw=1.8,
                       label=f"{r['algorithm']} switches after step {r['step']}: "
                       f"{r['policy']}")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("test accuracy")
    ax.grid(True, alpha=0.3)
    fig.legend(handles=ax.get_lines(), **LEGEND)
    fig.savefig(path, dpi=120)
    return fig


def onebit_pair(entries: Sequence[algorithms.Entry]) -> tuple[str, algorithms.Entry] | None:
    """The first of the run's resolved ``entries`` whose algorithm ``compares_to`` another
    (1-bit LAMB: LAMB), with the first entry of that other one, if both exist:
    ``(base label, entry)``."""
    first = {}
    for e in entries:
        first.setdefault(e.name, e.label)
    for e in entries:
        base = e.algorithm.compares_to
        if base is not None and base in first:
            return first[base], e
    return None


def samples(cfg: Any, step: int) -> int:
    """Training examples consumed by all workers up to ``step``."""
    return step * cfg.workers * cfg.batch_size


def plot_test_vs_samples(
    path: Path, cfg: Any, records: Sequence[dict[str, Any]], pair: Any = None
) -> None:
    """Test (validation) loss against the examples seen, one line per algorithm; with
    ``pair`` (`onebit_pair`), a line at its freeze step."""
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.subplots()
    for i, name in enumerate(dict.fromkeys(r["algorithm"] for r in records)):
        ev = [r for r in records if r["algorithm"] == name and "test_loss" in r]
        ax.plot([samples(cfg, r["step"]) for r in ev], [r["test_loss"] for r in ev], "o-",
                color=f"C{i}", ms=3, label=name)  # fmt: skip
    if pair is not None:
        freeze = pair[1].warmup()
        ax.axvline(samples(cfg, freeze), color="grey", ls=":", label="1-bit LAMB freeze step")
    unit = f" (windows of {cfg.seq_len} bytes)" if getattr(cfg, "task", None) == "lm" else ""
    ax.set_xlabel(f"training samples{unit}")
    ax.set_ylabel("validation loss (nats per byte)" if unit else "test loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
