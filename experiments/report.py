"""Run outputs: ``metrics.jsonl``, ``metrics.csv``, loss plots, ``summary.md``,
``report.md`` and ``timing.jsonl`` (wall-clock seconds per step, kept apart from the
deterministic metrics)."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from shoal.experiments import algorithms
from shoal.experiments.config import flatten

COLUMNS = (
    "algorithm",
    "step",
    "loss",
    "test_loss",
    "test_accuracy",
    "bytes_sent",
    "bytes_received",
    "mb_sent",
    "mb_received",
    "density",
    "noise_scale",
    "policy",
    "skipped",
)
# (summary key, table header, format)
SUMMARY_COLUMNS = (
    ("algorithm", "algorithm", "{}"),
    ("steps", "steps", "{}"),
    ("loss", "train loss", "{:.4f}"),
    ("test_loss", "test loss", "{:.4f}"),
    ("test_accuracy", "test acc", "{:.2%}"),
    ("test_error", "test error", "{:.2%}"),
    ("mb_sent", "MB sent/worker", "{:.3f}"),
    ("mb_received", "MB recv/worker", "{:.3f}"),
    ("peak_kb_sent", "peak kB sent/step", "{:.1f}"),
    ("density", "sent/elements", "{:.2%}"),
    ("projected_ms", "projected step ms", "{:.2f}"),
    ("skipped", "skipped steps", "{}"),
    ("wall_s", "wall s", "{:.1f}"),
)
# Shown only when some run has them.
OPTIONAL_COLUMNS = ("projected_ms", "skipped", "peak_kb_sent")
PLOTS = ("loss_vs_step.png", "loss_vs_mb.png", "accuracy_vs_step.png")
SAMPLES_PLOT = "test_loss_vs_samples.png"  # with a LAMB / 1-bit LAMB pair


def summary_table(summaries: Sequence[dict[str, Any]]) -> str:
    """A markdown table, one row per algorithm."""
    columns = [
        c
        for c in SUMMARY_COLUMNS
        if c[0] not in OPTIONAL_COLUMNS or any(s.get(c[0]) is not None for s in summaries)
    ]
    lines = [
        "| " + " | ".join(h for _, h, _ in columns) + " |",
        "|" + "|".join("---" if k == "algorithm" else "---:" for k, _, _ in columns) + "|",
    ]
    for s in summaries:
        cells = ("-" if s.get(k) is None else f.format(s[k]) for k, _, f in columns)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_jsonl(path: Path, records: Sequence[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def write_csv(path: Path, records: Sequence[dict[str, Any]]) -> None:
    # Eval columns stay empty on steps without an evaluation.
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, restval="")
        w.writeheader()
        w.writerows(records)


# Coincident curves (e.g. ssgd and bfb, which reduce the same gradient) would hide one
# another: the later ones are drawn on top with these (linestyle, marker) pairs and say
# which curve they follow in the legend.
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


def policy_section(records: Sequence[dict[str, Any]]) -> str:
    """The changes closed-loop policies made, if any."""
    changes = [r for r in records if "policy" in r]
    if not changes:
        return ""
    lines = [f"- `{r['algorithm']}` after step {r['step']}: `{r['policy']}`" for r in changes]
    return "\n## Policy changes\n\n" + "\n".join(lines) + "\n"


def ratio_phrase(ratio: float, better: str, worse: str, same: str) -> str:
    """``ratio`` (baseline / this run, > 1 is better) in words: ``"3.1x fewer bytes"``,
    ``"1.01x slower projected step"``, or ``same`` when it rounds to 1.00x either way."""
    if math.isinf(ratio):
        return f"infinitely {better}"
    up = ratio if ratio >= 1 else 1 / ratio
    if f"{up:.2f}" == "1.00":
        return same
    text = f"{up:.2f}x" if up < 1.995 else f"{up:.1f}x"
    return f"{text} {better if ratio >= 1 else worse}"


def guide(summaries: Sequence[dict[str, Any]]) -> str:
    """Each run against ``ssgd`` (when present): accuracy difference, bytes and projected
    speed-up, best trade-offs first (the runs within one point of S-SGD's accuracy, by
    bytes)."""
    base = next((s for s in summaries if s["algorithm"] == "ssgd"), None)
    if base is None or len(summaries) < 2:
        return ""
    rows = []
    for s in summaries:
        if s is base:
            continue
        acc = 100 * (s["test_accuracy"] - base["test_accuracy"])
        less = base["mb_sent"] / s["mb_sent"] if s["mb_sent"] else float("inf")
        if s["mb_sent"]:
            sent = ratio_phrase(less, "fewer bytes", "more bytes", "same bytes")
        else:
            sent = "no bytes sent"
        line = f"`{s['algorithm']}`: {acc:+.1f} points of accuracy, {sent}"
        if s.get("projected_ms") and base.get("projected_ms"):
            line += ", " + ratio_phrase(
                base["projected_ms"] / s["projected_ms"],
                "faster projected step",
                "slower projected step",
                "same projected step time",
            )
        rows.append((acc < -1.0, -less, line))
    rows.sort()
    close = [r for r in rows if not r[0]]
    text = ["Against `ssgd` in this run (within one point of its accuracy first, by bytes):", ""]
    text += [f"- {line}" for _, _, line in close]
    if len(close) < len(rows):
        text += ["", "Further than one point below `ssgd`:", ""]
        text += [f"- {line}" for bad, _, line in rows if bad]
    return "\n".join(text) + "\n"


def write_report(path: Path, cfg: Any, summaries: Sequence[dict[str, Any]], *, command: str,
                 extra: str = "") -> None:  # fmt: skip
    """The one-page report: the table, the plots, the comparison with S-SGD."""
    text = f"""# {cfg.name}: report

`{command}`: {cfg.workers} workers, {cfg.steps} steps.

{summary_table(summaries)}

{guide(summaries)}
![loss vs step]({PLOTS[0]})
![test accuracy vs step]({PLOTS[2]})
![loss vs MB sent]({PLOTS[1]})
{extra}
Details, the config and per-step metrics: `summary.md`, `metrics.jsonl`.
"""
    path.write_text(text)


def projection_section(cfg: Any, summaries: Sequence[dict[str, Any]]) -> str:
    """How the projected step time was made, with each run's split and speed-up."""
    rows = [s for s in summaries if s.get("projected_ms") is not None]
    if not rows:
        return ""
    from shoal.experiments.projection import describe

    base = next((s for s in rows if s["algorithm"] == "ssgd"), None)
    lines = [
        "| algorithm | compute ms | communication ms | step ms | speed-up vs ssgd |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in rows:
        up = f"{base['projected_ms'] / s['projected_ms']:.2f}x" if base else "-"
        cells = (s["algorithm"], f"{s['compute_ms']:.3f}", f"{s['projected_comm_ms']:.2f}",
                 f"{s['projected_ms']:.2f}", up)  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return f"""
## Projected to a cluster

Step time on {describe(cfg)} (`shoal.comms.costmodel`): every step's collectives replayed
for that many workers (`shoal.comms.record_events`) and timed with the alpha-beta model,
plus one worker's forward and backward pass measured on this machine, with no overlap.

{chr(10).join(lines)}
"""


def onebit_pair(cfg: Any) -> tuple[str, str] | None:
    """The first ``lamb`` and ``onebit_lamb`` entries of ``cfg.algorithms``, if both exist."""
    first = {}
    for entry in cfg.algorithms:
        first.setdefault(algorithms.parse_entry(entry)[0], entry)
    if "lamb" in first and "onebit_lamb" in first:
        return first["lamb"], first["onebit_lamb"]
    return None


def volume_reduction(warmup_fraction: float, bits: int) -> float:
    """Li et al. (2021), section 5: end-to-end communication volume reduction of 1-bit
    LAMB over dense ``bits``-bit all-reduce with a warm-up fraction ``w`` of the steps,
    ``1 / (w + (1 - w) / bits)``."""
    w = warmup_fraction
    return 1.0 / (w + (1.0 - w) / bits)


def samples(cfg: Any, step: int) -> int:
    """Training examples consumed by all workers up to ``step``."""
    return step * cfg.workers * cfg.batch_size


def plot_test_vs_samples(path: Path, cfg: Any, records: Sequence[dict[str, Any]]) -> None:
    """Test (validation) loss against the examples seen, one line per algorithm."""
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.subplots()
    for i, name in enumerate(dict.fromkeys(r["algorithm"] for r in records)):
        ev = [r for r in records if r["algorithm"] == name and "test_loss" in r]
        ax.plot([samples(cfg, r["step"]) for r in ev], [r["test_loss"] for r in ev], "o-",
                color=f"C{i}", ms=3, label=name)  # fmt: skip
    pair = onebit_pair(cfg)
    if pair is not None:
        freeze = algorithms.freeze_step(algorithms.entry_config(pair[1], cfg))
        ax.axvline(samples(cfg, freeze), color="grey", ls=":", label="1-bit LAMB freeze step")
    unit = f" (windows of {cfg.seq_len} bytes)" if getattr(cfg, "task", None) == "lm" else ""
    ax.set_xlabel(f"training samples{unit}")
    ax.set_ylabel("validation loss (nats per byte)" if unit else "test loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)


def onebit_section(
    cfg: Any, records: Sequence[dict[str, Any]], summaries: Sequence[dict[str, Any]]
) -> str:
    """Markdown comparing the ``lamb`` and ``onebit_lamb`` entries (see `onebit_pair`):
    final test loss and gap, MB sent per worker, and the measured volume reduction next
    to the paper's formula (`volume_reduction`). Empty without such a pair."""
    pair = onebit_pair(cfg)
    if pair is None:
        return ""
    by_name = {s["algorithm"]: s for s in summaries}
    base, one = by_name[pair[0]], by_name[pair[1]]
    sub = algorithms.entry_config(pair[1], cfg)
    freeze, steps = algorithms.freeze_step(sub), sub.steps
    w = freeze / steps
    rows = [r for r in records if r["algorithm"] == pair[1]]
    warm_bytes, comp_bytes = rows[0]["bytes_sent"], rows[-1]["bytes_sent"]
    measured = base["mb_sent"] / one["mb_sent"]
    gap = one["test_loss"] - base["test_loss"]
    lm = getattr(cfg, "task", None) == "lm"
    what = "validation loss (nats per byte)" if lm else "test loss"
    bpb = lambda s: f" ({s['test_loss'] / math.log(2):.4f} bits per byte)" if lm else ""
    return f"""
## LAMB vs 1-bit LAMB

Same initial model and batches; 1-bit LAMB runs the LAMB rule on dense all-reduced
gradients for its first {freeze} of {steps} steps (warm-up fraction w = {w:.3f}), then
sends its momentum through the 1-bit compressed all-reduce. `{pair[0]}` is that warm-up
rule for all {steps} steps.

| | `{pair[0]}` | `{pair[1]}` |
|---|---:|---:|
| final {what} | {base["test_loss"]:.4f}{bpb(base)} | {one["test_loss"]:.4f}{bpb(one)} |
| MB sent per worker | {base["mb_sent"]:.3f} | {one["mb_sent"]:.3f} |

- Gap (1-bit LAMB - LAMB) in final {what}: {gap:+.4f} ({gap / base["test_loss"]:+.2%}).
- Bytes sent per worker and step by 1-bit LAMB: {warm_bytes:,} in warm-up (float32 ring
  all-reduce), {comp_bytes:,} compressed: {warm_bytes / comp_bytes:.1f}x fewer per step.
- End-to-end volume reduction, measured (LAMB MB / 1-bit LAMB MB): **{measured:.2f}x**.
  The paper's formula 1 / (w + (1 - w) / 32) for a float32 all-reduce:
  **{volume_reduction(w, 32):.2f}x**; for reference, against an fp16 all-reduce as in the
  paper, 1 / (w + (1 - w) / 16) = {volume_reduction(w, 16):.2f}x. (The formula counts one
  bit per element; the measured figure also pays the padding and the per-chunk scales.)

![test loss vs samples]({SAMPLES_PLOT})
"""


def write_summary(
    path: Path,
    cfg: Any,
    summaries: Sequence[dict[str, Any]],
    *,
    backend: str,
    command: str,
    extra: str = "",
) -> None:
    config_rows = "\n".join(f"| `{k}` | `{v}` |" for k, v in flatten(cfg))
    error_note = {
        "hmm": "; the frame error",
        "lm": "; the next-byte error, on the validation files",
    }
    error_note = error_note.get(getattr(cfg, "task", None), "")
    text = f"""# {cfg.name}

`{command}`: backend `{backend}`, {cfg.workers} workers.

## Results

{summary_table(summaries)}

Train loss: mean over workers of their local batch losses at the last step. Test loss,
accuracy and error (1 - accuracy{error_note}): the
worker-averaged parameters after the last step (for BMUF and BMUF_GTC the global model
of the last BMUF step, which is the last step). MB: 10^6 bytes put on
(taken off) the wire per worker in the whole run, mean over workers: every step's
`shoal.comms.wire_bytes(state, "step")`, summed exactly. Wall time includes compilation.

![loss vs step]({PLOTS[0]})
![loss vs MB sent]({PLOTS[1]})
![test accuracy vs step]({PLOTS[2]})

Per-step metrics: `metrics.jsonl`, `metrics.csv`.
{extra}
## Config

| key | value |
|---|---|
{config_rows}
"""
    path.write_text(text)


TENSORBOARD = "tensorboard"
# metrics.jsonl key -> TensorBoard tag (grouped by the part before "/").
TENSORBOARD_TAGS = {
    "loss": "loss/train",
    "test_loss": "loss/test",
    "test_accuracy": "accuracy/test",
    "mb_sent": "wire/mb_sent",
    "mb_received": "wire/mb_received",
    "density": "wire/density",
    "noise_scale": "noise_scale",
    "skipped": "skipped",
}


def write_tensorboard(folder: Path, records: Sequence[dict[str, Any]]) -> None:
    """TensorBoard event files from the run's records: one run (subfolder) per algorithm,
    so TensorBoard overlays the algorithms; the scalars of `TENSORBOARD_TAGS` at each
    record's step and the policy changes as text. Needs ``tensorboardX`` (the
    ``tensorboard`` extra)."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ImportError(
            "log=tensorboard needs the tensorboardX package: pip install 'shoal[tensorboard]'"
        ) from None
    for name in dict.fromkeys(r["algorithm"] for r in records):
        with SummaryWriter(str(folder / name)) as w:
            for r in records:
                if r["algorithm"] != name:
                    continue
                for key, tag in TENSORBOARD_TAGS.items():
                    if r.get(key) is not None:
                        w.add_scalar(tag, r[key], r["step"])
                if "policy" in r:
                    w.add_text("policy", r["policy"], r["step"])


def write_run(
    out: Path,
    cfg: Any,
    records: Sequence[dict[str, Any]],
    summaries: Sequence[dict[str, Any]],
    *,
    backend: str,
    command: str,
    task: Any = None,
) -> list[Path]:
    """Write every output file of a run into ``out``; returns their paths. With a
    ``lamb`` and ``onebit_lamb`` entry, the summary gains `onebit_section` and its plot;
    a ``task`` with ``corpus_info()`` adds a data section."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / n for n in ("metrics.jsonl", "metrics.csv", *PLOTS, "summary.md")]
    paths.append(out / "report.md")
    # Wall-clock times go to their own file, so that metrics.jsonl of two runs of one
    # config and seed are byte for byte the same (RELIABILITY.md, determinism).
    timing = [{k: r[k] for k in ("algorithm", "step", "time_s") if k in r} for r in records]
    records = [{k: v for k, v in r.items() if k != "time_s"} for r in records]
    write_jsonl(paths[0], records)
    write_csv(paths[1], records)
    plot_loss(paths[2], records, "step", "step")
    plot_loss(paths[3], records, "mb_sent", "MB sent per worker (cumulative)")
    plot_accuracy(paths[4], records)
    onebit = onebit_section(cfg, records, summaries)
    extra = policy_section(records) + projection_section(cfg, summaries) + onebit
    if onebit:  # the section shows this plot
        paths.append(out / SAMPLES_PLOT)
        plot_test_vs_samples(paths[-1], cfg, records)
    info = getattr(task, "corpus_info", None)
    if info is not None:
        extra += "\n## Data\n\n" + "\n".join(f"- {k}: {v}" for k, v in info().items()) + "\n"
    write_summary(paths[5], cfg, summaries, backend=backend, command=command, extra=extra)
    write_report(paths[6], cfg, summaries, command=command,
                 extra=projection_section(cfg, summaries))  # fmt: skip
    paths.append(out / "timing.jsonl")
    write_jsonl(paths[-1], timing)
    if getattr(cfg, "log", "none") == "tensorboard":
        paths.append(out / TENSORBOARD)
        write_tensorboard(paths[-1], records)
    return paths
