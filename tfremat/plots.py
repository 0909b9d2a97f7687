"""The memory timeline of a plan: predicted device memory over one training step.

No TensorFlow and no Graphviz: matplotlib draws on its Agg canvas (no screen, no
pyplot state). `Plan.plot_timeline` calls `plot_memory` (this module registers
itself with `tfremat.core.set_plan_plots` when imported, as `tfremat` does).
"""

from __future__ import annotations

import io
import os
import sys
from typing import TYPE_CHECKING, Sequence

from tfremat.core import MIB, Plan, PlanGraph, set_plan_plots
from tfremat.simulation import Estimate, simulate

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: Labels of the plotted lines, which tests and readers look up.
PLAIN_LABEL = "without plan"
PLANNED_LABEL = "with plan"
BUDGET_LABEL = "budget"
MEASURED_LABEL = "measured peak"


def _is_recompute(label: str) -> bool:
    """Whether a schedule step belongs to a segment's recomputation."""
    return "(recompute" in label


def _spans(flags: Sequence[bool]) -> list[tuple[int, int]]:
    """`(first, last)` index of each run of True in `flags`."""
    spans, start = [], None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            spans.append((start, i - 1))
            start = None
    return spans


def _measured_list(measured_mb: float | Sequence[float] | None) -> list[float]:
    if measured_mb is None:
        return []
    if isinstance(measured_mb, (int, float)):
        return [float(measured_mb)]
    return [float(m) for m in measured_mb]


def memory_figure(graph: PlanGraph, plan: Plan | None = None, *,
                  measured_mb: float | Sequence[float] | None = None,
                  budget_mb: float | None = None) -> "Figure":
    """The memory timeline as a matplotlib `Figure` (not shown, not saved).

    The x axis is the simulator's schedule: the forward pass, the loss, the
    backward pass (with each segment's recomputation, shaded) and the
    optimizer update. The y axis is the device memory in use in MiB (the
    allocator's chunks), persistent bytes (weights, optimizer slots, batch)
    included, as `tfremat.simulate` predicts it.

    Args:
        graph: The PlanGraph.
        plan: A Plan for `graph`, or None for the plain step only.
        measured_mb: Measured peaks in MiB (e.g. one per epoch), drawn as
            horizontal lines.
        budget_mb: The budget line, in MiB; by default the plan's
            `budget_bytes` (none without a plan).

    Returns:
        A `matplotlib.figure.Figure`; its lines carry the labels
        `PLAIN_LABEL`, `PLANNED_LABEL`, `BUDGET_LABEL` and `MEASURED_LABEL`.

    Raises:
        PlanMismatchError: the plan was made for another graph.
        PlanValidationError: the plan is malformed for `graph`.

    Example:

    >>> fig = tfremat.plots.memory_figure(graph, plan)
    >>> fig.savefig("memory.svg")
    """
    from matplotlib.figure import Figure

    plain = simulate(graph)
    if plan is not None:
        plan = plan.for_graph(graph)
    planned = simulate(graph, plan) if plan is not None and not plan.is_empty else None
    fig = Figure(figsize=(10, 4.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.plot(_plain_steps(plain, planned), _mb(plain), color="#888888", lw=1.4,
            label=f"{PLAIN_LABEL} (peak {plain.peak_mb:,.1f} MiB)")
    if planned is not None:
        _draw_plan(ax, plan, planned)
    if budget_mb is None and plan is not None and plan.budget_bytes:
        budget_mb = plan.budget_bytes / MIB
    if budget_mb is not None:
        ax.axhline(budget_mb, color="#d62728", ls="--", lw=1.2,
                   label=f"{BUDGET_LABEL} {budget_mb:,.1f} MiB")
    measured = _measured_list(measured_mb)
    for i, peak in enumerate(measured):
        label = (f"{MEASURED_LABEL} ({', '.join(f'{m:,.1f}' for m in measured)} MiB)"
                 if i == 0 else None)
        ax.axhline(peak, color="#2ca02c", ls=":", lw=1.4, label=label)
    ax.axhline(plain.persistent_bytes / MIB, color="#bbbbbb", lw=0.8)
    ax.text(0, plain.persistent_bytes / MIB, " weights, optimizer slots, batch",
            va="bottom", fontsize=8, color="#777777")
    title = f"{graph.name}: device memory over one training step (predicted)"
    if plan is not None:
        title += f", plan by {plan.planner}"
    ax.set_title(title)
    ax.set_xlabel("step of the schedule (forward, loss, backward, optimizer update)")
    ax.set_ylabel("device memory in use (MiB)")
    ax.set_ylim(bottom=0)
    ax.margins(x=0.01)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return fig


def _plain_steps(plain: Estimate, planned: Estimate | None) -> list[int]:
    """Where the plain step's points go on the x axis: at the planned
    schedule's step of the same layer call, so the two lines compare call by
    call across the recomputations only the plan has."""
    step_of = {} if planned is None else {
        label: i for i, (label, _) in reversed(list(enumerate(planned.timeline)))
        if not _is_recompute(label)}
    xs = [step_of.get(label) for label, _ in plain.timeline]
    if None in xs or xs != sorted(xs):
        return list(range(len(plain.timeline)))
    return xs


def _mb(est: Estimate) -> list[float]:
    return [nbytes / MIB for _, nbytes in est.timeline]


def _draw_plan(ax: "Axes", plan: Plan, est: Estimate) -> None:
    """The planned line, its recompute spans and its offloaded tensors."""
    ys = _mb(est)
    labels = [label for label, _ in est.timeline]
    ax.plot(range(len(ys)), ys, color="#1f77b4", lw=1.6,
            label=f"{PLANNED_LABEL} (peak {est.peak_mb:,.1f} MiB, +{est.overhead:.0%} compute)")
    for k, (first, last) in enumerate(_spans([_is_recompute(lb) for lb in labels])):
        ax.axvspan(first - 0.5, last + 0.5, color="#ff7f0e", alpha=0.18, lw=0,
                   label="recomputation" if k == 0 else None)
    step_of = {label: i for i, label in enumerate(labels)}
    for k, off in enumerate(plan.offloaded):
        node = off.tensor.rsplit(":", 1)[0]
        made = step_of.get(f"fwd {node}")
        back = step_of.get(f"bwd {off.prefetch_after}") if off.prefetch_after else None
        if made is None:
            continue
        ax.plot([made], [ys[made]], marker="v", color="#9467bd", ls="none", ms=8,
                label="offloaded to host (v), copied back (^)" if k == 0 else None)
        ax.annotate(node, (made, ys[made]), textcoords="offset points", xytext=(0, 8),
                    fontsize=7, ha="center", color="#9467bd")
        if back is not None:
            ax.plot([back], [ys[back]], marker="^", color="#9467bd", ls="none", ms=8)


def plot_memory(plan: Plan, path: str | os.PathLike, *, graph: PlanGraph | None = None,
                measured_mb: float | Sequence[float] | None = None,
                budget_mb: float | None = None) -> str:
    """Writes the memory timeline of one training step to an image.

    Device memory over the step as the simulator predicts it, without the
    plan (grey) and with it (blue), the budget (red), the measured peaks when
    given (green), the spans where segments are recomputed (shaded orange),
    and offloaded tensors (purple markers). Needs matplotlib only: no
    Graphviz, no screen.

    Args:
        plan: The Plan (an empty plan draws the plain step and the budget).
        path: Image file; its extension picks the format (`.png`, `.svg`,
            `.pdf`, ...).
        graph: The PlanGraph, when the plan does not carry one.
        measured_mb: Measured peaks in MiB (one number, or one per epoch).
        budget_mb: The budget drawn, in MiB, when it is not the plan's own
            (the `Planner` draws your budget, also after re-planning for less).

    Returns:
        `path`.

    Raises:
        ValueError: the plan carries no graph and none was given.
        PlanMismatchError: the plan was made for another graph.

    Example:

    ```python
    plan = tfremat.plan(model, budget_mb=200, batch_size=16)
    tfremat.plot_memory(plan, "memory.png")
    ```
    """
    path = os.fspath(path)
    fig = memory_figure(plan.graph_or(graph), plan, measured_mb=measured_mb,
                        budget_mb=budget_mb)
    fig.savefig(path)
    return path


def memory_png(graph: PlanGraph, plan: Plan | None = None, *,
               measured_mb: float | Sequence[float] | None = None,
               budget_mb: float | None = None) -> bytes:
    """The memory timeline as PNG bytes (for TensorBoard and other sinks).

    Args:
        graph: The PlanGraph.
        plan: A Plan for `graph`, or None.
        measured_mb: Measured peaks in MiB.
        budget_mb: The budget drawn, as for `memory_figure`.

    Returns:
        The encoded PNG.
    """
    buffer = io.BytesIO()
    memory_figure(graph, plan, measured_mb=measured_mb,
                  budget_mb=budget_mb).savefig(buffer, format="png")
    return buffer.getvalue()


# `Plan.plot_timeline()` draws with this module.
set_plan_plots(sys.modules[__name__])
