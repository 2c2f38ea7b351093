"""The simulated clock's timeline: what each worker did in a run's first rounds
(`shoal.experiments.runner.clock`): computing, communicating, or waiting for others."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from shoal.experiments.reports.seeds import by_entry

COLORS = {"compute": "#4477aa", "comm": "#ee7733", "idle": "#dddddd", "absent": "#aa3377"}
LABELS = {"compute": "compute", "comm": "communication", "idle": "waiting for others",
          "absent": "absent (churn)"}  # fmt: skip


def plot_timeline(path: Path, summaries: Sequence[dict[str, Any]]) -> Figure:
    """One panel per entry (its first seed's clock): a row per worker, its first rounds'
    compute, communication and waiting as bars on the simulated seconds; the panel's
    title gives the mean shares over the whole run."""
    rows = [s for s in by_entry(summaries) if s.get("clock")]
    fig = Figure(figsize=(11.5, 0.9 + sum(1.2 + 0.22 * _workers(s) for s in rows)),
                 layout="constrained")  # fmt: skip
    axes = fig.subplots(len(rows), 1, squeeze=False)[:, 0]
    for ax, s in zip(axes, rows, strict=True):
        segments = s["clock"]["segments"]
        for kind, color in COLORS.items():
            for worker in range(_workers(s)):
                bars = [(a, d) for w, a, d, k in segments if w == worker and k == kind and d > 0]
                ax.broken_barh(bars, (worker - 0.4, 0.8), color=color, lw=0)
        ax.set_yticks(range(_workers(s)))
        ax.set_ylim(_workers(s) - 0.5, -0.5)
        ax.set_ylabel("worker")
        ax.set_title(
            f"{s['algorithm']}\nover the whole run, compute {_pct(s['busy_share'])}, "
            f"communication {_pct(s['comm_share'])}, waiting {_pct(s['idle_share'])}"
            f"{_away(s)} "
            f"(mean over workers); one step {s['clock']['step_ms']:.3g} ms x its speed",
            fontsize="medium",
            loc="left",
        )
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1].set_xlabel("simulated seconds from the start (the first rounds)")
    kinds = {k for s in rows for *_, k in s["clock"]["segments"]}  # "absent" with churn
    shown = [k for k in COLORS if k != "absent" or k in kinds]
    fig.legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in shown],
               loc="outside upper right", ncols=len(shown))  # fmt: skip
    fig.savefig(path, dpi=120)
    return fig


def _workers(summary: dict[str, Any]) -> int:
    return len(summary["clock"]["shares"]["busy"])


def _away(summary: dict[str, Any]) -> str:
    share = summary.get("absent_share")  # with churn only
    return f", absent {_pct(share)}" if share is not None and share.mean > 0 else ""


def _pct(value: Any) -> str:
    return f"{100 * value.mean:.0f}%"
