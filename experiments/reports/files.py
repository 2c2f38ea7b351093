"""Run outputs written to the output folder: ``metrics.jsonl``, ``metrics.csv``,
``timing.jsonl`` (wall-clock seconds per step, kept apart from the deterministic
metrics), TensorBoard events, and `write_run`, which writes them all with the plots and
Markdown."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shoal.experiments.reports.markdown import (
    COLUMNS,
    clock_section,
    onebit_section,
    policy_section,
    projection_section,
    write_report,
    write_summary,
)
from shoal.experiments.reports.plots import (
    CLOCK_PLOTS,
    PLOTS,
    SAMPLES_PLOT,
    onebit_pair,
    plot_accuracy,
    plot_loss,
    plot_test_vs_samples,
)
from shoal.experiments.reports.timeline import plot_timeline


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def json_line(record: dict[str, Any]) -> str:
    """``record`` as one line of strict JSON: a non-finite float (a NaN loss, an infinite
    noise scale) is ``null``, since ``NaN`` and ``Infinity`` are not JSON and strict
    parsers (``jq``, ``JSON.parse``, pandas' ``ujson``) reject the line."""
    return json.dumps(_strict(record), allow_nan=False) + "\n"


def write_jsonl(path: Path, records: Sequence[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json_line(r))


def metrics_record(record: dict[str, Any]) -> dict[str, Any]:
    """A step's record as ``metrics.jsonl`` holds it: without its wall-clock time, so that
    two runs of one config and seed write the same file byte for byte (``timing.jsonl``
    has the times)."""
    return {k: v for k, v in record.items() if k != "time_s"}


class MetricsLog:
    """``metrics.jsonl`` written as the run goes, one flushed line per record, so that an
    interrupted run keeps what it measured; `write_run` writes the same lines at the end.
    The file is replaced at the first record, not before: a run that fails before
    training (a refused ``--resume``) leaves the earlier one's file as it was.

    Example:
      >>> import tempfile, pathlib
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
      >>> with MetricsLog(path) as log:
      ...     log.add({"step": 1, "loss": float("nan"), "time_s": 0.1})
      >>> path.read_text()
      '{"step": 1, "loss": null}\\n'
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.file = None

    def add(self, record: dict[str, Any]) -> None:
        if self.file is None:
            self.file = open(self.path, "w")
        self.file.write(json_line(metrics_record(record)))
        self.file.flush()

    def close(self) -> None:
        try:
            if self.file is not None:
                self.file.close()
        except OSError:
            pass  # a line `add` could not write, and raised for: nothing more to say

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_csv(path: Path, records: Sequence[dict[str, Any]]) -> None:
    # Eval columns stay empty on steps without an evaluation; a task's own test metrics
    # (`shoal.experiments.tasks.Task.evaluate`) follow the usual columns.
    extra = {k: None for r in records for k in r if k not in COLUMNS}
    # A seed column only for records that carry one.
    columns = [c for c in COLUMNS if c != "seed" or any("seed" in r for r in records)]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*columns, *extra], restval="")
        w.writeheader()
        w.writerows(records)


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
    so TensorBoard overlays the algorithms, and with several seeds one per algorithm and
    seed (``ssgd/seed_1``); the scalars of `TENSORBOARD_TAGS` at each record's step and the
    policy changes as text. Needs ``tensorboardX`` (the ``tensorboard`` extra)."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ImportError(
            "log=tensorboard needs the tensorboardX package: pip install tensorboardX"
        ) from None
    several = len({r.get("seed") for r in records}) > 1
    for run in dict.fromkeys((r["algorithm"], r.get("seed")) for r in records):
        sub = folder / run[0] / f"seed_{run[1]}" if several else folder / run[0]
        with SummaryWriter(str(sub)) as w:
            for r in records:
                if (r["algorithm"], r.get("seed")) != run:
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
    entries: Sequence[Any] = (),
    backend: str,
    command: str,
    task: Any = None,
) -> list[Path]:
    """Write every output file of a run into ``out``; returns their paths. ``records``
    and ``summaries`` are every seed's, each with its ``"seed"`` (one summary per entry
    and seed): the tables and plots show each entry's mean ± std over its seeds, and
    ``metrics.jsonl`` keeps every record. ``entries`` are the run's resolved algorithms
    (`shoal.experiments.algorithms.Entry`, one per label); with a ``lamb`` and
    ``onebit_lamb`` among them, the summary gains `onebit_section` and its plot. A
    ``task`` with ``corpus_info()`` adds a data section."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / n for n in ("metrics.jsonl", "metrics.csv", *PLOTS, "summary.md")]
    paths.append(out / "report.md")
    # Wall-clock times go to their own file, so that metrics.jsonl of two runs of one
    # config and seed are byte for byte the same (RELIABILITY.md, determinism).
    keys = ("algorithm", "seed", "step", "time_s")
    timing = [{k: r[k] for k in keys if k in r} for r in records]
    records = [metrics_record(r) for r in records]
    write_jsonl(paths[0], records)
    write_csv(paths[1], records)
    plot_loss(paths[2], records, "step", "step")
    plot_loss(paths[3], records, "mb_sent", "MB sent per worker (cumulative)")
    plot_accuracy(paths[4], records)
    pair = onebit_pair(entries)
    onebit = onebit_section(pair, records, summaries)
    extra = policy_section(records) + projection_section(cfg, summaries) + onebit
    if any(s.get("sim_time_s") is not None for s in summaries):  # a simulated clock
        paths += [out / n for n in CLOCK_PLOTS]
        # Without speeds only the asynchronous entries keep a clock: plot those.
        timed = [r for r in records if "sim_time_s" in r]
        plot_loss(paths[-2], timed, "sim_time_s", "simulated seconds", log_x=False)
        plot_timeline(paths[-1], summaries)
        extra += clock_section(cfg, summaries)
    if onebit:  # the section shows this plot
        paths.append(out / SAMPLES_PLOT)
        plot_test_vs_samples(paths[-1], cfg, records, pair)
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
    if getattr(cfg, "log", "none") == "wandb":
        from shoal.experiments.reports.wandb_log import write_wandb  # it imports this module

        paths.append(write_wandb(out, cfg, records, entries))
    return paths
