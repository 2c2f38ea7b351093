"""The run's Markdown: the summary table, ``summary.md`` and ``report.md`` with their
sections (policy changes, projection, LAMB vs 1-bit LAMB). With several seeds, each
entry's figures are the mean ± sample std over its seeds (`shoal.experiments.reports.seeds`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shoal.experiments import algorithms
from shoal.experiments.fields import TaskFields
from shoal.experiments.overrides import flatten
from shoal.experiments.reports.plots import PLOTS, SAMPLES_PLOT
from shoal.experiments.reports.seeds import Spread, by_entry, seeds_of

COLUMNS = (
    "algorithm",
    "seed",
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
# (summary key, table header, format); accuracy and its like in percent, as in the plots.
SUMMARY_COLUMNS = (
    ("algorithm", "algorithm", "{}"),
    ("steps", "steps", "{}"),
    ("loss", "train loss", "{:.4f}"),
    ("test_loss", "test loss", "{:.4f}"),
    ("test_accuracy", "test acc", "{:.2%}"),
    ("test_error", "test error", "{:.2%}"),
    ("test_bits_per_byte", "test bits/byte", "{:.3f}"),
    ("tokens_m", "M tokens", "{:.3g}"),
    ("mb_sent", "MB sent/worker", "{:.3f}"),
    ("mb_received", "MB recv/worker", "{:.3f}"),
    ("peak_kb_sent", "peak kB sent/step", "{:.1f}"),
    ("density", "sent/elements", "{:.2%}"),
    ("projected_ms", "projected step ms", "{:.2f}"),
    ("skipped", "skipped steps", "{}"),
    ("wall_s", "wall s", "{:.1f}"),
)
# Shown only when some run has them.
OPTIONAL_COLUMNS = ("projected_ms", "skipped", "peak_kb_sent", "test_bits_per_byte", "tokens_m")


def _number(x: float, fmt: str) -> str:
    if fmt == "{}":  # a count: whole, unless a mean over seeds is not
        return str(int(x)) if float(x).is_integer() else f"{x:.1f}"
    return fmt.format(x)


def cell(value: Any, fmt: str = "{}") -> str:
    """A table cell: ``"-"`` for None; a `Spread` as ``"mean ± std"``, or its mean alone
    with one seed or when every seed gave the same value; anything else formatted.

    Example:
      >>> from shoal.experiments.reports.seeds import spread
      >>> cell(spread([0.81, 0.83, 0.84]), "{:.2%}"), cell(spread([0.81]), "{:.2%}")
      ('82.67% ± 1.53%', '81.00%')
    """
    if value is None:
        return "-"
    if isinstance(value, Spread):
        text = _number(value.mean, fmt)
        return text + (f" ± {_number(value.std, fmt)}" if value.std else "")
    return _number(value, fmt) if isinstance(value, (int, float)) else fmt.format(value)


def several_seeds(summaries: Sequence[dict[str, Any]]) -> bool:
    """Whether some entry of ``summaries`` has more than one seed."""
    return any(len(row["seeds"]) > 1 for row in by_entry(summaries))


def summary_table(summaries: Sequence[dict[str, Any]]) -> str:
    """A markdown table, one row per entry: with several seeds, a ``seeds`` column (how
    many) and each figure as mean ± sample std over them (`cell`, `seeds_note`).

    Example:
      >>> rows = [{"algorithm": "ssgd", "seed": s, "steps": 10, "loss": v, "test_loss": v,
      ...          "test_accuracy": a, "test_error": 1 - a, "mb_sent": 1.0,
      ...          "mb_received": 1.0, "density": None, "wall_s": 2.0}
      ...         for s, v, a in ((0, 0.5, 0.8), (1, 0.7, 0.9))]
      >>> print(summary_table(rows).splitlines()[2])
      | ssgd | 2 | 10 | 0.6000 ± 0.1414 | 0.6000 ± 0.1414 | 85.00% ± 7.07% | 15.00% ± 7.07% | 1.000 | 1.000 | - | 2.0 |
    """  # noqa: E501
    rows = by_entry(summaries)
    columns = [
        c
        for c in SUMMARY_COLUMNS
        if c[0] not in OPTIONAL_COLUMNS or any(s.get(c[0]) is not None for s in rows)
    ]
    if any(len(row["seeds"]) > 1 for row in rows):
        columns.insert(1, ("seeds", "seeds", "{}"))
    lines = [
        "| " + " | ".join(h for _, h, _ in columns) + " |",
        "|" + "|".join("---" if k == "algorithm" else "---:" for k, _, _ in columns) + "|",
    ]
    for row in rows:
        row = {**row, "seeds": len(row["seeds"])}
        lines.append("| " + " | ".join(cell(row.get(k), f) for k, _, f in columns) + " |")
    return "\n".join(lines)


def _seed_list(seeds: Sequence[Any]) -> str:
    return ", ".join(str(s) for s in seeds if s is not None)


def seeds_note(summaries: Sequence[dict[str, Any]]) -> str:
    """One sentence under the table: how many seeds, and what ± means."""
    seeds = seeds_of(summaries)
    listed = _seed_list(seeds)
    if not several_seeds(summaries):
        return f"1 seed{f' ({listed})' if listed else ''}: single values, no spread."
    return (
        f"Mean ± sample standard deviation (ddof = 1) over each entry's seeds (column "
        f"`seeds`; seeds {listed}); a value without ± was the same for every seed. The "
        f"per-seed values are in `metrics.jsonl`."
    )


def policy_section(records: Sequence[dict[str, Any]]) -> str:
    """The changes closed-loop policies made, if any (with their seed, when several)."""
    changes = [r for r in records if "policy" in r]
    if not changes:
        return ""
    several = len(seeds_of(records)) > 1
    seed = lambda r: f" (seed {r.get('seed')})" if several else ""  # noqa: E731
    lines = [f"- `{r['algorithm']}`{seed(r)} after step {r['step']}: `{r['policy']}`"
             for r in changes]  # fmt: skip
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


def _seeds_word(n: int, m: int) -> str:
    return f"{n} seeds" if n == m else f"{n} and {m} seeds"


def guide(summaries: Sequence[dict[str, Any]]) -> str:
    """Each entry against ``ssgd`` (when present): accuracy difference, bytes and projected
    speed-up, best trade-offs first (the entries within one point of S-SGD's accuracy, by
    bytes). With several seeds the figures are means, and a difference whose intervals
    mean ± std overlap those of ``ssgd`` is said to be one (`Spread.overlaps`), not
    claimed: "within one std of `ssgd`: not distinguishable over 3 seeds"."""
    rows = by_entry(summaries)
    base = next((s for s in rows if algorithms.is_reference(s["algorithm"])), None)
    if base is None or len(rows) < 2:
        return ""
    ref = f"`{base['algorithm']}`"
    listed = []
    for s in rows:
        if s is base:
            continue
        b_acc, s_acc = base["test_accuracy"], s["test_accuracy"]
        acc = 100 * (s_acc.mean - b_acc.mean)
        same = s_acc.overlaps(b_acc)
        line = f"`{s['algorithm']}`: {acc:+.1f} points of accuracy"
        if same:
            line += (
                f", within one std of {ref} ({cell(s_acc, '{:.2%}')} vs "
                f"{cell(b_acc, '{:.2%}')}): not distinguishable over "
                f"{_seeds_word(s_acc.n, b_acc.n)}"
            )
        b_mb, s_mb = base["mb_sent"], s["mb_sent"]
        less = b_mb.mean / s_mb.mean if s_mb.mean else float("inf")
        if not s_mb.mean:
            sent = "no bytes sent"
        else:
            sent = ratio_phrase(less, "fewer bytes", "more bytes", "same bytes")
            if s_mb.overlaps(b_mb) and sent != "same bytes":
                sent = f"bytes within one std of {ref}'s"
        line += f", {sent}"
        b_ms, s_ms = base.get("projected_ms"), s.get("projected_ms")
        if s_ms and b_ms and s_ms.mean and b_ms.mean:
            step = ratio_phrase(
                b_ms.mean / s_ms.mean,
                "faster projected step",
                "slower projected step",
                "same projected step time",
            )
            if s_ms.overlaps(b_ms) and not step.startswith("same"):
                step = f"projected step within one std of {ref}'s"
            line += f", {step}"
        listed.append((acc < -1.0 and not same, -less, line))
    listed.sort()
    close = [r for r in listed if not r[0]]
    n = base["test_accuracy"].n
    if n > 1:
        text = [
            f"Against {ref} in this run, means over {n} seeds (within one point of its "
            "accuracy or within one std first, by bytes):",
            "",
        ]
    else:
        text = [f"Against {ref} in this run, 1 seed (within one point of its accuracy "
                "first, by bytes):", ""]  # fmt: skip
    text += [f"- {line}" for _, _, line in close] or ["(none)"]
    if len(close) < len(listed):
        beyond = ", beyond one std" if n > 1 else ""
        text += ["", f"Further than one point below {ref}{beyond}:", ""]
        text += [f"- {line}" for bad, _, line in listed if bad]
    return "\n".join(text) + "\n"


def write_report(path: Path, cfg: Any, summaries: Sequence[dict[str, Any]], *, command: str,
                 extra: str = "") -> None:  # fmt: skip
    """The one-page report: the table, the plots, the comparison with S-SGD."""
    text = f"""# {cfg.name}: report

`{command}`: {cfg.workers} workers, {cfg.steps} steps.

{summary_table(summaries)}

{seeds_note(summaries)}

{guide(summaries)}
{PLOT_NOTE}

![loss vs step]({PLOTS[0]})
![test accuracy vs step]({PLOTS[2]})
![loss vs MB sent]({PLOTS[1]})
{extra}
Details, the config and per-step metrics: `summary.md`, `metrics.jsonl`.
"""
    path.write_text(text)


def projection_section(cfg: Any, summaries: Sequence[dict[str, Any]]) -> str:
    """How the projected step time was made, with each entry's split and speed-up (with
    several seeds, mean ± std over them; the speed-up a ratio of means)."""
    rows = [s for s in by_entry(summaries) if s.get("projected_ms") is not None]
    if not rows:
        return ""
    from shoal.experiments.runner.projection import describe

    base = next((s for s in rows if algorithms.is_reference(s["algorithm"])), None)
    lines = [
        "| algorithm | compute ms | communication ms | step ms | speed-up vs ssgd |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in rows:
        up = f"{base['projected_ms'].mean / s['projected_ms'].mean:.2f}x" if base else "-"
        cells = (s["algorithm"], cell(s["compute_ms"], "{:.3f}"),
                 cell(s["projected_comm_ms"], "{:.2f}"), cell(s["projected_ms"], "{:.2f}"),
                 up)  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return f"""
## Projected to a cluster

Step time on {describe(cfg)} (`shoal.costmodel`): every step's collectives replayed
for that many workers (`shoal.comms.record_events`) and timed with the alpha-beta model,
plus one worker's forward and backward pass measured on this machine, with no overlap.

{chr(10).join(lines)}
"""


def clock_section(cfg: Any, summaries: Sequence[dict[str, Any]]) -> str:
    """The simulated clock (config ``speeds``): each entry's simulated time, time to
    ``target_loss``, and its workers' compute, communication and waiting shares (with
    several seeds, mean ± std over them)."""
    rows = [s for s in by_entry(summaries) if s.get("sim_time_s") is not None]
    if not rows:
        return ""
    from shoal.experiments.runner.clock import cluster_of

    c = cluster_of(cfg)
    target = f"test loss <= {cfg.target_loss:g}" if cfg.target_loss else "no target_loss set"
    churn = bool(getattr(cfg, "churn", ""))
    lines = [
        f"| algorithm | simulated s | s to target ({target}) | compute | communication "
        "| waiting | waiting, per worker (min-max) |" + (" absent |" if churn else ""),
        "|---|---:|---:|---:|---:|---:|---|" + ("---:|" if churn else ""),
    ]
    for s in rows:
        idle = s["clock"]["shares"]["idle"]
        reached = s["sim_to_target_s"]
        to_target = cell(reached, "{:.4g}") if reached is not None else "not reached"
        if reached is not None and reached.n < len(s["seeds"]):
            to_target += f" ({reached.n} of {len(s['seeds'])} seeds reached it)"
        cells = (s["algorithm"], cell(s["sim_time_s"], "{:.4g}"), to_target,
                 cell(s["busy_share"], "{:.1%}"), cell(s["comm_share"], "{:.1%}"),
                 cell(s["idle_share"], "{:.1%}"), f"{min(idle):.1%}-{max(idle):.1%}")  # fmt: skip
        if churn:  # an asynchronous entry runs without churn: no absent share
            away = s.get("absent_share")
            cells += (cell(away, "{:.1%}") if away is not None else "-",)
        lines.append("| " + " | ".join(cells) + " |")
    step = "given (compute_ms)" if cfg.compute_ms else "measured on this machine"
    return f"""
## Simulated time

{cfg.workers} workers at speeds `{cfg.speeds or "1"}` (`shoal.costmodel.speeds`: factors on
one worker's step, {step}), on the links of {c.name} ({c.workers_per_node} per node,
{c.inter_bandwidth * 8 / 1e9:g} Gbps between nodes): a collective starts when its last
member arrives (`shoal.costmodel.clock`); an asynchronous entry's workers push and pull
over the link between nodes (`shoal.experiments.asynchronous`). Shares are of the run's
simulated time, mean over workers; timeline.png shows the first rounds.{_churned(cfg)}

{chr(10).join(lines)}
"""


def _churned(cfg: Any) -> str:
    if not getattr(cfg, "churn", ""):
        return ""
    return (
        f"\nChurn `{cfg.churn}` (`shoal.experiments.churn`): an absent worker computes and "
        "sends nothing and waits for no one; its time away is the absent share."
    )


def volume_reduction(warmup_fraction: float, bits: int) -> float:
    """Li et al. (2021), section 5: end-to-end communication volume reduction of 1-bit
    LAMB over dense ``bits``-bit all-reduce with a warm-up fraction ``w`` of the steps,
    ``1 / (w + (1 - w) / bits)``."""
    w = warmup_fraction
    return 1.0 / (w + (1.0 - w) / bits)


def onebit_section(
    pair: Any, records: Sequence[dict[str, Any]], summaries: Sequence[dict[str, Any]]
) -> str:
    """Markdown comparing the ``lamb`` and ``onebit_lamb`` entries of ``pair``
    (`onebit_pair`): final test loss and gap, MB sent per worker, and the measured volume
    reduction next to the paper's formula (`volume_reduction`); with several seeds, means
    ± std, the gap a difference of means. Empty without a pair."""
    if pair is None:
        return ""
    by_name = {s["algorithm"]: s for s in by_entry(summaries)}
    base_label, entry = pair
    pair = base_label, entry.label
    base, one = by_name[pair[0]], by_name[pair[1]]
    freeze, steps = entry.warmup(), entry.cfg.steps
    w = freeze / steps
    rows = [r for r in records if r["algorithm"] == pair[1]]
    rows = [r for r in rows if r.get("seed") == rows[0].get("seed")]  # bytes: one seed's
    warm_bytes, comp_bytes = rows[0]["bytes_sent"], rows[-1]["bytes_sent"]
    measured = base["mb_sent"].mean / one["mb_sent"].mean
    gap = one["test_loss"].mean - base["test_loss"].mean
    relative = gap / base["test_loss"].mean
    if one["test_loss"].overlaps(base["test_loss"]):
        seeds = _seeds_word(one["test_loss"].n, base["test_loss"].n)
        gap_words = f"; within one std of each other: not distinguishable over {seeds}"
    else:
        gap_words = ""
    lm = getattr(entry.cfg, "task", None) == "lm"
    what = "validation loss (nats per byte)" if lm else "test loss"

    def loss(s: dict[str, Any]) -> str:
        bits = f" ({s['test_loss'].mean / math.log(2):.4f} bits per byte)" if lm else ""
        return cell(s["test_loss"], "{:.4f}") + bits

    return f"""
## LAMB vs 1-bit LAMB

Same initial model and batches; 1-bit LAMB runs the LAMB rule on dense all-reduced
gradients for its first {freeze} of {steps} steps (warm-up fraction w = {w:.3f}), then
sends its momentum through the 1-bit compressed all-reduce. `{pair[0]}` is that warm-up
rule for all {steps} steps.

| | `{pair[0]}` | `{pair[1]}` |
|---|---:|---:|
| final {what} | {loss(base)} | {loss(one)} |
| MB sent per worker | {cell(base["mb_sent"], "{:.3f}")} | {cell(one["mb_sent"], "{:.3f}")} |

- Gap (1-bit LAMB - LAMB) in final {what}: {gap:+.4f} ({relative:+.2%}){gap_words}.
- Bytes sent per worker and step by 1-bit LAMB: {warm_bytes:,} in warm-up (float32 ring
  all-reduce), {comp_bytes:,} compressed: {warm_bytes / comp_bytes:.1f}x fewer per step.
- End-to-end volume reduction, measured (LAMB MB / 1-bit LAMB MB): **{measured:.2f}x**.
  The paper's formula 1 / (w + (1 - w) / 32) for a float32 all-reduce:
  **{volume_reduction(w, 32):.2f}x**; for reference, against an fp16 all-reduce as in the
  paper, 1 / (w + (1 - w) / 16) = {volume_reduction(w, 16):.2f}x. (The formula counts one
  bit per element; the measured figure also pays the padding and the per-chunk scales.)

![test loss vs samples]({SAMPLES_PLOT})
"""


def config_rows(cfg: Any) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(used, other)``: the config's ``(key, value)`` rows (`flatten`) split into those
    of the run and its task (`TaskFields.fields_of`: not another bundled task's) with the
    hyper-parameters of the run's algorithms, and all the rest (another task's fields,
    ``params`` of algorithms the run does not name)."""
    task_fields = {f.name for f in dataclasses.fields(TaskFields)}
    read = set(TaskFields.fields_of(cfg.task))
    top_level = {f.name for f in dataclasses.fields(cfg)}
    run = {algorithms.parse_entry(e)[0] for e in cfg.algorithms}
    used, other = [], []
    for key, value in flatten(cfg):
        top = key.split(".")[0]
        if top in top_level:
            keep = top not in task_fields or top in read
        else:  # algorithm.field, from params
            keep = top in run
        (used if keep else other).append((key, value))
    return used, other


def config_section(cfg: Any) -> str:
    """The ``## Config`` table of the fields the run uses (`config_rows`), the others
    folded under ``<details>``."""
    used, other = config_rows(cfg)
    table = lambda rows: "\n".join(  # noqa: E731
        ["| key | value |", "|---|---|", *(f"| `{k}` | `{v}` |" for k, v in rows)]
    )
    text = f"## Config\n\nThe run, its task ({cfg.task}) and its algorithms:\n\n{table(used)}\n"
    if other:
        text += (
            f"\n<details><summary>other fields ({len(other)}: other tasks', other "
            f"algorithms')</summary>\n\n{table(other)}\n\n</details>\n"
        )
    return text


PLOT_NOTE = """Plots: one row of panels per family of algorithms (dense, compressed, local:
`shoal.experiments.algorithms.FAMILIES`), `ssgd` (black) in every row, each entry in one
colour in every plot. With several seeds, each curve is the mean over the seeds in a band
of ± one sample standard deviation; accuracy is in percent, as in the tables."""


def write_summary(
    path: Path,
    cfg: Any,
    summaries: Sequence[dict[str, Any]],
    *,
    backend: str,
    command: str,
    extra: str = "",
) -> None:
    error_note = {
        "hmm": "; the frame error",
        "lm": "; the next-byte error, on the validation files",
    }
    error_note = error_note.get(getattr(cfg, "task", None), "")
    text = f"""# {cfg.name}

`{command}`: backend `{backend}`, {cfg.workers} workers.

## Results

{summary_table(summaries)}

{seeds_note(summaries)}

Train loss: mean over workers of their local batch losses at the last step. Test loss,
accuracy and error (1 - accuracy{error_note}): the
worker-averaged parameters after the last step (for BMUF and BMUF_GTC the global model
of the last BMUF step, which is the last step). MB: 10^6 bytes put on
(taken off) the wire per worker in the whole run, mean over workers: every step's
`shoal.comms.wire_bytes(state, "step")`, summed exactly. Wall time includes compilation.

{PLOT_NOTE}

![loss vs step]({PLOTS[0]})
![loss vs MB sent]({PLOTS[1]})
![test accuracy vs step]({PLOTS[2]})

Per-step metrics: `metrics.jsonl`, `metrics.csv`.
{extra}
{config_section(cfg)}"""
    path.write_text(text)
