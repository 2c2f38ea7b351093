"""What a run writes (`write_run`): per-step metrics (``metrics.jsonl``, ``metrics.csv``,
``timing.jsonl``), plots, ``summary.md`` and ``report.md``, and TensorBoard events."""

from shoal.experiments.reports.files import (
    MetricsLog,
    json_line,
    write_csv,
    write_jsonl,
    write_run,
    write_tensorboard,
)
from shoal.experiments.reports.markdown import (
    COLUMNS,
    guide,
    ratio_phrase,
    summary_table,
    volume_reduction,
)
from shoal.experiments.reports.plots import (
    PLOTS,
    SAMPLES_PLOT,
    plot_accuracy,
    plot_loss,
    plot_test_vs_samples,
    twins,
)

__all__ = [
    "COLUMNS",
    "MetricsLog",
    "PLOTS",
    "SAMPLES_PLOT",
    "guide",
    "json_line",
    "plot_accuracy",
    "plot_loss",
    "plot_test_vs_samples",
    "ratio_phrase",
    "summary_table",
    "twins",
    "volume_reduction",
    "write_csv",
    "write_jsonl",
    "write_run",
    "write_tensorboard",
]
