"""The run's Markdown: the summary table, ``summary.md`` and ``report.md`` with their
sections (policy changes, projection, LAMB vs 1-bit LAMB)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shoal.experiments import algorithms
from shoal.experiments.overrides import flatten
from shoal.experiments.reports.plots import PLOTS, SAMPLES_PLOT

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
    base = next((s for s in summaries if algorithms.is_reference(s["algorithm"])), None)
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
    from shoal.experiments.runner.projection import describe

    base = next((s for s in rows if algorithms.is_reference(s["algorithm"])), None)
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

Step time on {describe(cfg)} (`shoal.costmodel`): every step's collectives replayed
for that many workers (`shoal.comms.record_events`) and timed with the alpha-beta model,
plus one worker's forward and backward pass measured on this machine, with no overlap.

{chr(10).join(lines)}
"""


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
    reduction next to the paper's formula (`volume_reduction`). Empty without a pair."""
    if pair is None:
        return ""
    by_name = {s["algorithm"]: s for s in summaries}
    base_label, entry = pair
    pair = base_label, entry.label
    base, one = by_name[pair[0]], by_name[pair[1]]
    freeze, steps = entry.warmup(), entry.cfg.steps
    w = freeze / steps
    rows = [r for r in records if r["algorithm"] == pair[1]]
    warm_bytes, comp_bytes = rows[0]["bytes_sent"], rows[-1]["bytes_sent"]
    measured = base["mb_sent"] / one["mb_sent"]
    gap = one["test_loss"] - base["test_loss"]
    lm = getattr(entry.cfg, "task", None) == "lm"
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
