"""Run outputs: ``metrics.jsonl``, ``metrics.csv``, loss plots and ``summary.md``."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

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
    "time_s",
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
    ("wall_s", "wall s", "{:.1f}"),
)
PLOTS = ("loss_vs_step.png", "loss_vs_mb.png")


def summary_table(summaries: Sequence[dict[str, Any]]) -> str:
    """A markdown table, one row per algorithm."""
    lines = [
        "| " + " | ".join(h for _, h, _ in SUMMARY_COLUMNS) + " |",
        "|" + "|".join("---" if k == "algorithm" else "---:" for k, _, _ in SUMMARY_COLUMNS) + "|",
    ]
    for s in summaries:
        cells = ("-" if s.get(k) is None else f.format(s[k]) for k, _, f in SUMMARY_COLUMNS)
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


def write_summary(
    path: Path, cfg: Any, summaries: Sequence[dict[str, Any]], *, backend: str, command: str
) -> None:
    config_rows = "\n".join(f"| `{k}` | `{v}` |" for k, v in flatten(cfg))
    error_note = "; the frame error" if getattr(cfg, "task", None) == "hmm" else ""
    text = f"""# {cfg.name}

`{command}`: backend `{backend}`, {cfg.workers} workers.

## Results

{summary_table(summaries)}

Train loss: mean over workers of their local batch losses at the last step. Test loss,
accuracy and error (1 - accuracy{error_note}): the
worker-averaged parameters after the last step (for BMUF and BMUF_GTC the global model
of the last BMUF step, which is the last step). MB: 10^6 bytes put on
(taken off) the wire per worker, mean over workers, as counted by
`shoal.comms.wire_bytes`. Wall time includes compilation.

![loss vs step]({PLOTS[0]})
![loss vs MB sent]({PLOTS[1]})

Per-step metrics: `metrics.jsonl`, `metrics.csv`.

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
) -> list[Path]:
    """Write every output file of a run into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / n for n in ("metrics.jsonl", "metrics.csv", *PLOTS, "summary.md")]
    write_jsonl(paths[0], records)
    write_csv(paths[1], records)
    plot_loss(paths[2], records, "step", "step")
    plot_loss(paths[3], records, "mb_sent", "MB sent per worker (cumulative)")
    write_summary(paths[4], cfg, summaries, backend=backend, command=command)
    return paths
