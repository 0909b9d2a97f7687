"""Checks of counts the user passes (batch sizes, trials, re-plans)."""

from __future__ import annotations

import numbers
from typing import Any


def check_count(value: Any, name: str, minimum: int = 1) -> int:
    """`value`, an integer of at least `minimum`, or a clear error.

    Raises:
        TypeError: not an integer (a float, a string, None, a bool).
        ValueError: below `minimum`.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        least = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise ValueError(f"{name} must be {least}, got {value!r}.")
    return int(value)
