"""Which entries share a panel and in which colour: `facets` puts each algorithm family
(`shoal.experiments.algorithms.FAMILIES`) in its own panels of at most `PER_PANEL`
curves, the reference in every one; `algorithm_colors` gives every entry of a run its own
colour, the same in every panel and file (the reference black)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import to_hex, to_rgb

from shoal.experiments import algorithms

PER_PANEL = 8
REFERENCE_COLOR = "#000000"
# Colours far from the reference's black and the white background: CIELAB lightness
# between these, so that a thin line and a faint band both show.
LIGHTNESS = (25.0, 70.0)

# sRGB (D65) to CIE XYZ, and the D65 white point: IEC 61966-2-1.
_XYZ = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]])
_WHITE = np.array([0.9505, 1.0, 1.089])


def lab(rgb: np.ndarray) -> np.ndarray:
    """sRGB in [0, 1] (last axis) to CIELAB: ``L`` in [0, 100], Euclidean distances
    roughly as different as they look (delta E 1976)."""
    rgb = np.asarray(rgb, dtype=np.float64)
    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    t = linear @ _XYZ.T / _WHITE
    d = 6 / 29
    f = np.where(t > d**3, np.cbrt(t), t / (3 * d * d) + 4 / 29)
    fx, fy, fz = f[..., 0], f[..., 1], f[..., 2]
    return np.stack([116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)], axis=-1)


@functools.cache
def palette(n: int) -> tuple[str, ...]:
    """``n`` distinct colours: tab10's without its grey, then each next one the colour of
    a 13-level sRGB grid (lightness in `LIGHTNESS`) farthest in CIELAB from black, white
    and every colour before it. No two are alike however many a run needs (any two
    of the first 24 differ by delta E >= 27, tab10's own least).

    Example:
      >>> palette(3)
      ('#1f77b4', '#ff7f0e', '#2ca02c')
    """
    tab10 = [to_rgb(colormaps["tab10"](i)) for i in range(10) if i != 7]
    grid = np.linspace(0.0, 1.0, 13)
    candidates = np.stack(np.meshgrid(grid, grid, grid, indexing="ij"), -1).reshape(-1, 3)
    lab_c = lab(candidates)
    ok = (lab_c[:, 0] >= LIGHTNESS[0]) & (lab_c[:, 0] <= LIGHTNESS[1])
    candidates, lab_c = candidates[ok], lab_c[ok]
    chosen = tab10[:n]
    taken = [(0.0, 0.0, 0.0), (1.0, 1.0, 1.0), *chosen]
    nearest = np.min([np.linalg.norm(lab_c - lab(c), axis=1) for c in taken], axis=0)
    while len(chosen) < n:
        i = int(np.argmax(nearest))
        chosen.append(tuple(candidates[i]))
        nearest = np.minimum(nearest, np.linalg.norm(lab_c - lab_c[i], axis=1))
    return tuple(to_hex(c) for c in chosen)


def algorithm_colors(names: Sequence[str]) -> dict[str, str]:
    """One colour per entry: the reference (`shoal.experiments.algorithms.is_reference`)
    black, the others `palette` colours in the order given."""
    others = [n for n in names if not algorithms.is_reference(n)]
    colors = dict(zip(others, palette(len(others)), strict=True))
    return {n: REFERENCE_COLOR if algorithms.is_reference(n) else colors[n] for n in names}


def family_of(label: str) -> str | None:
    """The family the entry ``label``'s algorithm registered (None: not registered, or
    made without `shoal.experiments.algorithms.register`)."""
    algo = algorithms.ALGORITHMS.get(algorithms.parse_entry(label)[0])
    return None if algo is None else algo.family


def facets(names: Sequence[str]) -> list[tuple[str, list[str]]]:
    """``(title, entries)`` per panel: one family's entries in the order given, the
    reference first in every panel, titled with the family and its meaning; the families
    in the order of `shoal.experiments.algorithms.FAMILIES`, then any other, then the
    entries of none ("other"). A family with more than fits beside the reference in
    `PER_PANEL` curves is split into panels of nearly equal size, titled "(1/2)", "(2/2)".
    A run of the reference alone is one panel.

    Example:
      >>> for title, entries in facets(["ssgd", "gtc", "bmuf", "bfb_allreduce"]):
      ...     print(title.split(":")[0], entries)
      dense ['ssgd', 'bfb_allreduce']
      compressed ['ssgd', 'gtc']
      local ['ssgd', 'bmuf']
    """
    reference = [n for n in names if algorithms.is_reference(n)]
    room = PER_PANEL - len(reference)
    own = [f for f in map(family_of, names) if f is not None and f not in algorithms.FAMILIES]
    order = [*algorithms.FAMILIES, *dict.fromkeys(own), None]
    panels = []
    for family in order:
        members = [n for n in names if n not in reference and family_of(n) == family]
        if not members:
            continue
        count = math.ceil(len(members) / room)
        meaning = algorithms.FAMILIES.get(family)
        for i, part in enumerate(np.array_split(np.arange(len(members)), count)):
            title = family or "other"
            title += "" if count == 1 else f" ({i + 1}/{count})"
            title += f": {meaning}" if meaning else ""
            panels.append((title, reference + [members[j] for j in part]))
    return panels or [("", list(reference))]
