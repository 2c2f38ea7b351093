"""What a run writes (`write_run`): per-step metrics (``metrics.jsonl``, ``metrics.csv``,
``timing.jsonl``), plots, ``summary.md`` and ``report.md``, and TensorBoard events. With
several seeds the tables and plots show each entry's mean ± std over them (`seeds`)."""

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
    cell,
    config_rows,
    guide,
    ratio_phrase,
    seeds_note,
    summary_table,
    volume_reduction,
)
from shoal.experiments.reports.panels import PER_PANEL, algorithm_colors, facets, palette
from shoal.experiments.reports.plots import (
    PLOTS,
    SAMPLES_PLOT,
    plot_accuracy,
    plot_loss,
    plot_test_vs_samples,
    twins,
)
from shoal.experiments.reports.seeds import Band, Spread, band, by_entry, spread

__all__ = [
    "COLUMNS",
    "PER_PANEL",
    "PLOTS",
    "SAMPLES_PLOT",
    "Band",
    "MetricsLog",
    "Spread",
    "algorithm_colors",
    "band",
    "by_entry",
    "cell",
    "config_rows",
    "facets",
    "guide",
    "json_line",
    "palette",
    "plot_accuracy",
    "plot_loss",
    "plot_test_vs_samples",
    "ratio_phrase",
    "seeds_note",
    "spread",
    "summary_table",
    "twins",
    "volume_reduction",
    "write_csv",
    "write_jsonl",
    "write_run",
    "write_tensorboard",
]
