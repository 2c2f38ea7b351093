"""Argument checks shared by every layer of shoal (NumPy only: no JAX here)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["check_int", "check_real"]


def check_int(
    name: str, value: Any, low: int | None = None, high: int | None = None, why: str = ""
) -> int:
    """``value`` as a Python int, if it is an integer in ``[low, high]``.

    Python and NumPy integers are accepted; bools, floats (even ``2.0``) and arrays are not.

    Args:
      name: the parameter, as the error names it.
      value: the value to check.
      low, high: the bounds, inclusive; None: unbounded on that side.
      why: text put right after the allowed range in the error: a reason for a bound
        (``" (chunk_size ** 2)"``) or another accepted value (``" or None"``).

    Returns:
      ``int(value)``.

    Raises:
      ValueError: ``"NAME must be an int >= LOW{why}, got VALUE"`` (or ``an int <= HIGH``,
        ``an int in [LOW, HIGH]``, ``an int``).

    Example:
      >>> import numpy as np
      >>> check_int("rank", np.int64(4), 1)
      4
      >>> check_int("rank", True, 1)
      Traceback (most recent call last):
      ...
      ValueError: rank must be an int >= 1, got True
    """
    if low is None and high is None:
        allowed = "an int"
    elif high is None:
        allowed = f"an int >= {low}"
    elif low is None:
        allowed = f"an int <= {high}"
    else:
        allowed = f"an int in [{low}, {high}]"
    is_int = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not is_int or (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be {allowed}{why}, got {value!r}")
    return int(value)


def check_real(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    open_low: bool = False,
    open_high: bool = False,
    why: str = "",
) -> float:
    """``value`` as a Python float, if it is a finite real number between ``low`` and ``high``.

    Python and NumPy integers and floats are accepted; bools, strings and arrays are not.

    Args:
      name: the parameter, as the error names it.
      value: the value to check.
      low, high: the bounds; None: unbounded on that side.
      open_low, open_high: exclude that bound (``(0, 1]`` is ``low=0, high=1,
        open_low=True``).
      why: text put right after the allowed range in the error (``" or a schedule"``).

    Returns:
      ``float(value)``.

    Raises:
      ValueError: ``"NAME must be a number in [LOW, HIGH){why}, got VALUE"`` with both
        bounds, ``"NAME must be a finite number > LOW"`` (or ``>=``, ``<``, ``<=``) with
        one, ``"NAME must be a finite number"`` with none.

    Example:
      >>> check_real("beta", 0.5, 0, 1, open_low=True)
      0.5
      >>> check_real("beta", True, 0, 1, open_low=True)
      Traceback (most recent call last):
      ...
      ValueError: beta must be a number in (0, 1], got True
    """
    if low is not None and high is not None:
        allowed = f"a number in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    elif low is not None:
        allowed = f"a finite number {'>' if open_low else '>='} {low}"
    elif high is not None:
        allowed = f"a finite number {'<' if open_high else '<='} {high}"
    else:
        allowed = "a finite number"
    real = isinstance(value, (int, float, np.integer, np.floating))
    v = float(value) if real and not isinstance(value, (bool, np.bool_)) else float("nan")
    bad = not np.isfinite(v)
    bad = bad or (low is not None and (v <= low if open_low else v < low))
    bad = bad or (high is not None and (v >= high if open_high else v > high))
    if bad:
        raise ValueError(f"{name} must be {allowed}{why}, got {value!r}")
    return v
