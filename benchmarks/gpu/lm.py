"""Stage 5, a short language-model run: S-SGD+AdamW against DiLoCo and Streaming DiLoCo
on the byte-level LM at about 25M parameters (`experiments/configs/gpu_lm.py`), each entry
a ``shoal-run`` of its own (in this process), so that a stage stopped for time keeps the
entries before it.

Per entry: the validation loss per token (nats; a token is a byte, so bits per byte is
that over ln 2) at the end and along the run, the MB each worker sent, and the steady
step time (the median of the steps after the first, whose time includes compiling).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np

CONFIG = "experiments/configs/gpu_lm.py"
ENTRIES = ("ssgd_adamw", "diloco", "streaming_diloco")
# The rehearsal's sizes: the same entries and code paths on a tiny model.
REHEARSE = [
    "lm_width=32",
    "lm_layers=1",
    "lm_heads=2",
    "seq_len=32",
    "steps=20",
    "workers=2",
    "batch_size=2",
    "train_size=256",
    "test_size=32",
    "eval_every=10",
    "diloco.sync_every=10",
    "streaming_diloco.sync_every=10",
]

COLUMNS = [
    ("entry", "entry"),
    ("steps", "steps"),
    ("loss", "val loss/token (nats)"),
    ("bpb", "bits/byte"),
    ("mb_sent", "MB sent/worker"),
    ("peak_kb", "peak kB/step"),
    ("ms_step", "ms/step"),
    ("first_s", "first step s"),
]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(record, ctx) -> bool:
    from shoal.experiments.runner import cli

    record.set(device=ctx.device_name())
    ok = True
    for entry in ENTRIES:
        if record.left() < 20:
            record.note(f"{entry} and after: not run, out of time")
            ok = False
            break
        with tempfile.TemporaryDirectory() as d:
            argv = [
                str(ctx.root / CONFIG),
                "--out",
                d,
                "--overwrite",
                "--set",
                f"algorithms={entry}",
            ]
            if ctx.rehearse:
                argv += REHEARSE
            code = cli.main(argv)
            if code != 0:
                ok = False
                record.note(f"{entry}: shoal-run exited {code}")
                continue
            metrics = read_jsonl(Path(d) / "metrics.jsonl")
            timing = read_jsonl(Path(d) / "timing.jsonl")
        evals = [(m["step"], m["test_loss"]) for m in metrics if "test_loss" in m]
        last = metrics[-1]
        times = [t["time_s"] for t in timing]
        steps = np.diff(times) if len(times) > 1 else np.array([math.nan])
        peak = max(m["bytes_sent"] for m in metrics)
        loss = evals[-1][1] if evals else math.nan
        ok = ok and math.isfinite(loss)
        record.row(
            entry=entry,
            steps=last["step"],
            loss=round(loss, 4),
            bpb=round(loss / math.log(2), 3),
            mb_sent=round(last["mb_sent"], 3),
            peak_kb=round(peak / 1e3, 1),
            ms_step=round(float(np.median(steps)) * 1e3, 1),
            first_s=round(times[0], 1) if times else None,
            curve=[[s, round(v, 4)] for s, v in evals],
        )
    return ok
