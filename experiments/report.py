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
    ("density", "sent/elements", "{:.2%}"),
    ("projected_ms", "projected step ms", "{:.2f}"),
    ("skipped", "skipped steps", "{}"),
    ("wall_s", "wall s", "{:.1f}"),
)
# Shown only when some run has them.
OPTIONAL_COLUMNS = ("projected_ms", "skipped")
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


def plot_loss(path: Path, records: Sequence[dict[str, Any]], x: str, xlabel: str) -> None:
    """Train loss (line) and test loss (markers) against ``x``, one colour per algorithm."""
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.subplots()
    for i, name in enumerate(dict.fromkeys(r["algorithm"] for r in records)):
        rows = [r for r in records if r["algorithm"] == name]
        color = f"C{i}"
        ax.plot([r[x] for r in rows], [r["loss"] for r in rows], color=color, lw=1,
                alpha=0.8, label=f"{name} train")  # fmt: skip
        ev = [r for r in rows if "test_loss" in r]
        ax.plot([r[x] for r in ev], [r["test_loss"] for r in ev], "o--", color=color, ms=4,
                label=f"{name} test")  # fmt: skip
    ax.set_xlabel(xlabel)
    ax.set_ylabel("cross-entropy loss")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)


def plot_accuracy(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """Test accuracy at the evaluated steps, one line per algorithm; a policy's changes
    are marked on its line."""
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.subplots()
    for i, name in enumerate(dict.fromkeys(r["algorithm"] for r in records)):
        rows = [r for r in records if r["algorithm"] == name]
        ev = [r for r in rows if "test_accuracy" in r]
        ax.plot([r["step"] for r in ev], [r["test_accuracy"] for r in ev], marker="o", ms=3,
                color=f"C{i % 10}", ls="-" if i < 10 else "--", label=name)  # fmt: skip
        for r in rows:
            if "policy" in r:
                ax.axvline(r["step"], color=f"C{i % 10}", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("test accuracy")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)


def policy_section(records: Sequence[dict[str, Any]]) -> str:
    """The changes closed-loop policies made, if any."""
    changes = [r for r in records if "policy" in r]
    if not changes:
        return ""
    lines = [f"- `{r['algorithm']}` after step {r['step']}: `{r['policy']}`" for r in changes]
    return "\n## Policy changes\n\n" + "\n".join(lines) + "\n"


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
        line = f"`{s['algorithm']}`: {acc:+.1f} points of accuracy, {less:.1f}x fewer bytes"
        if s.get("projected_ms") and base.get("projected_ms"):
            line += f", {base['projected_ms'] / s['projected_ms']:.1f}x faster projected step"
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
    return paths
