"""A run's progress on stderr: a tqdm bar where someone watches it (a terminal, a Jupyter
kernel), plain lines elsewhere (``shoal-run ... 2> log``, CI, a batch job), since a bar
redrawn with carriage returns makes one long line of a log file.

`progress_bar` chooses; `PlainProgress` writes a line on the steps `due` names.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm.auto import tqdm

# The training loop sets the postfix (loss, MB sent) every POSTFIX_EVERY steps and at each
# evaluation, the last step included: the plain lines are written there, so that the loss
# they show is that step's.
POSTFIX_EVERY = 10


def shows_bar(stream: Any) -> bool:
    """Whether ``stream`` can show a redrawn bar: a terminal, or a Jupyter kernel's output
    (not a terminal, but `tqdm.auto` draws a widget there)."""
    if type(stream).__module__.startswith("ipykernel"):
        return True
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except ValueError:  # a closed stream
        return False


def due(step: int, total: int) -> bool:
    """Whether `PlainProgress` writes a line after ``step`` of ``total``: about every tenth
    of the run, on a multiple of `POSTFIX_EVERY` steps, and at the last step.

    Example:
      >>> [s for s in range(1, 201) if due(s, 200)][:3], [s for s in range(1, 5) if due(s, 4)]
      ([20, 40, 60], [4])
    """
    every = POSTFIX_EVERY * max(1, round(total / (10 * POSTFIX_EVERY)))
    return step % every == 0 or step == total


class PlainProgress:
    """tqdm's ``update``, ``set_postfix`` and ``close``, writing one line per `due` step:
    ``"gtc: step 20/200, loss=0.6931, MB sent=0.28, 4.1 s"`` (seconds since the start).
    A run stopped early (``--stop-after``) writes its last step at ``close``, without a
    postfix that was not set at that step.

    Example:
      >>> import io
      >>> out = io.StringIO()
      >>> p = PlainProgress(total=20, initial=0, desc="ssgd", file=out)
      >>> for step in range(1, 21):
      ...     p.update(1)
      ...     if step % 10 == 0:
      ...         p.set_postfix({"loss": f"{1 / step:.4f}"})
      >>> p.close()
      >>> [line.rsplit(",", 1)[0] for line in out.getvalue().splitlines()]
      ['ssgd: step 10/20, loss=0.1000', 'ssgd: step 20/20, loss=0.0500']
    """

    def __init__(self, total: int, initial: int, desc: str, file: TextIO | None = None):
        self.total, self.n, self.desc = total, initial, desc
        self.file = file
        self.start = time.perf_counter()
        self.written = initial  # the last step a line was written for
        self.postfix: dict[str, Any] = {}
        self.postfix_step = -1

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, values: dict[str, Any]) -> None:
        self.postfix, self.postfix_step = dict(values), self.n
        if due(self.n, self.total):
            self._write()

    def close(self) -> None:
        if self.n > self.written:
            self._write()

    def _write(self) -> None:
        parts = [f"{self.desc}: step {self.n}/{self.total}"]
        if self.postfix_step == self.n:
            parts += [f"{k}={v}" for k, v in self.postfix.items()]
        parts.append(f"{time.perf_counter() - self.start:.1f} s")
        # sys.stderr looked up now, not at import: pytest and callers may replace it.
        print(", ".join(parts), file=self.file or sys.stderr, flush=True)
        self.written = self.n


def progress_bar(total: int, initial: int, desc: str, enabled: bool) -> tqdm | PlainProgress:
    """A tqdm bar when stderr `shows_bar`, else `PlainProgress`; a disabled bar (which
    writes nothing) when not ``enabled`` (``--no-progress``, a process other than the
    root)."""
    if enabled and not shows_bar(sys.stderr):
        return PlainProgress(total, initial, desc)
    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled)
