"""How slow each simulated worker is at each step: factors on one worker's compute time.

A spec is one or more terms joined by ``*`` (their factors multiply):

* ``F``: every worker's compute takes ``F`` times as long (``1``: the measured time).
* ``F@WORKERS``: those workers only, e.g. ``2@0-1`` (workers 0 and 1 twice as slow) or
  ``3@0+5-7`` (``+`` joins ranges; ``i-j`` includes both ends).
* ``lognormal:S``: per worker and step, ``exp(S z)`` with ``z`` standard normal: the
  jitter of shared machines (median 1).
* ``pareto:A``: per worker and step, ``1 + X`` with ``X`` Lomax-distributed with shape
  ``A`` (NumPy's ``pareto``): heavy-tailed stragglers, mean ``1 + 1/(A - 1)`` for
  ``A > 1``.
* ``trace:PATH``: a text file with a row of factors per step and a column per worker
  (spaces or commas between them; ``#`` starts a comment); rows repeat from the top when
  the run is longer than the file.

Draws come from NumPy's generator seeded by ``seed``: the same spec, shape and seed give
the same factors, bit for bit.

Example:
  >>> from shoal.costmodel.speeds import speed_factors
  >>> speed_factors("2@1-2", steps=1, workers=4, seed=0).tolist()
  [[1.0, 2.0, 2.0, 1.0]]
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["check_speeds", "speed_factors"]

DISTRIBUTIONS = ("lognormal", "pareto")
_STREAM = 0x5EED  # the generator's second seed word: speeds do not share the data's stream


def worker_set(text: str, workers: int, spec: str, field: str = "speeds") -> list[int]:
    """The workers ``text`` names (``i``, ``i-j``, joined by ``+``), checked against
    ``workers``; errors name ``field = spec``."""
    out: list[int] = []
    for part in text.split("+"):
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(
                f"{field} = {spec!r}: workers {text!r} must be i, i-j or ranges joined by '+'"
            ) from None
        if not 0 <= a <= b < workers:
            raise ValueError(
                f"{field} = {spec!r}: workers {part!r} must lie in 0-{workers - 1} "
                f"({workers} workers), low to high"
            )
        out += range(a, b + 1)
    return out


def _number(text: str, what: str, spec: str, low: float = 0.0) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not np.isfinite(value) or value <= low:
        raise ValueError(
            f"speeds = {spec!r}: {what} must be a finite number > {low:g}, got {text!r}"
        )
    return value


def _trace(path: str, steps: int, workers: int, spec: str) -> np.ndarray:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"speeds = {spec!r}: cannot read the trace {path!r}: {e}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].replace(",", " ").split()
        if not line:
            continue
        if len(line) != workers:
            raise ValueError(
                f"speeds = {spec!r}: trace {path!r} line {number} has {len(line)} factors, "
                f"one per worker ({workers}) is needed"
            )
        rows.append([_number(x, f"line {number}'s factor", spec) for x in line])
    if not rows:
        raise ValueError(f"speeds = {spec!r}: trace {path!r} holds no rows of factors")
    table = np.asarray(rows, np.float64)
    return table[np.arange(steps) % len(table)]


def speed_factors(spec: str, *, steps: int, workers: int, seed: int) -> np.ndarray:
    """``[steps, workers]`` factors on each worker's compute time per step, from ``spec``
    (the module's grammar; ``""`` is ``"1"``).

    Args:
      spec: the speeds, e.g. ``"2@0-1*lognormal:0.2"``.
      steps, workers: the run's shape.
      seed: the seed of the random terms.

    Returns:
      a float64 array of factors > 0.

    Raises:
      ValueError: a term that does not parse or is out of range, named with the spec.
    """
    out = np.ones((steps, workers))
    rng = np.random.default_rng([seed, _STREAM])
    for term in filter(None, (t.strip() for t in spec.split("*"))):
        kind, colon, arg = term.partition(":")
        if colon and kind == "trace":
            out *= _trace(arg, steps, workers, spec)
        elif colon and kind == "lognormal":
            sigma = _number(arg, "lognormal's sigma", spec)
            out *= np.exp(sigma * rng.standard_normal((steps, workers)))
        elif colon and kind == "pareto":
            shape = _number(arg, "pareto's shape", spec)
            out *= 1.0 + rng.pareto(shape, (steps, workers))
        elif colon:
            raise ValueError(
                f"speeds = {spec!r}: unknown term {kind!r}: one of F, F@WORKERS, "
                f"{', '.join(d + ':X' for d in DISTRIBUTIONS)}, trace:PATH"
            )
        else:
            factor, at, which = term.partition("@")
            f = _number(factor, "a factor", spec)
            if at:
                out[:, worker_set(which, workers, spec)] *= f
            else:
                out *= f
    return out


def check_speeds(spec: str, workers: int) -> None:
    """Raise ``ValueError`` unless ``spec`` parses for ``workers`` workers (one step
    drawn: a trace file is read)."""
    speed_factors(spec, steps=1, workers=workers, seed=0)
