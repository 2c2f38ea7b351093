"""The run's plots: loss against steps and bytes, accuracy, and test loss against the
examples seen (LAMB and 1-bit LAMB only). Each family of algorithms has its own row of
panels beside the reference (`facets`), every entry one colour in all of them
(`algorithm_colors`); with several seeds an entry is its mean curve over the seeds in a
band of one sample standard deviation either side (`shoal.experiments.reports.seeds`)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from shoal.experiments import algorithms
from shoal.experiments.reports.panels import algorithm_colors, facets
from shoal.experiments.reports.seeds import Band, band

PLOTS = ("loss_vs_step.png", "loss_vs_mb.png", "accuracy_vs_step.png")
CLOCK_PLOTS = ("loss_vs_sim_time.png", "timeline.png")  # with a simulated clock (speeds)
SAMPLES_PLOT = "test_loss_vs_samples.png"  # with a LAMB / 1-bit LAMB pair


TWIN_STYLES = (("--", "x"), (":", "+"), ("-.", "s"), ((0, (1, 3)), "^"))
# Each row's legend right of its last panel, outside the axes: never over the curves.
LEGEND = dict(loc="upper left", bbox_to_anchor=(1.03, 1.0), borderaxespad=0.0,
              fontsize="small", title_fontsize="small", alignment="left")  # fmt: skip
BAND_ALPHA = 0.2
ROW_HEIGHT = 3.3  # inches per row of panels


def spread_words(bands: Sequence[Band]) -> str:
    """How the curves were made from the seeds: ``"1 seed"``, or ``"mean ± std over 3
    seeds"`` (``"2-3 seeds"`` when entries have different counts)."""
    counts = sorted({b.n for b in bands if b.n})
    if not counts or counts == [1]:
        return "1 seed"
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"mean ± std over {n} seeds"


def legend_title(title: str, bands: Sequence[Band]) -> str:
    """A row's legend title: its family (`facets`) wrapped, then `spread_words`."""
    lines = textwrap.wrap(title, 34, break_on_hyphens=False) if title else ["algorithm"]
    return "\n".join([*lines, f"({spread_words(bands)})"])


def _fill(ax, b: Band, color: str, keep: np.ndarray | None = None) -> None:
    """The band mean ± std of ``b`` (nothing with one seed)."""
    if b.std is None:
        return
    keep = slice(None) if keep is None else keep
    lo, hi = b.mean - b.std, b.mean + b.std
    ax.fill_between(b.x[keep], lo[keep], hi[keep], color=color, alpha=BAND_ALPHA, lw=0,
                    zorder=1)  # fmt: skip


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


def _curve(b: Band, keep: np.ndarray) -> Curve:
    return list(b.x[keep]), list(b.mean[keep])


def plot_loss(
    path: Path,
    records: Sequence[dict[str, Any]],
    x: str,
    xlabel: str,
    log_x: bool | None = None,
) -> Figure:
    """Train loss (a moving average over about a twentieth of the run, every step faint
    behind it) and test loss at every evaluation against ``x``: one row of two panels
    per family (`facets`), the reference in each, one colour per entry, each row's legend
    outside its panels. With several seeds, the mean over the seeds in a band of ± one
    sample std (of the moving averages, for train loss). Bytes (``x`` other than
    ``step``) are on a log axis spanning `BYTE_DECADES` decades: steps at 0 bytes cannot be
    shown there and are left out, the axis label says so. ``log_x`` False: a linear axis
    (the simulated clock's seconds)."""
    names = list(dict.fromkeys(r["algorithm"] for r in records))
    colors = algorithm_colors(names)
    log_x = x != "step" if log_x is None else log_x
    longest = max(len({r["step"] for r in records if r["algorithm"] == n}) for n in names)
    window = max(1, round(longest / 20))
    smooth = lambda ys: moving_average(ys, window)  # noqa: E731
    raw = {n: band(records, n, "loss", x) for n in names}
    train = {n: band(records, n, "loss", x, per_seed=smooth) for n in names}
    test = {n: band(records, n, "test_loss", x) for n in names}
    # No run sent a byte (one worker): nothing to put on a log axis, which would fail to
    # draw. The runs stand at 0 on a linear one, and the label says why.
    silent = log_x and not any((b.x > 0).any() for b in raw.values())
    if silent:
        log_x, xlabel = False, xlabel + "\n(no run sent any bytes)"
    # On a log axis, the points at 0 bytes are left out.
    shown = lambda b: b.x > 0 if log_x else np.ones(len(b.x), bool)  # noqa: E731
    zero = any(not shown(b).all() for b in (*raw.values(), *test.values()))
    # A diverged run (loss far above every run's start) would flatten all the others
    # against the bottom: cap the axis at twice the highest starting loss, and say so.
    start = max((b.mean[0] for b in train.values() if len(b.mean)), default=1.0)
    cap = 2 * start
    high = {n: np.nanmax([*raw[n].mean, *test[n].mean, -np.inf]) for n in names}
    off = {n for n in names if high[n] > cap}
    panels = facets(names)
    fig = Figure(figsize=(11.5, 0.7 + ROW_HEIGHT * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 2, sharey=True, sharex=True, squeeze=False)
    for (title, members), (ax_train, ax_test) in zip(panels, axes, strict=True):
        keep = {n: shown(train[n]) for n in members}
        keep_test = {n: shown(test[n]) for n in members}
        found = twins(
            {n: _curve(train[n], keep[n]) for n in members},
            {n: _curve(test[n], keep_test[n]) for n in members},
        )
        styles = _styles(members, found)
        handles = []
        for name in members:
            ls, marker = styles[name]
            color, z = colors[name], 3 if name in found else 2
            label = _label(name, found)
            if name in off:
                label += f"\n  (diverged, off the scale: max {high[name]:.3g})"
            if log_x and not keep[name].any():
                label += " (no bytes sent: not shown)"
            r = raw[name]
            k = shown(r)
            ax_train.plot(r.x[k], r.mean[k], color=color, lw=0.6, alpha=0.15, zorder=1,
                          label=f"{name} train loss, every step")  # fmt: skip
            if name not in found:  # a twin's band is its first's: drawn once
                _fill(ax_train, train[name], color, keep[name])
            (line,) = ax_train.plot(*_curve(train[name], keep[name]), color=color, ls=ls,
                                    lw=1.4, zorder=z, marker=marker, ms=5, label=label,
                                    markevery=max(1, int(keep[name].sum()) // 12))  # fmt: skip
            handles.append(line)
            if name not in found:
                _fill(ax_test, test[name], color, keep_test[name])
            ax_test.plot(*_curve(test[name], keep_test[name]), color=color, ls=ls, lw=1.2,
                         zorder=z, marker=marker or "o", ms=5 if marker else 3.5,
                         label=f"{name} test loss")  # fmt: skip
        ax_test.legend(handles=handles, title=legend_title(title, [train[n] for n in members]),
                       **LEGEND)  # fmt: skip
        ax_train.set_ylabel("cross-entropy loss")
    unit = "steps" if window > 1 else "step"
    axes[0, 0].set_title(f"train loss (mean of the last {window} {unit})", fontsize="medium")
    axes[0, 1].set_title("test loss (averaged model, every evaluation)", fontsize="medium")
    note = ""
    if log_x:
        tops = [b.x[shown(b)].max() for b in raw.values() if shown(b).any()]
        lows = [b.x[shown(b)].min() for b in raw.values() if shown(b).any()]
        top = max(tops, default=1.0)
        left = 10 ** math.ceil(math.log10(top) - BYTE_DECADES)
        # ... but every run's last decade stays in view, however few bytes it sent
        left = min(left, 10 ** math.floor(math.log10(min(tops, default=top))))
        if min(lows, default=top) < left:
            axes[0, 1].set_xlim(left=left)
            note = f"\n(log scale from {left:g} MB"
            note += "; 0 bytes not shown)" if zero else ")"
        elif zero:
            note = "\n(log scale: steps at 0 bytes not shown)"
    for ax in axes.flat:
        if log_x:
            ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel(xlabel + note)
    if off:
        axes[0, 0].set_ylim(top=cap)
    fig.savefig(path, dpi=120)
    return fig


def _switches(records: Sequence[dict[str, Any]]) -> dict[tuple[str, int, str], list[Any]]:
    """(entry, step, change) -> the seeds in which a policy made that change."""
    found: dict[tuple[str, int, str], list[Any]] = {}
    for r in records:
        if "policy" in r:
            found.setdefault((r["algorithm"], r["step"], r["policy"]), []).append(r.get("seed"))
    return found


def plot_accuracy(path: Path, records: Sequence[dict[str, Any]]) -> Figure:
    """Test accuracy in percent at the evaluated steps, one panel per family (`facets`),
    the reference in each; with several seeds the mean over the seeds in a band of ± one
    sample std. A closed-loop policy's changes are dotted vertical lines in the entry's
    colour, labelled in the legend (with the seeds they happened in, when several)."""
    names = list(dict.fromkeys(r["algorithm"] for r in records))
    colors = algorithm_colors(names)
    curves = {n: band(records, n, "test_accuracy") for n in names}
    curves = {n: b._replace(mean=100 * b.mean, std=None if b.std is None else 100 * b.std)
              for n, b in curves.items()}  # fmt: skip
    several = len({r.get("seed") for r in records}) > 1
    panels = facets(names)
    fig = Figure(figsize=(9.6, 0.7 + ROW_HEIGHT * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    for (title, members), ax in zip(panels, axes, strict=True):
        every = {n: np.ones(len(curves[n].x), bool) for n in members}
        found = twins({n: _curve(curves[n], every[n]) for n in members})
        styles = _styles(members, found)
        for name in members:
            ls, marker = styles[name]
            if name not in found:  # a twin's band is its first's: drawn once
                _fill(ax, curves[name], colors[name])
            ax.plot(curves[name].x, curves[name].mean, color=colors[name], ls=ls,
                    marker=marker or "o", ms=5 if marker else 3.5, lw=1.2,
                    zorder=3 if name in found else 2, label=_label(name, found))  # fmt: skip
        for (name, step, change), seeds in _switches(records).items():
            if name not in members:
                continue
            where = f" (seed {', '.join(map(str, seeds))})" if several else ""
            ax.axvline(step, color=colors[name], ls=":", lw=1.8,
                       label=f"{name} switches after step {step}{where}: {change}")  # fmt: skip
        ax.set_ylabel("test accuracy (%)")
        ax.grid(True, alpha=0.3)
        ax.legend(handles=ax.get_lines(), title=legend_title(title, [curves[n] for n in members]),
                  **LEGEND)  # fmt: skip
    axes[-1].set_xlabel("step")
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
    path: Path, cfg: Any, records: Sequence[dict[str, Any]], pair: tuple[str, Any]
) -> Figure:
    """Test (validation) loss against the examples seen for the two entries of ``pair``
    (`onebit_pair`: LAMB and 1-bit LAMB) only, in their colours of the run's other plots,
    with a line at 1-bit LAMB's freeze step; with several seeds, the mean over the seeds
    in a band of ± one sample std."""
    names = list(dict.fromkeys(r["algorithm"] for r in records))
    colors = algorithm_colors(names)
    base, entry = pair
    fig = Figure(figsize=(7.6, 4.2), layout="constrained")
    ax = fig.subplots()
    bands = []
    for name in (base, entry.label):
        b = band(records, name, "test_loss")
        b = b._replace(x=np.array([samples(cfg, s) for s in b.x]))
        bands.append(b)
        _fill(ax, b, colors[name])
        ax.plot(b.x, b.mean, "o-", color=colors[name], ms=3, label=name)
    freeze = entry.warmup()
    ax.axvline(samples(cfg, freeze), color="grey", ls=":",
               label=f"1-bit LAMB freeze step ({freeze})")  # fmt: skip
    unit = f" (windows of {cfg.seq_len} bytes)" if getattr(cfg, "task", None) == "lm" else ""
    ax.set_xlabel(f"training samples{unit}")
    ax.set_ylabel("validation loss (nats per byte)" if unit else "test loss")
    ax.grid(True, alpha=0.3)
    ax.legend(title=legend_title("LAMB vs 1-bit LAMB", bands), **LEGEND)
    fig.savefig(path, dpi=120)
    return fig
