"""What one stage of ``gpu_check.py`` writes: a JSON file under ``--out``, saved again
after every row, so a stage that crashes or runs out of time keeps the rows before it.

The file ``NN_<stage>.json`` holds::

    {"stage": "kernels", "title": ..., "status": "ok" | "failed" | "running" | "timeout"
     | "crashed", "budget_s": ..., "seconds": ..., "device": ..., "rehearse": ...,
     "started": ..., "host": ..., "command": ...,
     "columns": [[key, header], ...], "rows": [{key: value, ...}, ...], "notes": [...]}

A stage sets "ok" or "failed" when it ends; the parent turns a "running" left behind by
a stage it had to stop into "timeout" or "crashed".
"""

from __future__ import annotations

import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# The stages in the order they run, with their time budgets in seconds on the GPU (8
# minutes in all, each stage's process start and JAX's import included: a stage is
# stopped at its budget) and in the CPU rehearsal (caps on 2 slow cores, not targets).
STAGES = ("env", "kernels", "kernel_speed", "simulator", "lm", "peer")
BUDGET_GPU = {
    "env": 20, "kernels": 80, "kernel_speed": 60, "simulator": 160, "lm": 100, "peer": 60,
}  # fmt: skip
BUDGET_REHEARSE = {
    "env": 60, "kernels": 240, "kernel_speed": 120, "simulator": 300, "lm": 300, "peer": 240,
}  # fmt: skip


def stage_file(out: Path, stage: str) -> Path:
    return out / f"{STAGES.index(stage) + 1}_{stage}.json"


class Record:
    """One stage's results, written to its file on every `save`.

    ``deadline``: the ``time.monotonic()`` by which the stage should have saved its last
    row; `left` is the seconds to it, for a stage to skip what no longer fits.
    """

    def __init__(
        self,
        out: Path,
        stage: str,
        title: str,
        columns,
        *,
        budget: float,
        rehearse: bool,
        deadline: float,
    ):
        self.path = stage_file(out, stage)
        self.deadline = deadline
        self.start = time.monotonic()
        self.data: dict[str, Any] = {
            "stage": stage,
            "title": title,
            "status": "running",
            "budget_s": budget,
            "seconds": 0.0,
            "device": "",
            "rehearse": rehearse,
            "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "host": platform.node(),
            # The parent's command line (a child's own is internal).
            "command": os.environ.get("SHOAL_GPU_CHECK_COMMAND", ""),
            "columns": [list(c) for c in columns],
            "rows": [],
            "notes": [],
        }

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def row(self, **values: Any) -> dict[str, Any]:
        self.data["rows"].append(values)
        self.save()
        return values

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.save()

    def set(self, **fields: Any) -> None:
        self.data.update(fields)
        self.save()

    def finish(self, ok: bool) -> None:
        self.set(status="ok" if ok else "failed")

    def save(self) -> None:
        self.data["seconds"] = round(time.monotonic() - self.start, 2)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_plain) + "\n")
        os.replace(tmp, self.path)  # a reader never sees half a file


def _plain(value: Any) -> Any:
    """NumPy scalars and arrays as JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


class Context:
    """What a stage is given besides its record: the repository root, whether this is
    the CPU rehearsal, and the machine."""

    def __init__(self, root: Path, rehearse: bool, cells: str | None = None):
        self.root, self.rehearse, self.cells = root, rehearse, cells

    @property
    def gpu(self) -> bool:
        import jax

        return jax.default_backend() == "gpu"

    def device_name(self) -> str:
        import jax

        dev = jax.devices()[0]
        return dev.device_kind if self.gpu else f"{dev.platform} (no GPU)"

    @staticmethod
    def cpu_count() -> int:
        return os.cpu_count() or 0
