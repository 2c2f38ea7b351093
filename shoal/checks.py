"""Argument checks shared by every layer of shoal (NumPy only: no JAX here)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["check_int"]


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
