"""Several seeds of one entry, as a person reads them: the mean, the sample standard
deviation (``ddof=1``) and the count of each summary field (`by_entry`), and mean curves
over the seeds at each step (`band`). The per-seed values stay in ``metrics.jsonl``.

Every record and summary of a run carries ``"seed"``; one entry (its ``"algorithm"``
label) has one summary per seed. Rows without a seed count as one seed."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

# Summary fields whose None means 0 (`skipped`: no step skipped), not "not measured".
ABSENT_IS_ZERO = ("skipped",)


class Spread(NamedTuple):
    """``mean``, sample standard deviation ``std`` (None for one value) and count ``n``."""

    mean: float
    std: float | None
    n: int

    def overlaps(self, other: Spread) -> bool:
        """Whether the intervals mean ± std of the two overlap; False unless both have a
        spread (n >= 2): one seed tells no difference from noise.

        Example:
          >>> Spread(0.80, 0.02, 3).overlaps(Spread(0.83, 0.015, 3))
          True
          >>> Spread(0.80, 0.01, 3).overlaps(Spread(0.83, 0.01, 3))
          False
        """
        if self.std is None or other.std is None:
            return False
        return abs(self.mean - other.mean) <= self.std + other.std


def spread(values: Sequence[float]) -> Spread:
    """``values`` as a `Spread`: mean and sample std (ddof=1), std None for one value.

    Example:
      >>> spread([1.0, 2.0, 6.0])
      Spread(mean=3.0, std=2.6457513110645907, n=3)
      >>> spread([0.5])
      Spread(mean=0.5, std=None, n=1)
      >>> spread([55.52] * 3)  # equal seeds: no ulp of spread from the mean's rounding
      Spread(mean=55.52, std=0.0, n=3)
    """
    if not values:
        raise ValueError("spread: no values")
    x = np.asarray(values, dtype=np.float64)
    if len(x) > 1 and np.all(x == x[0]):  # equal seeds: exactly that value, std 0 (np.mean
        return Spread(float(x[0]), 0.0, len(x))  # of equal values can be an ulp off them)
    std = float(np.std(x, ddof=1)) if len(x) > 1 else None
    return Spread(float(np.mean(x)), std, len(x))


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def seeds_of(rows: Sequence[dict[str, Any]]) -> list[int | None]:
    """The distinct seeds of ``rows`` (records or summaries), in order; None for a row
    without one."""
    return list(dict.fromkeys(r.get("seed") for r in rows))


def by_entry(summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per entry label (``"algorithm"``), in the order of their first summary:
    ``"algorithm"``, ``"seeds"`` (the seeds, in order), and for every numeric field a
    `Spread` over the entry's seeds (None where no seed has a value; a non-finite value,
    a diverged run's NaN loss, makes the mean NaN). Other fields keep the first seed's.

    Example:
      >>> rows = by_entry([{"algorithm": "a", "seed": 0, "loss": 1.0},
      ...                  {"algorithm": "a", "seed": 1, "loss": 3.0}])
      >>> rows[0]["seeds"], rows[0]["loss"].mean, rows[0]["loss"].n
      ([0, 1], 2.0, 2)
    """
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in summaries:
        groups.setdefault(s["algorithm"], []).append(s)
    rows = []
    for label, group in groups.items():
        row: dict[str, Any] = {"algorithm": label, "seeds": seeds_of(group)}
        keys = dict.fromkeys(k for s in group for k in s if k not in ("algorithm", "seed"))
        for key in keys:
            values = [s.get(key) for s in group]
            if key in ABSENT_IS_ZERO and any(v is not None for v in values):
                values = [0 if v is None else v for v in values]
            present = [v for v in values if v is not None]
            if present and all(_numeric(v) for v in present):
                row[key] = spread([float(v) for v in present])
            elif present:
                row[key] = present[0]
            else:
                row[key] = None
        rows.append(row)
    return rows


class Band(NamedTuple):
    """A mean curve over seeds: ``x`` and ``mean`` at each point, ``std`` (None with one
    seed) and the number of seeds ``n``."""

    x: np.ndarray
    mean: np.ndarray
    std: np.ndarray | None
    n: int


def band(
    records: Sequence[dict[str, Any]],
    label: str,
    y: str,
    x: str = "step",
    per_seed: Callable[[list[float]], list[float]] | None = None,
) -> Band:
    """The mean of ``y`` over the seeds of entry ``label`` at each step where a record has
    it, with its sample std (ddof=1) over the seeds; ``x`` is the mean of ``x`` over those
    records. ``per_seed`` transforms each seed's ``y`` first (a moving average), so the
    band spreads the curves as drawn. A step some seed lacks averages the others.

    Example:
      >>> rows = [{"algorithm": "a", "seed": s, "step": t, "loss": s + t}
      ...         for s in (0, 2) for t in (1, 2)]
      >>> b = band(rows, "a", "loss")
      >>> b.x.tolist(), b.mean.tolist(), b.n
      ([1.0, 2.0], [2.0, 3.0], 2)
    """
    mine = [r for r in records if r["algorithm"] == label and r.get(y) is not None]
    by_seed: dict[Any, list[dict[str, Any]]] = {}
    for r in mine:
        by_seed.setdefault(r.get("seed"), []).append(r)
    ys: dict[int, list[float]] = {}
    xs: dict[int, list[float]] = {}
    for rows in by_seed.values():
        values = [float(r[y]) for r in rows]
        if per_seed is not None:
            values = list(per_seed(values))
        for r, v in zip(rows, values, strict=True):
            ys.setdefault(r["step"], []).append(v)
            xs.setdefault(r["step"], []).append(float(r[x]))
    steps = sorted(ys)
    n = len(by_seed)
    mean = np.array([np.mean(ys[t]) for t in steps])
    x_mean = np.array([np.mean(xs[t]) for t in steps])
    std = None
    if n > 1:
        std = np.array([np.std(ys[t], ddof=1) if len(ys[t]) > 1 else math.nan for t in steps])
    return Band(x_mean, mean, std, n)
