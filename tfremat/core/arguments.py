"""Checks of counts the user passes (batch sizes, trials, re-plans), and a hint on
budgets that look like bytes."""

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


#: A budget of this many bytes (1 TiB) or more is more than any accelerator
#: holds: most likely a number of bytes given where MiB are asked for.
IMPLAUSIBLE_BUDGET_BYTES = 2**40


def budget_unit_hint(budget_bytes: int | float | None) -> str:
    """What to say of a budget no device holds, or "" for a plausible one.

    Budgets are given in MiB (`budget_mb`); `budget_mb=6e9` asks for 5.6 PiB
    and every step fits it. Nothing is refused: a huge budget is also the way
    to have the `Planner` only measure (`Planner(1e9)`).

    Example:

    ```python
    budget_unit_hint(200 * 2**40)  # budget_mb=200 * 2**20: 200 MiB given in bytes
    # ' (budgets are in MiB: 209,715,200 MiB is 200.0 TiB; given in bytes,
    #   200.0 MiB would be budget_mb=200.0)'
    ```
    """
    if budget_bytes is None or budget_bytes < IMPLAUSIBLE_BUDGET_BYTES:
        return ""
    mib = budget_bytes / 2**20
    return (f" (budgets are in MiB: {mib:,.0f} MiB is {budget_bytes / 2**40:,.1f} TiB; "
            f"given in bytes, {mib / 2**20:,.1f} MiB would be budget_mb={mib / 2**20:.1f})")
