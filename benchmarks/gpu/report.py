"""The GPU check's markdown: one table per stage, from the stage files under ``--out``,
and the block of BENCHMARKS.md that holds it (between ``<!-- gpu:start -->`` and
``<!-- gpu:end -->``, under the "## gpu" heading; the text around it is written by hand)."""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any

from gpu.record import STAGES, load, stage_file

START, END = "<!-- gpu:start -->", "<!-- gpu:end -->"


def cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(data: dict[str, Any]) -> list[str]:
    cols = data["columns"]
    if any("error" in r for r in data["rows"]):
        cols = [*cols, ["error", "error"]]
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in data["rows"]:
        lines.append("| " + " | ".join(cell(r.get(k)) for k, _ in cols) + " |")
    return lines


def summary(data: dict[str, Any]) -> str:
    """A stage's one-line verdict beyond its status: its module's ``summary(rows)``, if it
    has one and there are rows."""
    verdict = getattr(importlib.import_module(f"gpu.{data['stage']}"), "summary", None)
    return verdict(data["rows"]) if verdict and data["rows"] else ""


def collect(dirs: list[Path]) -> dict[str, dict[str, Any]]:
    """Each stage's file from the last of ``dirs`` that has one (a second try's rerun
    stages replace the first run's)."""
    found = {}
    for d in dirs:
        for stage in STAGES:
            if stage_file(d, stage).exists():
                found[stage] = load(stage_file(d, stage))
    return found


def header(found: dict[str, dict[str, Any]]) -> str:
    runs = list(found.values())
    if not runs:
        return "GPU check: no stage files found"
    mode = "CPU rehearsal" if any(r["rehearse"] for r in runs) else "GPU"
    device = next((r["device"] for r in runs if r.get("device")), "unknown device")
    dates = sorted({r["started"] for r in runs})
    commands = list(dict.fromkeys(f"`{r['command']}`" for r in runs if r["command"]))
    seconds = sum(r["seconds"] for r in runs)
    return (
        f"GPU check ({mode}) on {device}, host {runs[0]['host']}, "
        f"{dates[0] if len(dates) == 1 else dates[0] + ' to ' + dates[-1]}: "
        f"{len(runs)} stage(s) in {seconds:.0f} s; "
        f"command{'s' if len(commands) > 1 else ''}: {', then '.join(commands) or '-'}"
    )


def render(dirs: list[Path]) -> str:
    """The whole report: a header, then every stage that left a file in ``dirs``."""
    found = collect(dirs)
    lines = [header(found), ""]
    for i, stage in enumerate(STAGES, 1):
        if stage not in found:
            lines += [f"**{i}. {stage}**: not run", ""]
            continue
        data = found[stage]
        mode = " (CPU rehearsal)" if data.get("rehearse") else ""
        verdict = summary(data)
        lines.append(
            f"**{i}. {data['title']}**{mode}: {data['status']}, {data['seconds']:.0f} s of "
            f"{data['budget_s']:.0f}" + (f"; {verdict}" if verdict else "")
        )
        lines.append("")
        if data["rows"]:
            lines += [*table(data), ""]
        for note in data["notes"]:
            lines.append(f"- {note}")
        if data["notes"]:
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write_block(doc: Path, text: str) -> None:
    """Put ``text`` between the gpu markers of ``doc`` (a "## gpu" section with them is
    appended where there are none)."""
    source = doc.read_text()
    block = f"{START}\n\n{text}\n{END}"
    if START in source and END in source:
        before, rest = source.split(START, 1)
        after = rest.split(END, 1)[1]
        source = before + block + after
    else:
        source = source.rstrip() + "\n\n## gpu\n\n" + block + "\n"
    doc.write_text(source)
