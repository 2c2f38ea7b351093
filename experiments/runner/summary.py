"""The fields every run's summary has, from its records (`base_summary`), the simulated
time at which a run first reached the target loss (`time_to_target`), and a record's
bytes per worker (`per_worker`)."""

from __future__ import annotations

from typing import Any

import numpy as np


def base_summary(label: str, cfg: Any, records: list[dict[str, Any]], wall_s: float) -> dict:
    """Loss, test metrics and bytes of the last record, the largest step's bytes, the
    mean density (when the records have one), the skipped steps and the wall time."""
    last = records[-1]
    return {
        "algorithm": label,
        "seed": cfg.seed,
        "steps": cfg.steps,
        "loss": last["loss"],
        "test_loss": last["test_loss"],
        "test_accuracy": last["test_accuracy"],
        "test_error": 1.0 - last["test_accuracy"],
        "test_bits_per_byte": last.get("test_bits_per_byte"),  # a text task's
        "tokens_m": last["tokens"] / 1e6 if "tokens" in last else None,  # tokens seen
        "mb_sent": last["mb_sent"],
        "mb_received": last["mb_received"],
        # the most any one step sent (per worker): what a link must carry at once
        "peak_kb_sent": max(float(np.max(r["bytes_sent"])) for r in records) / 1e3,
        "density": float(np.mean([r["density"] for r in records])) if "density" in last else None,
        "skipped": last.get("skipped"),  # None: no step skipped
        "wall_s": wall_s,
    }


def time_to_target(records: list[dict[str, Any]], target: float) -> float | None:
    """``sim_time_s`` of the first record whose ``test_loss`` is at most ``target`` (None:
    none, or no target: 0)."""
    for r in records:
        if target and r.get("test_loss") is not None and r["test_loss"] <= target:
            return r["sim_time_s"]
    return None


def per_worker(values: np.ndarray) -> int | float:
    """A record's bytes per worker: the exact int when the workers agree (symmetric
    collectives), else the mean."""
    return int(values[0]) if np.all(values == values[0]) else float(values.mean())
