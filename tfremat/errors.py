"""Errors raised by tfremat. Each message says what is wrong and how to fix it."""

from __future__ import annotations


class TfrematError(Exception):
    """Base class of tfremat's errors."""


class BackendError(TfrematError, RuntimeError):
    """TensorFlow is missing or Keras runs on another backend."""


class UnsupportedModelError(TfrematError, ValueError):
    """The model cannot be traced or rewritten (unbuilt, unsupported kind)."""


class PlanValidationError(TfrematError, ValueError):
    """A plan is malformed for its graph (unknown ids, non-convex segments...)."""


class PlanMismatchError(PlanValidationError):
    """A plan was made for another graph."""


class BudgetError(TfrematError, ValueError):
    """The memory budget cannot be met.

    Attributes:
        budget_mb: The budget asked for, in MiB.
        min_budget_mb: The smallest budget the planner can meet, in MiB.
        planner: The planner that was asked.
    """

    def __init__(self, budget_mb: float, min_budget_mb: float, planner: str,
                 detail: str = "") -> None:
        self.budget_mb = budget_mb
        self.min_budget_mb = min_budget_mb
        self.planner = planner
        message = (
            f"A budget of {budget_mb:.1f} MiB cannot be met by planner {planner!r}: "
            f"the smallest feasible budget is {min_budget_mb:.1f} MiB."
        )
        if detail:
            message += " " + detail
        super().__init__(message)
