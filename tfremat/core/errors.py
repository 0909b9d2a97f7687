"""Errors raised by tfremat. Each message says what is wrong and how to fix it."""

from __future__ import annotations

import math
from typing import Any

#: Bytes in a MiB: budgets are given in MiB (2**20 bytes).
MIB = 2**20


class TfrematError(Exception):
    """Base class of tfremat's errors: catch it to handle any of them.

    Example:

    ```python
    try:
        plan = tfremat.plan(model, budget_mb=200, batch_size=16)
    except tfremat.TfrematError as e:
        print(f"tfremat could not plan: {e}")
    ```
    """


class BackendError(TfrematError, RuntimeError):
    """TensorFlow is missing or Keras runs on another backend.

    Fix: install TensorFlow (`pip install 'tfremat[cpu]'`, `[gpu]` or `[tf]`)
    and run Keras on it (`KERAS_BACKEND=tensorflow`, the default).

    Example:

    ```python
    try:
        tfremat.extract(model, batch_size=16)
    except tfremat.BackendError as e:
        print(e)  # says what is missing and how to install it
    ```
    """


class UnsupportedModelError(TfrematError, ValueError):
    """The model cannot be traced or rewritten (unbuilt, unsupported kind).

    The message names the fix: build the model (call it on a batch), pass
    `sample=(x, y)` for a model without known inputs, and so on.

    Example:

    ```python
    model = MySubclassedModel()
    try:
        tfremat.extract(model, batch_size=16)  # never called: not built
    except tfremat.UnsupportedModelError:
        model(x[:1])
        graph = tfremat.extract(model, sample=(x[:16], y[:16]))
    ```
    """


class PlanValidationError(TfrematError, ValueError):
    """A plan is malformed for its graph (unknown ids, non-convex segments...).

    Plans made by tfremat's planners pass validation; this is raised for plans
    written by hand or edited JSON. The message names the offending node or
    segment.

    Example:

    ```python
    graph = tfremat.extract(model, batch_size=16)
    plan = tfremat.Plan.from_segments(graph, [["conv1", "head"]])
    try:
        plan.validate(graph)
    except tfremat.PlanValidationError as e:
        print(e)  # e.g. the segment is not convex: a path leaves and re-enters it
    ```
    """


class PlanMismatchError(PlanValidationError):
    """A plan was made for another graph.

    A plan records the fingerprint of the layer graph it was made for; a model
    whose layers, connections or their order differ gets a new plan. The same
    model with other layer names (Keras numbers unnamed layers per process)
    takes the plan, renamed (`Plan.for_graph`).

    Example:

    ```python
    plan = tfremat.Plan.from_json("plan.json")
    try:
        smaller = tfremat.rewrite(model, plan)
    except tfremat.PlanMismatchError:
        smaller = tfremat.rewrite(model, budget_mb=200, batch_size=16)
    ```
    """


class BudgetError(TfrematError, ValueError):
    """The memory budget cannot be met.

    Args:
        budget_bytes: The budget asked for, in bytes (None: no budget given).
        min_budget_bytes: The smallest budget the planner can meet, in bytes:
            the lowest peak the simulator predicts for any plan it tried, or
            with `measured` the measured one (see `tfremat.plan`).
        planner: The planner that was asked.
        detail: More text for the message (what was tried, what to do).
        measured: Whether the minimum was measured on the device
            (`tfremat.plan(..., measure=True)`, the `Planner`) rather than
            predicted by the simulator; the message says which.

    Attributes:
        budget_bytes: As given.
        min_budget_bytes: As given.
        planner: As given.
        detail: As given.
        measured: As given.
        budget_mb: `budget_bytes` in MiB (0 when None).
        min_budget_mb: `min_budget_bytes` in MiB.
        feasible_mb: `min_budget_mb` rounded up to 0.1 MiB: the figure the
            messages state, itself a budget that can be met.
        measured_plan: Set by `tfremat.plan(..., measure=True)` when no plan it
            measured fits: the plan that measured lowest (its estimate details
            hold `"measured_peak_bytes"`), for a caller that trains anyway, as
            the `Planner` callback does. None otherwise.

    Example:

    ```python
    try:
        plan = tfremat.plan(model, budget_mb=100, batch_size=32, measure=True)
    except tfremat.BudgetError as e:
        if e.measured_plan is None:  # not measured: the minimum is a prediction
            raise
        plan = e.measured_plan       # measured lowest, within e.min_budget_mb
    ```
    """

    #: How the message of a predicted minimum says it can be measured; the
    #: command line names its own `--measure` instead.
    MEASURE_HINT = "tfremat.plan(..., measure=True) measures plans on the device"

    def __init__(self, budget_bytes: int | None, min_budget_bytes: int, planner: str,
                 detail: str = "", measured: bool = False) -> None:
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = int(min_budget_bytes)
        self.planner = planner
        self.detail = detail
        self.measured = measured
        self.measured_plan: Any = None
        how = ("measured on the device" if measured else
               f"as the simulator predicts it, not measured: {self.MEASURE_HINT}")
        message = (
            f"A budget of {_mib_text(self.budget_bytes or 0)} cannot be met by planner "
            f"{planner!r}: "
            f"the smallest feasible budget is {self.feasible_mb:.1f} "
            f"MiB ({self.min_budget_bytes} bytes), {how}."
        )
        if detail:
            message += " " + detail
        super().__init__(message)

    @property
    def budget_mb(self) -> float:
        return (self.budget_bytes or 0) / MIB

    @property
    def min_budget_mb(self) -> float:
        return self.min_budget_bytes / MIB

    @property
    def feasible_mb(self) -> float:
        # Rounded up, so that a user who copies the figure gets a plan.
        return math.ceil(self.min_budget_mb * 10) / 10

    def __reduce__(self) -> tuple:  # picklable with its arguments (subprocesses)
        return (type(self), (self.budget_bytes, self.min_budget_bytes, self.planner,
                             self.detail, self.measured))


def _mib_text(nbytes: int) -> str:
    """`nbytes` in MiB to 0.1 MiB, or in bytes below 0.05 MiB (which would
    read as 0.0 MiB)."""
    if nbytes < 0.05 * MIB:
        return f"{nbytes} bytes ({nbytes / MIB:.2g} MiB)"
    return f"{nbytes / MIB:.1f} MiB"
